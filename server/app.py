"""Building the daemon's gRPC server: listeners, services, interceptors, drain.

``create_server(config, engine) -> (server, ports)``. Unix sockets are the default and are protected
by permissions (socket 0660 in a 0750 directory); TCP listeners exist only when an address is
given, and then a token is required (checked by ``interceptors.Gate``; health is exempt).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvtier.config import ENV_PREFIX, MIB, OffloadConfig
from kvtier.errors import ConfigError
from kvtier.types import PoolId
from kvtier.v1 import kvtier_pb2, kvtier_pb2_grpc

from .auth import TokenAuth
from .credentials import TenantCredentials
from .fastlane import FastLane, lane_path
from .fdpass import (
    FdExchange,
    descriptor_limit,
    descriptor_shares,
    grpc_connections,
    session_paths,
)
from .interceptors import Gate, Observe
from .servicer import KVTierServicer
from .tenancy import Tenancy
from .turns import Turns
from .watch import WatchHub

log = logging.getLogger(__name__)
SERVICE = kvtier_pb2.DESCRIPTOR.services_by_name["KVTier"].full_name
SOCKET_NAME = "kvtier.sock"


def default_socket_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get("RUNTIME_DIRECTORY"):
        return env["RUNTIME_DIRECTORY"].split(":")[0]
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "kvtier")
    return f"/tmp/kvtier-{os.getuid()}"


def listen_addresses(config: OffloadConfig) -> tuple[list[str], str]:
    """(addresses, token). Refuses TCP without a token, naming the settings."""
    addrs = list(config.listen) or [f"unix://{os.path.join(default_socket_dir(), SOCKET_NAME)}"]
    token = config.read_token()
    tcp = [a for a in addrs if not a.startswith("unix://")]
    if tcp and not token:
        raise ConfigError(
            f"TCP listener {tcp[0]} needs a token: set {ENV_PREFIX}TOKEN or "
            f"{ENV_PREFIX}TOKEN_FILE (--token-file)"
        )
    return addrs, token


def socket_dir(path: str) -> str:
    """Create the socket's directory (0750) if missing; the default one must be ours.
    OSError propagates (the start-up checks name the setting)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o750, exist_ok=True)
        os.chmod(directory, 0o750)
    st = os.stat(directory)
    if directory == default_socket_dir() and st.st_uid != os.getuid():
        raise ConfigError(f"socket directory {directory} is owned by uid {st.st_uid}, not us")
    return directory


def _prepare_unix(path: str) -> None:
    """Only after this daemon holds the socket's lock (``pidlock``): nothing live is unlinked."""
    socket_dir(path)
    if os.path.exists(path):
        os.unlink(path)  # stale socket of a crashed daemon


def _nothing_to_reload() -> None:
    log.info("SIGHUP: no tenants file is configured (KVCACHED_OFFLOAD_TENANTS_FILE); "
             "nothing to reload")


class KVTierServer:
    """The gRPC server plus what its shutdown needs (health, drain flag, worker threads)."""

    def __init__(self, server: grpc.aio.Server, health: HealthServicer, draining: asyncio.Event,
                 executor: ThreadPoolExecutor, instance: str,
                 lane: FastLane | None = None, tenants: TenantCredentials | None = None,
                 sessions: FdExchange | None = None) -> None:
        self.server, self.health, self.draining = server, health, draining
        self.executor, self.instance, self.lane = executor, instance, lane
        self.tenants, self.sessions = tenants, sessions

    async def start(self) -> None:
        await self.server.start()
        if self.lane is not None:
            await self.lane.start()
        # SIGHUP: read the tenants file again; without one there is nothing to reload, but the
        # signal's default action (an unclean exit: keyed CPU pages lost) must not be taken
        reload = self.tenants.reload if self.tenants is not None else _nothing_to_reload
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
        if self.sessions is not None:
            await self.sessions.start()

    async def set_serving(self) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace: float) -> None:
        """Health NOT_SERVING, new calls UNAVAILABLE, in-flight calls get ``grace`` seconds."""
        self.draining.set()
        if self.lane is not None:
            await self.lane.stop()
        if self.sessions is not None:
            await self.sessions.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.executor.shutdown(wait=False, cancel_futures=True)


