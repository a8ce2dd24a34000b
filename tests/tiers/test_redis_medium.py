"""The Redis keyed medium against real ``redis-server`` processes: standalone, faults, Cluster."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiers.redis_medium import RedisMedium
from tests.redis_servers import RedisServer, free_port, needs_redis, start_cluster

pytestmark = needs_redis
TIMEOUT = 0.2
SLACK = 1.0  # scheduling slack on a shared 2-core machine; still far below any hang


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def medium(url: str, **kw: object) -> RedisMedium:
    return RedisMedium(url, password=None, timeout_s=TIMEOUT, retry_after_s=0.2, **kw)  # type: ignore[arg-type]


def timed(fn, *args):  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def items(n: int, size: int = 4096, tag: bytes = b"k") -> list[tuple[bytes, bytes]]:
    return [(b"kvtier:%s%d" % (tag, i), bytes([i % 256]) * size) for i in range(n)]


def test_put_get_contains_roundtrip_with_ttl(server: RedisServer) -> None:
    m = medium(server.url)
    deadline = time.monotonic() + 5
    while not m.health().reachable:  # connected in the background, before any call
        assert time.monotonic() < deadline
        time.sleep(0.01)
    data = items(50)
    assert m.put_many(data, ttl_s=300) == 50
    keys = [k for k, _ in data]
    assert m.get_many([*keys, b"kvtier:absent"]) == [v for _, v in data] + [None]
    assert m.contains_many([keys[0], b"kvtier:absent"]) == [True, False]
    ttl = int(server.cli("ttl", keys[0].decode()).strip())
    assert 0 < ttl <= 300  # expiry set on every write; eviction is the server's policy
    assert m.health().reachable
    m.close()
    assert m.get_many(keys[:1]) == [None]  # closed: misses, no error


def test_store_down_at_start_then_up_reconnects_by_itself(tmp_path: Path) -> None:
    s = RedisServer(tmp_path / "late")
    m = medium(s.url)
    got, took = timed(m.get_many, [b"kvtier:x"])
    assert got == [None] and took < TIMEOUT + SLACK
    assert m.put_many(items(2)) == 0 and not m.health().reachable
    assert m.health().errors.get("connection", 0) >= 1
    s.start()
    try:
        deadline = time.monotonic() + 10
        while m.put_many(items(2)) != 2:
            assert time.monotonic() < deadline, "no reconnect"
            time.sleep(0.05)
        assert m.health().reachable
    finally:
        s.stop()


def test_stopped_mid_run_then_restarted(server: RedisServer) -> None:
    m = medium(server.url)
    assert m.put_many(items(3)) == 3
    server.stop()
    for _ in range(5):  # the first fails on the socket, the rest inside the back-off window
        got, took = timed(m.get_many, [b"kvtier:k0"])
        assert got == [None] and took < TIMEOUT + SLACK
    assert not m.health().reachable
    server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 10
    while m.put_many(items(3)) != 3:
        assert time.monotonic() < deadline, "no reconnect after restart"
        time.sleep(0.05)
    assert m.get_many([b"kvtier:k2"]) == [bytes([2]) * 4096]


def test_a_store_slower_than_the_timeout_answers_misses_in_time(server: RedisServer) -> None:
    m = medium(server.url)
    assert m.put_many(items(1)) == 1
    server.pause()
    try:
        for call, args in ((m.get_many, [b"kvtier:k0"]), (m.contains_many, [b"kvtier:k0"]),
                           (m.put_many, items(1))):
            got, took = timed(call, args)
            assert took < TIMEOUT + SLACK, (call, took)
            assert got in ([None], [False], 0)
        assert m.health().errors.get("timeout", 0) >= 1
    finally:
        server.resume()
    deadline = time.monotonic() + 10
    while m.get_many([b"kvtier:k0"]) != [bytes([0]) * 4096]:
        assert time.monotonic() < deadline, "no recovery after the store answered again"
        time.sleep(0.05)


def test_out_of_memory_drops_writes_and_counts(tmp_path: Path) -> None:
    s = RedisServer(tmp_path / "oom", extra=("--maxmemory", "2mb",
                                             "--maxmemory-policy", "noeviction")).start()
    try:
        m = medium(s.url)
        written = m.put_many(items(64, size=128 * 1024))
        assert 0 < written < 64
        assert m.health().errors.get("oom", 0) >= 1
        assert m.health().reachable  # the store answers: only the writes fail
        assert m.get_many([b"kvtier:k0"]) == [bytes([0]) * 128 * 1024]
    finally:
        s.stop()


def test_cluster_spreads_keys_over_nodes_and_survives_a_node_gone(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    try:
        m = medium(cluster.url)
        data = items(96, size=1024)
        assert m.put_many(data) == 96
        assert m.cluster
        assert all(int(n.cli("dbsize").strip()) > 0 for n in cluster.nodes)  # hash slots
        keys = [k for k, _ in data]
        assert m.get_many(keys) == [v for _, v in data]
        cluster.nodes[2].stop()
        got, took = timed(m.get_many, keys)
        assert took < 3 * (TIMEOUT + SLACK)  # at most one deadline per node
        assert len(got) == len(keys)  # misses for the gone node's slots, never an exception
        # the nodes left keep serving their slots: hits come back without the gone node
        deadline = time.monotonic() + 15
        while True:
            got, took = timed(m.get_many, keys)
            assert took < 3 * (TIMEOUT + SLACK)
            hits = sum(g is not None for g in got)
            if 0 < hits < len(keys):
                break
            assert time.monotonic() < deadline, f"no partial service ({hits} hits)"
            time.sleep(0.2)
        assert all(g is None or g == v for g, (_, v) in zip(got, data, strict=True))
    finally:
        cluster.stop()


def _certs(tmp: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1."""
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=kvtier-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    return tmp


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls_with_a_private_ca(tmp_path: Path) -> None:
    certs = _certs(tmp_path)
    tls_port = free_port()
    s = RedisServer(tmp_path / "tls", extra=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
        "--tls-auth-clients", "no")).start()
    try:
        m = medium(f"rediss://127.0.0.1:{tls_port}?ssl_ca_certs={certs / 'ca.crt'}")
        assert m.put_many(items(3)) == 3
        assert m.get_many([b"kvtier:k1"]) == [bytes([1]) * 4096]
        untrusted = medium(f"rediss://127.0.0.1:{tls_port}")  # the system CAs: refused
        assert untrusted.get_many([b"kvtier:k1"]) == [None]
        assert not untrusted.health().reachable
        plain = medium(f"redis://127.0.0.1:{tls_port}")  # no TLS to a TLS port: a miss
        assert plain.get_many([b"kvtier:k1"]) == [None]
    finally:
        s.stop()


