"""``kvtier serve`` start-up: one daemon per socket and disk directory, and every start-up error is
one line naming the flag and variable, exit 2, before anything is served or unlinked."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from grpc_health.v1 import health_pb2
from kvtier_daemon_fixture import Daemon, daemon_env, free_port, health_status, serve_args

SERVING = health_pb2.HealthCheckResponse.SERVING


def serve(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=daemon_env(), capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess[str], prefix: str) -> str:
    """The start failed with exit 2 and exactly one stderr line starting with ``prefix``."""
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvtier serve: {prefix}"), lines[0]
    return lines[0]


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def test_second_serve_on_the_same_socket_fails_naming_the_holder(
    spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = spawn()
    sock = Path(d.address.removeprefix("unix://"))
    inode = sock.stat().st_ino
    again = with_flag(d.args, "--disk-path", str(tmp_path / "other-disk"))
    for metrics in (free_port(), d.metrics_port):  # a taken metrics port must not win either
        line = one_line(serve(with_flag(again, "--metrics-addr", f"127.0.0.1:{metrics}")),
                        "--listen/KVCACHED_OFFLOAD_LISTEN: ")
        assert f"pid {d.proc.pid}" in line
    assert sock.stat().st_ino == inode  # the live socket was neither unlinked nor replaced
    assert health_status(d.address) == SERVING
    with d.client("still-mine") as c:
        assert c.stats().instance


def test_second_serve_on_the_same_disk_directory_fails_naming_the_holder(
    spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = spawn()
    other = tmp_path / "second"
    other.mkdir()
    args = with_flag(d.args, "--listen", f"unix://{other}/k.sock")
    line = one_line(serve(with_flag(args, "--metrics-addr", f"127.0.0.1:{free_port()}")),
                    "--disk-path/KVCACHED_OFFLOAD_DISK_PATH: ")
    assert f"pid {d.proc.pid}" in line
    assert not (other / "k.sock").exists()
    assert health_status(d.address) == SERVING


def test_stale_socket_of_a_killed_daemon_is_replaced(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    d.stop(signal.SIGKILL)
    assert Path(d.address.removeprefix("unix://")).exists()  # left behind by kill -9
    d2 = spawn(args=with_flag(d.args, "--metrics-addr", f"127.0.0.1:{free_port()}"))
    with d2.client("after") as c:
        assert c.stats().instance


def test_busy_metrics_port_fails_before_the_socket_is_touched(tmp_path: Path) -> None:
    sock = tmp_path / "k.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # a socket file, as a dead daemon leaves it
        stale.bind(str(sock))
    inode = sock.stat().st_ino
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=port)
        line = one_line(serve(args), "--metrics-addr/KVCACHED_OFFLOAD_METRICS_ADDR: ")
    assert f"127.0.0.1:{port}" in line
    assert sock.stat().st_ino == inode


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_device_without_a_gpu(tmp_path: Path) -> None:
    args = with_flag(serve_args(tmp_path, disk=tmp_path / "disk"), "--device", "cuda")
    one_line(serve(args), "--device/KVCACHED_OFFLOAD_DEVICE: ")
    assert not (tmp_path / "k.sock").exists()


@pytest.mark.parametrize("where", ["proc", "file"])
def test_disk_path_that_is_not_a_directory(tmp_path: Path, where: str) -> None:
    path = "/proc/kvtier-disk" if where == "proc" else str(tmp_path / "a-file")
    Path(tmp_path / "a-file").write_text("not a directory")
    args = serve_args(tmp_path, disk=Path(path), metrics_port=free_port())
    one_line(serve(args), "--disk-path/KVCACHED_OFFLOAD_DISK_PATH: ")
    assert not (tmp_path / "k.sock").exists()


def read_only_serve(args: list[str], disk: Path) -> subprocess.CompletedProcess[str]:
    """``args`` run with ``disk`` read-only: chmod for a normal user; as root (whom modes don't
    stop) a read-only tmpfs mounted over it in a private mount namespace."""
    disk.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        disk.chmod(0o555)
        return serve(args)
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("root without unshare(1): cannot make a read-only directory")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no user namespaces here: cannot make a read-only directory as root")
    script = 'mount -t tmpfs -o ro,size=1m tmpfs "$0" && exec "$@"'
    return serve([unshare, "-rm", "sh", "-c", script, str(disk), *args])


def test_read_only_disk_path(tmp_path: Path) -> None:
    disk = tmp_path / "ro-disk"
    args = serve_args(tmp_path, disk=disk, metrics_port=free_port())
    line = one_line(read_only_serve(args, disk), "--disk-path/KVCACHED_OFFLOAD_DISK_PATH: ")
    assert "not a writable directory" in line


def test_listen_splits_a_comma_list(spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    port = free_port()
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    args = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())
    args = with_flag(args, "--listen", f"unix://{tmp_path}/k.sock,127.0.0.1:{port}")
    spawn(args=[*args, "--token-file", str(token)], address=f"unix://{tmp_path}/k.sock")
    assert not list(tmp_path.glob("k.sock,*"))
    assert health_status(f"127.0.0.1:{port}") == SERVING


def test_version_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "--version"], capture_output=True,
                         text=True, timeout=60)
    from importlib import metadata

    assert out.returncode == 0
    assert out.stdout.strip() == f"kvtier {metadata.version('kvtier')}"


def test_a_socket_another_program_serves_on_is_never_taken(tmp_path: Path) -> None:
    """A socket already at the path was unlinked whatever it was: another program's live
    listener lost its address to the daemon. Only a stale one (nobody answers) is replaced."""
    path = tmp_path / "k.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(path))
        other.listen(1)
        one_line(serve(serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())),
                 f"--listen/KVCACHED_OFFLOAD_LISTEN: unix://{path}: another program is serving")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))  # still the other program's
            conn, _ = other.accept()
            conn.close()


@pytest.mark.parametrize(("flag", "value", "prefix"), [
    ("--disk-gb", "inf", "--disk-gb: KVCACHED_OFFLOAD_DISK_GB=inf is invalid"),
    ("--cpu-memory-gb", "inf", "--cpu-memory-gb: KVCACHED_OFFLOAD_CPU_MEMORY_GB=inf is invalid"),
    ("--grace", "1e30", "--grace: KVCACHED_OFFLOAD_GRACE_S=1e+30 is invalid"),
    ("--metrics-addr", "127.0.0.1:99999", "--metrics-addr: KVCACHED_OFFLOAD_METRICS_ADDR="),
    ("--listen", "127.0.0.1:99999", "--listen: KVCACHED_OFFLOAD_LISTEN="),
    ("--listen", "unix://", "--listen: KVCACHED_OFFLOAD_LISTEN="),
    ("--listen", "unix://relative.sock", "--listen: KVCACHED_OFFLOAD_LISTEN="),
])
def test_endless_or_out_of_range_values_are_one_line(tmp_path: Path, flag: str, value: str,
                                                     prefix: str) -> None:
    """Each was a traceback (OverflowError, RuntimeError, FileNotFoundError), a daemon that
    crashed on every SIGTERM (an endless grace), or a port that wrapped (99999 served 34463)."""
    args = with_flag(serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port()),
                     flag, value)
    one_line(serve(args), prefix)
