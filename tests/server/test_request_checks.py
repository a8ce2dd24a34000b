"""Request bodies and fields a real daemon must refuse: undecodable bodies, bad timeouts, an
unbounded layout, and error texts that name the field the caller actually sent."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from kvtier_daemon_fixture import Daemon

from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

S = grpc.StatusCode
TENANT = "checks"


@pytest.fixture(scope="module")
def channel(daemon: Daemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.address) as ch:
        yield ch


def raw_call(ch: grpc.Channel, method: str, body: bytes, stream: bool = False) -> grpc.RpcError:
    path = f"/kvtier.v1.KVTier/{method}"
    with pytest.raises(grpc.RpcError) as err:
        if stream:
            list(ch.unary_stream(path)(body, timeout=10))
        else:
            ch.unary_unary(path)(body, timeout=10)
    return err.value


@pytest.mark.parametrize("method,message,body,stream", [
    ("Attach", "AttachRequest", b"\xff\xff\xff\xff", False),       # truncated varint tag
    ("Attach", "AttachRequest", b"\x0a\x02\xff\xfe", False),       # tenant not UTF-8
    ("Acquire", "AcquireRequest", b"\x12\x05\x01", False),         # page_ids longer than body
    ("Lookup", "LookupRequest", b"\x0a\x10abc", False),
    ("WatchEvents", "WatchRequest", b"\x0a\x01\x80", True),        # stream: same answer
    ("LoadLayers", "LoadLayersRequest", b"\x22\x05\x01", True),  # bounds past the body
])
def test_undecodable_body_is_invalid_argument_without_internals(
    channel: grpc.Channel, method: str, message: str, body: bytes, stream: bool
) -> None:
    err = raw_call(channel, method, body, stream)
    assert err.code() == S.INVALID_ARGUMENT
    assert err.details() == f"request: malformed {message}"


def test_daemon_counts_the_malformed_call_and_keeps_serving(daemon: Daemon,
                                                          channel: grpc.Channel) -> None:
    raw_call(channel, "Stats", b"\xff")
    stub = pb_grpc.KVTierStub(channel)
    assert stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10).instance


def pinned_page(stub: pb_grpc.KVTierStub) -> tuple[pb.PoolRef, int]:
    att = stub.Attach(pb.AttachRequest(tenant=TENANT, num_pages=4), timeout=10)
    ref = pb.PoolRef(tenant=TENANT, pool_id=att.pool_id, instance=att.instance)
    page = stub.Allocate(pb.AllocateRequest(pool=ref, count=1), timeout=10).pages[0].page_id
    return ref, page


@pytest.mark.parametrize("timeout_s", [-1.0, -1e-9, float("nan"), float("inf"), float("-inf")])
def test_bad_acquire_timeout_is_refused_even_for_a_resident_page(
    channel: grpc.Channel, timeout_s: float
) -> None:
    """The resident fast path must not skip the check: nothing is pinned by a refused call."""
    stub = pb_grpc.KVTierStub(channel)
    ref, page = pinned_page(stub)
    stub.Release(pb.PagesRequest(pool=ref, page_ids=[page]), timeout=10)
    pinned = stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10).pinned_pages
    with pytest.raises(grpc.RpcError) as err:
        stub.Acquire(pb.AcquireRequest(pool=ref, page_ids=[page], timeout_s=timeout_s),
                     timeout=10)
    assert err.value.code() == S.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("timeout_s: ")
    assert stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10).pinned_pages == pinned
    with pytest.raises(grpc.RpcError):  # still unpinned: a release has nothing to undo
        stub.Release(pb.PagesRequest(pool=ref, page_ids=[page]), timeout=10)
    stub.Detach(pb.DetachRequest(pool=ref), timeout=10)


def test_layout_is_bounded(channel: grpc.Channel) -> None:
    stub = pb_grpc.KVTierStub(channel)
    pools = stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10).pools
    with pytest.raises(grpc.RpcError) as err:
        stub.Attach(pb.AttachRequest(tenant=TENANT, num_pages=1, layout="x" * 4097), timeout=10)
    assert err.value.code() == S.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("layout: ")
    assert stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10).pools == pools
    ok = stub.Attach(pb.AttachRequest(tenant=TENANT, num_pages=1, layout="y" * 4096), timeout=10)
    stub.Detach(pb.DetachRequest(pool=pb.PoolRef(tenant=TENANT, pool_id=ok.pool_id)), timeout=10)


def test_watch_errors_name_the_watch_request_fields(channel: grpc.Channel) -> None:
    stub = pb_grpc.KVTierStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.WatchEvents(pb.WatchRequest(tenant=TENANT, pool_id=-3), timeout=10))
    assert err.value.code() == S.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("pool_id: ")
    with pytest.raises(grpc.RpcError) as err:
        list(stub.WatchEvents(pb.WatchRequest(tenant="", pool_id=1), timeout=10))
    assert (err.value.details() or "").startswith("tenant: ")


def test_attach_bytes_error_speaks_of_bytes(channel: grpc.Channel) -> None:
    stub = pb_grpc.KVTierStub(channel)
    page = 64 * 1024
    with pytest.raises(grpc.RpcError) as err:
        stub.Attach(pb.AttachRequest(tenant=TENANT, page_size=page, bytes=(1 << 24) * page + page),
                    timeout=10)
    details = err.value.details() or ""
    assert err.value.code() == S.INVALID_ARGUMENT
    assert details.startswith("bytes: ") and f"{(1 << 24) * page}" in details, details
    assert "1..16777216" not in details
