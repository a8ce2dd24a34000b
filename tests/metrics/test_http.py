"""The bounded /metrics endpoint (``kvtier/metrics/http.py``) on a real socket: scrapes are
answered while peers hold half-sent requests, and those peers hold no thread and are closed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvtier.metrics import http


@pytest.fixture
def server() -> Iterator[http.MetricsServer]:
    registry = CollectorRegistry()
    Counter("kvtier_probe", "A counter to scrape.", registry=registry).inc(3)
    srv = http.serve("127.0.0.1", 0, registry)
    yield srv
    srv.shutdown()
    srv.server_close()


def scrape(srv: http.MetricsServer) -> str:
    url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def test_scrapes_are_answered_while_peers_hold_half_sent_requests(
        server: http.MetricsServer) -> None:
    """prometheus_client's server ran a thread per connection with no timeout: 2,000 peers
    sending half a request held 2,000 daemon threads and descriptors for as long as they
    liked. Here they hold no thread, the oldest make way beyond ``MAX_CONNS``, and what is left
    is closed after ``READ_TIMEOUT_S``."""
    assert "kvtier_probe_total 3.0" in scrape(server)
    threads = threading.active_count()
    peers = []
    for _ in range(http.MAX_CONNS + 100):
        s = socket.create_connection(server.server_address[:2], timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        peers.append(s)
    started = time.monotonic()
    assert "kvtier_probe_total 3.0" in scrape(server)
    assert time.monotonic() - started < 2.0
    assert threading.active_count() == threads  # no thread per connection
    time.sleep(http.READ_TIMEOUT_S + 1.5)
    closed = 0
    for s in peers:
        s.settimeout(1)
        try:
            closed += s.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            closed += 1
        s.close()
    assert closed == len(peers)


def test_a_peer_not_reading_its_reply_holds_no_one_up_and_only_get_is_answered(
        server: http.MetricsServer) -> None:
    s = socket.create_connection(server.server_address[:2], timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert "kvtier_probe_total 3.0" in scrape(server)  # others are served meanwhile
    s.close()
    bad = socket.create_connection(server.server_address[:2], timeout=5)
    bad.sendall(b"POST / HTTP/1.1\r\n\r\n")
    assert bad.recv(64).startswith(b"HTTP/1.1 405")
    bad.close()


def test_peers_trickling_bytes_while_others_connect_never_end_the_endpoint(
        server: http.MetricsServer) -> None:
    """At ``MAX_CONNS`` an accept closes the oldest connection; when that one also had bytes
    waiting in the same batch of events, the loop looked it up after it was gone (KeyError)
    and the endpoint's thread died: scrapes timed out for good while gRPC served on."""
    addr = server.server_address[:2]
    peers = [socket.create_connection(addr, timeout=5) for _ in range(http.MAX_CONNS)]
    for s in peers:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
    for _ in range(3 * http.MAX_CONNS):  # each round: the oldest speaks, a newcomer evicts it
        oldest = peers.pop(0)
        with contextlib.suppress(OSError):
            oldest.sendall(b"X: y\r\n")
        s = socket.create_connection(addr, timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        peers.append(s)
        oldest.close()
    for s in peers:
        s.close()
    assert "kvtier_probe_total 3.0" in scrape(server)
