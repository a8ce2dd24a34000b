"""The one error <-> status table (kvtier.errors.STATUS_CODES), read by the daemon and the client.

An error the daemon raises reaches the client as the class a caller catches, with its text; every
error class has a row, so none of them leaves the daemon as INTERNAL.
"""

from __future__ import annotations

import inspect

import grpc
import pytest
from kvtier.client.errors import from_rpc_error
from kvtier.server.errors import status_for

from kvtier import errors

S = grpc.StatusCode
CLASSES = sorted(
    (c for _, c in inspect.getmembers(errors, inspect.isclass)
     if issubclass(c, errors.KVTierError) and c is not errors.KVTierError),
    key=lambda c: c.__name__)


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _raise(cls: type[errors.KVTierError]) -> errors.KVTierError:
    return cls("pool", "must be set") if cls is errors.InvalidArgument else cls("pool 7 lost")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_has_a_status_row(cls: type[errors.KVTierError]) -> None:
    assert any(row is cls for row, _ in errors.STATUS_CODES)
    assert status_for(_raise(cls))[0] != S.INTERNAL


@pytest.mark.parametrize(("cls", "code", "back"), [
    (errors.InvalidArgument, S.INVALID_ARGUMENT, errors.InvalidArgument),
    (errors.ConfigError, S.INVALID_ARGUMENT, errors.InvalidArgument),
    (errors.NotFound, S.NOT_FOUND, errors.NotFound),
    (errors.FailedPrecondition, S.FAILED_PRECONDITION, errors.FailedPrecondition),
    (errors.CapacityError, S.RESOURCE_EXHAUSTED, errors.CapacityError),
    (errors.Unavailable, S.UNAVAILABLE, errors.Unavailable),
    (errors.DeadlineExceeded, S.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (errors.PageLost, S.DATA_LOSS, errors.PageLost),
    (errors.CorruptPage, S.DATA_LOSS, errors.PageLost),
    (errors.PermissionDenied, S.PERMISSION_DENIED, errors.PermissionDenied),
    (errors.Unauthenticated, S.UNAUTHENTICATED, errors.Unauthenticated),
])
def test_an_error_crosses_the_wire_as_the_class_a_caller_catches(
    cls: type[errors.KVTierError], code: grpc.StatusCode, back: type[errors.KVTierError]
) -> None:
    sent = _raise(cls)
    got_code, text = status_for(sent)
    assert got_code == code and text == str(sent)
    received = from_rpc_error(_Err(got_code, text))
    assert type(received) is back and str(received).endswith(str(sent))  # ConfigError: "request: "


def test_codes_no_daemon_error_sends() -> None:
    assert type(from_rpc_error(_Err(S.CANCELLED, "gone"))) is errors.Unavailable
    other = from_rpc_error(_Err(S.INTERNAL, "internal error"))
    assert type(other) is errors.KVTierError and str(other) == "internal error [INTERNAL]"
    assert status_for(TimeoutError()) == (S.DEADLINE_EXCEEDED, "deadline exceeded")
    assert status_for(RuntimeError("secret")) == (S.INTERNAL, "internal error (see the daemon log)")
