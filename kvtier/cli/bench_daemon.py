"""The daemon ``kvtier bench`` starts for itself when no ``--address`` is given."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtier.errors import ConfigError

GIB = 1 << 30


def pool_size(pages_per_engine: int) -> int:
    """Each engine's pool holds a quarter of its working set: pressure from the first second."""
    return max(4, pages_per_engine // 4)


def daemon_argv(tmp: Path, args: argparse.Namespace) -> list[str]:
    page = args.page_size
    pool_pages = pool_size(args.pages_per_engine)
    gpu = args.engines * pool_pages * 2 * page
    cpu = args.engines * max(8, args.pages_per_engine // 4) * page
    disk = args.engines * args.pages_per_engine * 4 * page
    return [
        sys.executable,
        "-m",
        "kvtier.cli",
        "serve",
        "--listen",
        f"unix://{tmp}/kvtier.sock",
        "--metrics-addr",
        "",
        "--device",
        args.device,
        "--disk-path",
        str(tmp / "disk"),
        "--disk-gb",
        repr(disk / GIB),
        "--cpu-memory-gb",
        repr(cpu / GIB),
        "--gpu-memory-gb",
        repr(gpu / GIB),
        "--grace",
        "5",
        "--log-level",
        "warning",
    ]


def daemon_env(page_size: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVCACHED_OFFLOAD_") and k != "NOTIFY_SOCKET"
    }
    env.update(
        KVCACHED_OFFLOAD_PAGE_SIZE=str(page_size),
        KVCACHED_OFFLOAD_DISK_ADMISSION="always",
        KVCACHED_OFFLOAD_PINNED_CHUNK_MB="1",
        KVCACHED_OFFLOAD_BATCH_MB="1",
        KVCACHED_OFFLOAD_MAX_INFLIGHT_MB="8",
    )
    return env


def wait_serving(
    proc: subprocess.Popen[bytes], address: str, log: Path, timeout: float = 60.0
) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # its last line says why (a setting it refused)
            lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            raise ConfigError(f"the embedded daemon did not start (exit {proc.returncode}): "
                              f"{lines[-1].removeprefix('kvtier serve: ')}")
        with grpc.insecure_channel(address) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=1.0
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"embedded daemon not serving after {timeout:.0f}s")


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwinds the run (its ``finally`` blocks stop the embedded
    daemon and remove its temp dir) up to ``run_bench``, which exits 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (SIGTERM would
    otherwise kill the process with no cleanup, SIGINT end in a traceback); a second signal
    during the cleanup is ignored so that the cleanup finishes."""

    def handler(signum: int, _frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


@contextmanager
def embedded_daemon(args: argparse.Namespace) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "disk").mkdir()
        argv = daemon_argv(tmp, args)
        log = tmp / "daemon.log"
        with open(log, "wb") as fh:  # its own session: a terminal's ^C reaches the bench only,
            proc = subprocess.Popen(  # which stops the daemon in order
                argv, stdout=fh, stderr=subprocess.STDOUT, env=daemon_env(args.page_size),
                start_new_session=True,
            )
        try:
            address = argv[argv.index("--listen") + 1]
            wait_serving(proc, address, log)
            yield address
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- sampling and progress ---------------------------------------------------------------------