def test_a_value_planted_larger_is_read_only_as_far_as_asked(server: RedisServer) -> None:
    """Anyone who can reach the store can grow a value (SETRANGE) to hundreds of MiB; a read
    of it took all of it into memory before the length check refused it."""
    m = medium(server.url)
    assert m.put_many([(b"kvtier:big", bytes(8 << 20)), (b"kvtier:ok", b"x" * 100)]) == 2
    got = m.get_many([b"kvtier:big", b"kvtier:ok", b"kvtier:absent"], max_bytes=100)
    assert got == [bytes(101), b"x" * 100, None]  # cut one byte past: refused as too long
    server.cli("rpush", "kvtier:list", "a")  # another type at the key: a miss
    assert m.get_many([b"kvtier:list"], max_bytes=100) == [None]
    m.close()


class TricklingStore:
    """A hostile store on a real socket: the handshake at once, then every reply one byte per
    ``drip_s`` (each byte well within the socket timeout)."""

    def __init__(self, drip_s: float = 0.05) -> None:
        import socket
        import threading

        self.drip_s, self.stopped = drip_s, False
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:  # type: ignore[no-untyped-def]
        f = conn.makefile("rb")
        try:
            while not self.stopped and (line := f.readline()):
                args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
                cmd = args[0].upper()
                if cmd == b"HELLO":  # the handshake: the server's fields, as a map in RESP3
                    proto = args[1] if len(args) > 1 else b"2"
                    kv = [b"server", b"redis", b"version", b"7.0.15", b"proto", b":" + proto,
                          b"mode", b"standalone", b"role", b"master", b"modules", b"*0"]
                    head = b"%%%d\r\n" % (len(kv) // 2) if proto == b"3" else b"*%d\r\n" % len(kv)
                    conn.sendall(head + b"".join(
                        v + b"\r\n" if v[:1] in (b":", b"*") else b"$%d\r\n%s\r\n" % (len(v), v)
                        for v in kv))
                elif cmd == b"INFO":
                    body = b"# Cluster\r\ncluster_enabled:0\r\n"
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(body), body))
                elif cmd in (b"GET", b"GETRANGE", b"EXISTS"):
                    reply = b"$4096\r\n" + bytes(4096) + b"\r\n"
                    for i in range(len(reply)):
                        if self.stopped:
                            return
                        conn.sendall(reply[i : i + 1])
                        time.sleep(self.drip_s)
                else:
                    conn.sendall(b"+OK\r\n")
        except OSError:
            return
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopped = True
        self.sock.close()


def test_a_reply_trickled_a_byte_at_a_time_ends_at_the_calls_deadline() -> None:
    """Each byte within the socket timeout kept the call (and every remote fetch queued behind
    it) waiting for as long as the store liked; the call now ends at its deadline, a miss."""
    store = TricklingStore()
    try:
        m = medium(store.url)
        for call, args in ((m.get_many, [b"kvtier:k"]), (m.contains_many, [b"kvtier:k"]),
                           (m.contains_many, [b"kvtier:a", b"kvtier:b"])):
            got, took = timed(call, args)
            assert not any(got) and took < TIMEOUT + SLACK, (call, took)
        assert m.health().errors.get("timeout", 0) >= 1
        m.close()
    finally:
        store.stop()


def test_health_follows_the_store_with_no_calls(server: RedisServer) -> None:
    """``reachable`` (kvtier_remote_up, status) said "up" for as long as no call was made after
    the store died, and "down" after it came back until the next call: a probe now asks an idle
    store every ``probe_s``."""
    m = medium(server.url, probe_s=0.2)
    try:
        assert m.put_many(items(2)) == 2 and m.health().reachable
        server.stop()
        deadline = time.monotonic() + 5
        while m.health().reachable:
            assert time.monotonic() < deadline, "still 'up' with the store stopped"
            time.sleep(0.05)
        assert m.health().errors.get("connection", 0) >= 1
        server.start()
        deadline = time.monotonic() + 5
        while not m.health().reachable:
            assert time.monotonic() < deadline, "still 'down' with the store back"
            time.sleep(0.05)
    finally:
        m.close()
