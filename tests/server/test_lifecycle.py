"""Lifecycle: drain on SIGTERM, restart after kill -9, reflection, health, metrics, TCP auth."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from kvtier.client import KVTierClient, Unauthenticated
from kvtier_daemon_fixture import Daemon, daemon_env, free_port, health_status, serve_args

from kvtier.cli import main
from kvtier.metrics import METRIC_NAMES
from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


def test_sigterm_drains_and_exits_zero(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    c = d.client("drain")
    att = c.attach(4)
    results: list[object] = []
    served = threading.Event()

    def hammer() -> None:  # calls until the first error, which must be the drain's
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                c.stats()
                served.set()
            except Exception as exc:
                results.append(type(exc).__name__)
                return

    t = threading.Thread(target=hammer)
    t.start()
    assert served.wait(10)
    assert d.stop(signal.SIGTERM, timeout=15) == 0
    t.join(20)
    assert results == ["Unavailable"], results
    assert "stopped" in d.output()
    del att


def test_sighup_without_a_tenants_file_is_not_an_exit(spawn: Callable[..., Daemon]) -> None:
    """The docs say SIGHUP reloads the tenants file. Without one, the daemon took the signal's
    default action: an unclean exit (the socket left behind, keyed CPU-tier pages lost). Now it
    logs that there is nothing to reload and serves on."""
    d = spawn()
    with d.client("hup") as c:
        att = c.attach(2)
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert d.proc.poll() is None
        assert c.stats().pools == 1
        del att
    assert "nothing to reload" in d.output()


def test_kill_9_then_restart_finds_stored_keys(spawn: Callable[..., Daemon], tmp_path: Path
                                               ) -> None:
    d = spawn()
    keys = [f"chain-{i}".encode() for i in range(6)]
    with d.client("persist") as c:
        att = c.attach(8)
        assert att.tensor is not None
        got = c.allocate(att, 6)
        assert got is not None
        for i, (_, slot) in enumerate(got):
            att.tensor[slot].fill_(10 + i)
        assert c.store(att, keys, [s for _, s in got]) == 6
        c.release(att, [p for p, _ in got])
        filler = c.attach(8)  # push the keyed pages out of host memory onto disk
        for _ in range(4):
            more = c.allocate(filler, 8)
            assert more is not None
            c.release(filler, [p for p, _ in more])
        deadline = time.monotonic() + 10
        while set(c.lookup(keys)) != {Tier.DISK} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.lookup(keys) == [Tier.DISK] * len(keys)
        time.sleep(0.2)  # the disk index journal is written out every 10 ms
    d.stop(signal.SIGKILL)
    d2 = spawn(disk=d.disk)
    with d2.client("persist") as c:
        found = c.lookup(keys)
        assert len(found) == len(keys), found
        att = c.attach(8)
        assert att.tensor is not None
        slots = [s for _, s in c.allocate(att, 6) or []]
        assert c.load(att, keys, slots) == 6
        for i, slot in enumerate(slots):
            assert bool((att.tensor[slot] == 10 + i).all())
        assert d2.client("intruder").lookup(keys) == []


def test_reflection_health_and_metrics(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        assert "kvtier.v1.KVTier" in db.get_services()
    assert health_status(daemon.address) == health_pb2.HealthCheckResponse.SERVING
    with daemon.client("metrics") as c:
        c.stats()
        with pytest.raises(Exception):  # noqa: B017 - any error: we only need an error series
            c.lookup([])
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for name in METRIC_NAMES:
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'kvtier_rpc_errors_total{code="INVALID_ARGUMENT",method="Lookup"}' in text


def test_tcp_without_token_refuses_to_start(tmp_path: Path) -> None:
    args = serve_args(tmp_path, disk=tmp_path)
    args[args.index("--listen") + 1] = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(args, env=daemon_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "KVCACHED_OFFLOAD_TOKEN" in proc.stderr


def test_tcp_requires_the_token(spawn: Callable[..., Daemon], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    port = free_port()
    args = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())
    args[args.index("--listen") + 1] = f"127.0.0.1:{port}"
    args += ["--token-file", str(token_file)]
    spawn(args=args)
    addr = f"127.0.0.1:{port}"
    with grpc.insecure_channel(addr) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVTierStub(ch).Stats(pb.StatsRequest(tenant="t"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health_status(addr) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(Unauthenticated):
        KVTierClient(addr, "t", token="wrong").stats()
    assert KVTierClient(addr, "t", token="s3cret").stats().version
    assert main(["status", "--address", addr]) == 1  # its hint named --tenant-token-file
    assert "(see --token-file)" in capsys.readouterr().err


def test_default_socket_is_private(spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    args = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())
    i = args.index("--listen")
    del args[i : i + 2]
    sock = runtime / "kvtier" / "kvtier.sock"
    d = spawn(args=args, env=daemon_env(XDG_RUNTIME_DIR=str(runtime)), address=f"unix://{sock}")
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o750
    assert d.client("t").stats().instance


def test_ready_is_sent_to_systemd_after_serving(spawn: Callable[..., Daemon], tmp_path: Path
                                                 ) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(10)
        d = spawn(env=daemon_env(NOTIFY_SOCKET=path))
        assert sock.recv(256).startswith(b"READY=1")
        assert d.stop() == 0
        assert b"STOPPING=1" in sock.recv(256)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
