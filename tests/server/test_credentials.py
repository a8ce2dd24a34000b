"""The tenants file and the credential rule, on real files and real request messages.

(The same rule against a real daemon: ``test_tenants.py``.)
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from kvtier.server.credentials import TOKEN_KEY, TenantCredentials
from kvtier.server.errors import status_for

from kvtier.errors import ConfigError
from kvtier.v1 import kvtier_pb2 as pb

GOOD = "a  tok-a  # a comment\n\n# only a comment\nb tok-b\n@admin tok-admin\n"


def write(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tenants"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize(
    ("text", "mode", "says"),
    [
        (GOOD, 0o640, "0640"),
        (GOOD, 0o604, "0604"),
        (GOOD, 0o620, "0620"),
        ("a tok-a extra\n", 0o600, "line 1"),
        ("a\n", 0o600, "line 1"),
        ("a tok-a\na tok-b\n", 0o600, "line 2: repeated"),
        ("a tok-a\nb tok-a\n", 0o600, "line 2: repeated"),
        ("# nobody\n", 0o600, "lists no tenant"),
        ("-a tok-a\n", 0o600, "line 1: not a tenant name"),
        ("admin! tok-a\n", 0o600, "line 1: not a tenant name"),
    ],
)
def test_bad_tenants_files_are_refused_naming_the_variable(tmp_path, text, mode, says):
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_TENANTS_FILE") as err:
        TenantCredentials.load(write(tmp_path, text, mode))
    assert says in str(err.value)
    assert "tok-" not in str(err.value)  # tokens are never echoed


def test_missing_file_and_symlink_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_TENANTS_FILE"):
        TenantCredentials.load(str(tmp_path / "absent"))
    link = tmp_path / "link"
    link.symlink_to(write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_TENANTS_FILE"):
        TenantCredentials.load(str(link))
    folder = tmp_path / "folder"  # was an IsADirectoryError traceback at start, exit 1
    folder.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"KVCACHED_OFFLOAD_TENANTS_FILE.*not a regular file"):
        TenantCredentials.load(str(folder))


def test_the_rule(tmp_path):
    creds = TenantCredentials.load(write(tmp_path, GOOD))
    ref = pb.PoolRef(tenant="a", pool_id=1)
    free = pb.PagesRequest(pool=ref, page_ids=[1])
    stats_a, whole = pb.StatsRequest(tenant="a"), pb.StatsRequest(tenant="")
    unauth, denied = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED

    def code(method: str, request: object, token: str | bytes | None) -> object:
        md = [(TOKEN_KEY, token)] if token is not None else []
        got = creds.refuse(f"/kvtier.v1.KVTier/{method}", request, md)
        return None if got is None else status_for(got)[0]

    assert code("Free", free, "tok-a") is None
    assert code("Free", free, b"tok-a") is None  # binary metadata reads the same
    assert code("Free", free, None) == unauth
    assert code("Free", free, "tok-") == unauth  # a prefix of a token is no token
    assert code("Free", free, "tok-b") == denied
    assert code("Free", free, "tok-admin") == denied
    assert code("Attach", pb.AttachRequest(tenant="b"), "tok-b") is None
    assert code("Lookup", pb.LookupRequest(tenant="a"), "tok-b") == denied
    assert code("Stats", stats_a, "tok-a") is None
    assert code("Stats", stats_a, "tok-admin") is None
    assert code("Stats", whole, "tok-admin") is None
    assert code("Stats", whole, "tok-a") == denied
    assert code("Stats", whole, None) == unauth
    assert code("Detach", pb.DetachRequest(pool=pb.PoolRef(tenant="")), "tok-a") == denied
    assert code("Attach", object(), "tok-a") == denied  # a request naming no tenant: refused
    assert code("Attach", pb.AttachRequest(tenant="@admin"), "tok-admin") == denied
