"""A real kvtier daemon in a subprocess, on a real unix socket, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier.client import KVTierClient

PAGE = 64 * 1024
GIB = 1 << 30
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    address: str
    metrics_port: int
    disk: Path
    log: Path
    args: list[str] = field(default_factory=list)

    def client(self, tenant: str, timeout: float = 10.0) -> KVTierClient:
        return KVTierClient(self.address, tenant, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def serve_args(tmp: Path, *, disk: Path, pool_pages: int = 16, cpu_pages: int = 16,
               disk_pages: int = 256, metrics_port: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "kvtier.cli", "serve",
        "--listen", f"unix://{tmp}/k.sock",
        "--metrics-addr", f"127.0.0.1:{metrics_port}",
        "--device", "cpu", "--disk-path", str(disk),
        "--disk-gb", repr(disk_pages * PAGE / GIB),
        "--cpu-memory-gb", repr(cpu_pages * PAGE / GIB),
        "--gpu-memory-gb", repr(pool_pages * 2 * PAGE / GIB),
        "--grace", "5", "--log-level", "info",
    ]


def with_fd_limit(argv: list[str], limit: int) -> list[str]:
    """``argv`` (a ``serve_args`` command) run under a descriptor limit of ``limit``."""
    wrap = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
            f"({limit}, {limit})); os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    return [sys.executable, "-c", wrap, *argv[1:]]


def daemon_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVCACHED_OFFLOAD_") and k != "NOTIFY_SOCKET"}
    env.update(KVCACHED_OFFLOAD_PAGE_SIZE=str(PAGE), KVCACHED_OFFLOAD_DISK_ADMISSION="always",
               KVCACHED_OFFLOAD_PINNED_CHUNK_MB="1", KVCACHED_OFFLOAD_BATCH_MB="1",
               KVCACHED_OFFLOAD_MAX_INFLIGHT_MB="8", **extra)
    return env


def start(tmp: Path, *, disk: Path | None = None, env: dict[str, str] | None = None,
          args: list[str] | None = None, address: str = "", **sizes: int) -> Daemon:
    disk = disk or tmp / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = args or serve_args(tmp, disk=disk, metrics_port=port, **sizes)
    log = tmp / f"daemon-{time.monotonic_ns()}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                env=env or daemon_env())
    address = address or argv[argv.index("--listen") + 1]
    if args:
        port = int(argv[argv.index("--metrics-addr") + 1].rpartition(":")[2])
    d = Daemon(proc, address, port, disk, log, argv)
    wait_serving(d)
    return d


def health_status(address: str, timeout: float = 1.0) -> int | None:
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=timeout)
        except grpc.RpcError:
            return None
    return int(reply.status)


def wait_serving(d: Daemon, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"daemon exited {d.proc.returncode}:\n{d.output()}")
        if health_status(d.address) == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.1)
    d.stop(signal.SIGKILL)
    raise TimeoutError(f"daemon not serving after {timeout}s:\n{d.output()}")
