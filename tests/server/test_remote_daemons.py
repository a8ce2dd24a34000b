"""Two real daemons (own sockets, own disk dirs) sharing one real redis-server and one secret."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier.client import KVTierClient
from kvtier_daemon_fixture import Daemon, daemon_env, serve_args, start

from kvtier.cli import main
from kvtier.types import Tier
from tests.redis_servers import RedisServer, needs_redis, start_cluster

pytestmark = needs_redis
USER, PASSWORD = "kvtier", "pw-not-in-any-url"
# An ACL user of an earlier release: its own keys and the commands the client sends on connect,
# without the +getrange that docs/operations.md now lists: reads fall back to GET.
ACL = (f"user {USER} on >{PASSWORD} ~kvtier:* resetchannels -@all +get +set +exists "
       "+info +ping +hello +auth +client|setname +cluster|slots +cluster|shards +command")
ADMIN = "user admin on >admin-pw ~* &* +@all"  # the tests' own view of the store


def private(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture
def redis_acl(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    acl = tmp_path / "redis" / "users.acl"
    acl.write_text(f"{ACL}\n{ADMIN}\nuser default off\n")
    s = RedisServer(tmp_path / "redis", extra=("--aclfile", str(acl))).start()
    yield s
    s.stop()


@pytest.fixture
def remote_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    secret = private(tmp_path / "secret", os.urandom(32))
    password = private(tmp_path / "password", PASSWORD.encode())
    started: list[Daemon] = []

    def make(name: str, url: str, **env: str) -> Daemon:
        home = tmp_path / name
        home.mkdir(exist_ok=True)
        extra = dict(KVCACHED_OFFLOAD_REMOTE_SECRET_FILE=secret,
                     KVCACHED_OFFLOAD_REMOTE_TIMEOUT_MS="200", **env)
        if "@" in url:  # an ACL user: its password from the file
            extra["KVCACHED_OFFLOAD_REMOTE_PASSWORD_FILE"] = password
        args = [*serve_args(home, disk=home / "disk"), "--remote-url", url]
        d = start(home, disk=home / "disk", args=args, env=daemon_env(**extra))
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)


def url(server: RedisServer) -> str:
    return f"redis://{USER}@127.0.0.1:{server.port}"


def store(c: KVTierClient, keys: list[bytes], seed: int) -> None:
    """Store blocks of known bytes from a pool attached for the purpose (then detached)."""
    att = c.attach(8)
    got = c.allocate(att, len(keys))
    assert got is not None and att.tensor is not None
    for i, (_, slot) in enumerate(got):
        att.tensor[slot].fill_((seed + i) % 256)
    assert c.store(att, keys, [s for _, s in got]) == len(keys)
    c.detach(att)


def load_into_fresh(c: KVTierClient, keys: list[bytes]) -> tuple[int, Any, list[int]]:
    att = c.attach(8)
    got = c.allocate(att, len(keys))
    assert got is not None and att.tensor is not None
    slots = [s for _, s in got]
    att.tensor[slots].fill_(0)
    return c.load(att, keys, slots), att, slots


def wait_for(cond: Callable[[], bool], timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_store_in_one_daemon_is_found_and_loaded_by_another(redis_acl, remote_daemon):
    a, b = remote_daemon("a", url(redis_acl)), remote_daemon("b", url(redis_acl))
    keys = [b"p0", b"p1", b"p2"]
    with a.client("tenant") as ca, b.client("tenant") as cb, b.client("other") as cother:
        store(ca, keys, seed=11)
        took = wait_for(lambda: cb.lookup(keys) == [Tier.REMOTE] * 3, timeout=2.0)
        assert took < 2.0
        assert cother.lookup(keys) == []  # another tenant finds nothing
        n, att, slots = load_into_fresh(cb, keys)
        assert n == 3
        for i, slot in enumerate(slots):
            assert bool((att.tensor[slot] == 11 + i).all())
        assert cb.lookup(keys) == [Tier.CPU] * 3  # a remote hit lands in the CPU tier
        # the first daemon stopped: its blocks still reach a daemon that never saw them
        store(ca, [b"q0"], seed=70)
        wait_for(lambda: cb.lookup([b"q0"]) == [Tier.REMOTE], timeout=2.0)
    a.stop()
    with b.client("tenant") as cb:
        n, att, slots = load_into_fresh(cb, [b"q0"])
        assert n == 1 and bool((att.tensor[slots[0]] == 70).all())
        remote = cb.stats(whole=True).remote
        assert remote.reachable and remote.read_pages == 4 and remote.read_bytes > 0
    assert "kvtier:" in redis_acl.cli("--scan", user="admin", password="admin-pw")
    assert PASSWORD not in a.output() + b.output()


def test_two_daemons_share_blocks_through_a_cluster(tmp_path, remote_daemon):
    cluster = start_cluster(tmp_path / "cluster")
    try:
        a, b = remote_daemon("a", cluster.url), remote_daemon("b", cluster.url)
        keys = [b"c%d" % i for i in range(6)]
        with a.client("t") as ca, b.client("t") as cb:
            store(ca, keys, seed=30)
            wait_for(lambda: cb.lookup(keys) == [Tier.REMOTE] * 6, timeout=2.0)
            n, att, slots = load_into_fresh(cb, keys)
            assert n == 6
            for i, slot in enumerate(slots):
                assert bool((att.tensor[slot] == 30 + i).all())
            # keys are salted with a random secret: with 14 keys the chance that all land on
            # one of the 3 nodes is 3 / 3**14 (with the 6 above alone it was 1 in 243)
            spread = [b"s%d" % i for i in range(8)]
            store(ca, spread, seed=50)
            wait_for(lambda: cb.lookup(spread) == [Tier.REMOTE] * 8, timeout=2.0)
        assert sum(int(node.cli("dbsize")) for node in cluster.nodes) == 14
        assert sum(int(node.cli("dbsize")) > 0 for node in cluster.nodes) >= 2  # spread
        cluster.nodes[2].stop()  # a node gone: both daemons go on serving, in time
        with a.client("t") as ca, b.client("t") as cb:
            for i in range(3):
                t0 = time.monotonic()
                store(ca, [b"after%d" % i], seed=i)
                assert len(cb.lookup(keys)) <= 6  # an answer, whatever the gone node held
                n, att, _ = load_into_fresh(cb, [b"after%d" % i])
                cb.detach(att)
                assert time.monotonic() - t0 < 5.0
        assert a.proc.poll() is None and b.proc.poll() is None
    finally:
        cluster.stop()


def test_a_tampered_value_is_a_counted_miss(redis_acl, remote_daemon, capsys):
    a, b = remote_daemon("a", url(redis_acl)), remote_daemon("b", url(redis_acl))
    with a.client("t") as ca, b.client("t") as cb:
        store(ca, [b"x0"], seed=5)
        wait_for(lambda: cb.lookup([b"x0"]) == [Tier.REMOTE], timeout=2.0)
        key = redis_acl.cli("--scan", user="admin", password="admin-pw").split()[0]
        redis_acl.cli("setrange", key, "100", "X", user="admin", password="admin-pw")  # one byte
        n, _, _ = load_into_fresh(cb, [b"x0"])
        assert n == 0  # a miss, never the wrong bytes
        assert dict(cb.stats(whole=True).remote.rejected) == {"mac": 1}
    assert main(["status", "--address", b.address]) == 0
    out = capsys.readouterr().out
    assert "remote: reachable" in out and "mac=1" in out


def test_the_store_down_at_start_stopped_and_restarted(tmp_path, remote_daemon):
    server = RedisServer(tmp_path / "late-redis")  # not started yet
    acl = tmp_path / "users.acl"
    acl.write_text(f"{ACL}\n{ADMIN}\nuser default off\n")
    server.extra = ("--aclfile", str(acl))
    a = remote_daemon("a", url(server))  # starts and serves with the store down
    with a.client("t") as c:
        t0 = time.monotonic()
        store(c, [b"d0"], seed=1)  # local store unaffected
        assert c.lookup([b"d0", b"d1"]) == [Tier.CPU]  # local-only answer, in time
        assert time.monotonic() - t0 < 3.0
        assert not c.stats(whole=True).remote.reachable
        server.start()
        try:
            wait_for(lambda: _written_after_store(c) > 0, timeout=10.0)  # reconnects by itself
            server.stop()  # stopped mid-run
            t0 = time.monotonic()
            store(c, [b"d5"], seed=3)
            assert c.lookup([b"d5", b"d6"]) == [Tier.CPU]
            n, att, _ = load_into_fresh(c, [b"gone"])
            assert n == 0 and time.monotonic() - t0 < 3.0
            c.detach(att)
            wait_for(lambda: sum(c.stats(whole=True).remote.dropped.values()) > 0, timeout=5.0)
            server.start()  # restarted, empty
            wait_for(lambda: _written_after_store(c) > 0, timeout=10.0)
        finally:
            server.stop()
    assert a.proc.poll() is None  # healthy and serving throughout


def _written_after_store(c: KVTierClient) -> int:
    """Store a fresh block; how many pages the daemon has written remotely since the last call."""
    before = c.stats(whole=True).remote.written_pages
    store(c, [os.urandom(8)], seed=9)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        after = c.stats(whole=True).remote.written_pages
        if after > before:
            return after - before
        time.sleep(0.05)
    return 0


def test_bad_remote_settings_stop_the_start(tmp_path: Path, capsys) -> None:
    loose = tmp_path / "secret"
    loose.write_bytes(os.urandom(32))
    os.chmod(loose, 0o644)
    env = daemon_env(KVCACHED_OFFLOAD_REMOTE_SECRET_FILE=str(loose))
    d = start_failing(tmp_path, ["--remote-url", "redis://127.0.0.1:1"], env)
    assert d.returncode == 2 and "KVCACHED_OFFLOAD_REMOTE_SECRET_FILE" in d.output
    assert main(["serve", "--remote-url", "http://127.0.0.1:1"]) == 2
    assert "--remote-url" in capsys.readouterr().err


class _Failed:
    def __init__(self, returncode: int, output: str) -> None:
        self.returncode, self.output = returncode, output


def start_failing(tmp: Path, extra: list[str], env: dict[str, str]) -> _Failed:
    import subprocess

    argv = [*serve_args(tmp, disk=tmp / "disk"), *extra]
    out = subprocess.run(argv, env=env, capture_output=True, timeout=60)
    return _Failed(out.returncode, (out.stdout + out.stderr).decode(errors="replace"))


def test_a_store_slower_than_the_timeout_never_holds_a_call(redis_acl, remote_daemon):
    a, b = remote_daemon("a", url(redis_acl)), remote_daemon("b", url(redis_acl))
    with a.client("t") as ca, b.client("t") as cb:
        store(ca, [b"s0"], seed=2)
        wait_for(lambda: cb.lookup([b"s0"]) == [Tier.REMOTE], timeout=2.0)
        redis_acl.pause()  # accepts connections, answers nothing
        try:
            for _ in range(3):
                t0 = time.monotonic()
                assert cb.lookup([b"s0"]) == []  # local-only answer
                n, att, _ = load_into_fresh(cb, [b"s0"])
                cb.detach(att)
                store(cb, [os.urandom(8)], seed=4)
                assert n == 0 and time.monotonic() - t0 < 3.0
            assert cb.stats(whole=True).remote.errors["timeout"] >= 1
        finally:
            redis_acl.resume()
        wait_for(lambda: cb.lookup([b"s0"]) == [Tier.REMOTE], timeout=5.0)  # back by itself
    assert a.proc.poll() is None and b.proc.poll() is None
