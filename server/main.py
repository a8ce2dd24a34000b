"""``kvtier serve``: run the daemon until SIGTERM/SIGINT.

Startup order: start-up checks and instance locks (``preflight``: a bad device, disk path, socket
or port, or a daemon already running, is one line and exit 2) → engine → metrics port → listeners
bound (a stale socket of a dead daemon replaced) → health SERVING → ``READY=1`` to systemd.
Shutdown: health NOT_SERVING and new calls UNAVAILABLE → in-flight calls finish (within the
grace period) → ``engine.close`` drains transfers and persists the disk index → exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from typing import Any

from kvtier.config import OffloadConfig
from kvtier.flags import package_version as version

from .app import create_server, listen_addresses
from .notify import sd_notify
from .preflight import fail, prepare

log = logging.getLogger("kvtier.server")


SWITCH_INTERVAL_S = 0.0005


def run(config: OffloadConfig) -> int:
    """Serve until a stop signal; returns the exit status. ConfigError propagates (exit 2)."""
    addrs, _token = listen_addresses(config)  # refuse a bad listener setup before anything else
    locks = prepare(config, addrs)  # one line naming the setting, before any socket is touched
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The daemon owns its process: a short GIL switch interval lets a restore's thread run
    # within ~0.5 ms while transfer lanes do Python bookkeeping (default 5 ms tails).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    try:
        with runner:
            return runner.run(_serve(config))
    finally:
        for lock in locks:
            lock.release()


def _build_engine(config: OffloadConfig) -> Any:
    from kvtier.engine import configure_offload  # heavy: torch, worker threads

    return configure_offload(config)


async def _serve(config: OffloadConfig) -> int:
    from kvtier.metrics import DaemonMetrics

    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(None, _build_engine, config)
    metrics = DaemonMetrics(engine, version())
    try:
        server = await _start(config, engine, metrics)
    except BaseException:
        metrics.close()
        await loop.run_in_executor(None, lambda: engine.close(grace=1.0))
        raise
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        return await _shutdown(config, server, engine)
    finally:
        metrics.close()


async def _start(config: OffloadConfig, engine: Any, metrics: Any) -> Any:
    """Metrics port, then listeners (stale sockets replaced), then SERVING and READY=1."""
    if config.metrics_addr:
        try:
            port = metrics.serve(config.metrics_addr)
        except OSError as exc:  # taken since the start-up check: still one line, exit 2
            fail("metrics_addr", f"cannot bind {config.metrics_addr}: {exc.strerror}")
        log.info("metrics on %s:%d/metrics", config.metrics_addr.rpartition(":")[0], port)
    server, ports = create_server(config, engine, observe=metrics.observe_rpc, version=version())
    await server.start()
    await server.set_serving()
    log.info("serving %s on %s (device %s)", version(), ", ".join(ports),
             ",".join(config.resolved_devices()))
    sd_notify(f"READY=1\nSTATUS=serving on {', '.join(ports)}")
    return server


async def _shutdown(config: OffloadConfig, server: Any, engine: Any) -> int:
    deadline = time.monotonic() + config.grace_s
    sd_notify("STOPPING=1")
    log.info("draining (grace %.1fs)", config.grace_s)
    await server.drain(config.grace_s * 0.5)
    left = max(0.1, deadline - time.monotonic())
    await asyncio.get_running_loop().run_in_executor(None, lambda: engine.close(grace=left))
    log.info("stopped")
    return 0
