"""sd_notify by hand: path and abstract sockets."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvtier.server.notify import sd_notify


def test_notify_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": path})
        assert sock.recv(64) == b"READY=1"


def test_notify_abstract_socket() -> None:
    name = f"kvtier-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(64) == b"READY=1"


def test_notify_without_systemd_is_a_no_op() -> None:
    assert not sd_notify("READY=1", {})