def create_server(
    config: OffloadConfig, engine: Any, *, observe: Observe | None = None, version: str = "0"
) -> tuple[KVTierServer, list[str]]:
    """Build (not start) the server with every listener bound; returns the bound addresses."""
    addrs, token = listen_addresses(config)
    draining = asyncio.Event()
    limit = config.max_message_mb * MIB
    tenants = TenantCredentials.load(config.tenants_file) if config.tenants_file else None
    if tenants is not None:
        log.info("tenant credentials checked on every call (%s)", config.tenants_file)
    fd_limit = descriptor_limit()
    server = grpc.aio.server(
        interceptors=[Gate(TokenAuth(token), draining, observe, tenants,
                           Turns(config.calls_per_tenant))],
        options=[("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", limit), ("grpc.so_reuseport", 0),
                 ("grpc.max_allowed_incoming_connections", grpc_connections(fd_limit)),
                 *peer_bounds(config.keepalive_s)],
    )
    executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvtier-rpc")
    instance = uuid.uuid4().hex
    path = lane_path(addrs)
    conns, _ = descriptor_shares(fd_limit)  # as many as the session socket takes
    lane = FastLane(engine, path, observe, conns) if path is not None else None
    sessions = _sessions(config, engine, lane, executor, addrs, fd_limit)
    tenancy = Tenancy(engine, instance)
    watches = WatchHub(engine, tenancy.owner, executor, draining, config.max_watches)
    servicer = KVTierServicer(
        engine, device=config.resolved_device(), default_page_size=config.page_size,
        version=version, tenancy=tenancy, executor=executor, watches=watches, lane=lane,
        sessions=sessions,
    )
    kvtier_pb2_grpc.add_KVTierServicer_to_server(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _enable_reflection(server)
    bound = _bind(server, addrs)
    return KVTierServer(server, health, draining, executor, instance, lane, tenants,
                        sessions), bound


MAX_STREAMS = 256  # calls at once on one connection (each costs ~14 KB)
WORKERS = 64  # threads running calls; one tenant runs at most CALLS_PER_TENANT at once


def peer_bounds(keepalive_s: float) -> list[tuple[str, int]]:
    """A peer's hold on the daemon, bounded: streams at once on one connection (a peer could
    open them by the hundred thousand), and a ping on every connection each ``keepalive_s``, so
    a peer that vanished without closing it (a host gone, a process stopped) loses its calls,
    and their quotas (WatchEvents slots), when it leaves one unanswered a third as long."""
    every, answer = int(keepalive_s * 1000), int(max(1.0, keepalive_s / 3) * 1000)
    return [
        ("grpc.max_concurrent_streams", MAX_STREAMS),
        ("grpc.keepalive_time_ms", every),
        ("grpc.keepalive_timeout_ms", answer),
        ("grpc.http2.ping_timeout_ms", answer),  # what ends an unanswered ping in this gRPC
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _sessions(config: OffloadConfig, engine: Any, lane: FastLane | None,
              executor: ThreadPoolExecutor, addrs: list[str], fd_limit: int) -> FdExchange | None:
    """The session socket(s): pool memory as descriptors, and leases that detach pools."""
    paths = session_paths(addrs)
    if not paths:
        return None

    def detach(pool_id: int) -> None:
        engine.detach(PoolId(pool_id))
        if lane is not None:
            lane.revoke(pool_id)

    return FdExchange(paths, lease_s=config.lease_s, detach=detach, executor=executor,
                      fd_limit=fd_limit)


def _enable_reflection(server: grpc.aio.Server) -> None:
    """Reflection is a debugging aid: without grpcio-reflection the daemon still serves."""
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        log.warning("server reflection disabled: install grpcio-reflection to enable it")
        return
    health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE, health, reflection.SERVICE_NAME), server)


def _bind(server: grpc.aio.Server, addrs: list[str]) -> list[str]:
    bound = []
    for addr in addrs:
        if addr.startswith("unix://"):
            path = addr[len("unix://"):]
            _prepare_unix(path)
            server.add_insecure_port(addr)
            os.chmod(path, 0o660)
            bound.append(addr)
        else:
            try:
                port = server.add_insecure_port(addr)
            except RuntimeError:
                port = 0
            if port == 0:
                raise ConfigError(f"{ENV_PREFIX}LISTEN: cannot bind {addr}")
            bound.append(f"{addr.rpartition(':')[0]}:{port}")
    return bound
