"""The session socket: pool memory handed over as file descriptors, and the pools' leases.

gRPC can't carry descriptors, so a unix socket beside each unix gRPC listener (``<socket>.fd``,
mode 0660) does. A client keeps one connection open for its lifetime: that is its *session*.

Frames (little endian), one request then one reply, any number per connection:
    request:  op u8 | tenant_len u8 | ticket 32 bytes | tenant (tenant_len bytes, UTF-8)
    reply:    status u8 | ticket 32 bytes
``op`` 1 REDEEM: the ticket of an Attach/Register reply. OK: the pool is now this session's; for
a CPU-mode pool the reply carries its sealed memfd (SCM_RIGHTS). ``op`` 2 DEPOSIT: the request
carries exactly one descriptor (a sealed memfd to Register); OK: the reply's ticket names it in
``Segment.memfd_ticket``. ``op`` 3 RENEW: a ticket this client redeemed before, sent on a new
connection after its old one broke: OK when the pool's session closed less than the grace ago
(the pool now belongs to this session; no memory comes with it). ``status``: 0 OK, 1 DENIED
(unknown, used, expired or another tenant's ticket), 2 REFUSED (a deposit without exactly one
descriptor, or too many unredeemed deposits; a REDEEM or RENEW that would make this the tenant's
sessions holding pools more than a quarter of the connection cap, or its client user's more than
half: a client holds all its pools on one session, so only a client opening a session per pool
gets there, and it can't lock the other tenants, or users, out; a Register binding its pool to
the session that deposited its memory is held to the same shares, RESOURCE_EXHAUSTED). Any other
op, a bad tenant or a descriptor flood
closes the connection; descriptors that come with a frame that does not use them are closed.
Tickets never appear in logs.

Leases: when a session's connection closes (the client exited, ``kill -9`` included) its pools
are detached after ``lease_s`` (0: at once); keyed pages stay. A connection that sends garbage,
nothing, or hangs up holds no pool and leaves nothing behind (its deposits are closed).
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import resource
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvtier.errors import CapacityError, KVTierError
from kvtier.tiers.diskio import Throttle

from .handed import close_handed, drain_handed, fds_of, receive_space
from .leases import Leases
from .tickets import TICKET_BYTES, Tickets

log = logging.getLogger(__name__)
REQUEST = struct.Struct(f"<BB{TICKET_BYTES}s")
REPLY = struct.Struct(f"<B{TICKET_BYTES}s")
REDEEM, DEPOSIT, RENEW = 1, 2, 3
OK, DENIED, REFUSED = 0, 1, 2
MAX_TENANT = 128
MAX_CONNS = 1024
_FDS_PER_READ = 4  # descriptors a connection may have pending: more closes it
_SWEEP_S = 1.0
_PAUSE_S = 0.25  # the listeners rest this long after accept ran out of descriptors
_WARN_S = 10.0  # and say so at most this often
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def descriptor_shares(limit: int) -> tuple[int, int]:
    """(session connections, unredeemed deposits) the daemon takes at most, for a process
    limit of ``limit`` descriptors: an eighth and a quarter of it, so sessions can never hold
    more than about a third of the descriptors the daemon needs for pools, files and gRPC."""
    return max(8, min(MAX_CONNS, limit // 8)), max(16, limit // 4)


def grpc_connections(limit: int) -> int:
    """Connections the gRPC listeners take at most (a quarter of ``limit``): without a cap, raw
    connections by the thousand (no token needed to open one) ran the daemon out of descriptors,
    so nothing could attach, open a file or map a pool until keepalive dropped them. At the cap
    a new connection is closed at once; connections already open keep working."""
    return max(16, limit // 4)


def descriptor_limit() -> int:
    """This process's descriptor limit (soft), raised to the hard limit first where it is
    lower (a daemon serving many clients wants them all; the shell's default is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    session: int
    buf: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)


class FdExchange:
    """Tickets, leases and the listener; ``detach(pool_id)`` runs on ``executor`` threads;
    ``fd_limit``: the process's descriptor limit (``descriptor_limit``), which bounds how many
    sessions and deposits are taken (``descriptor_shares``)."""

    def __init__(self, paths: list[str], *, lease_s: float, detach: Callable[[int], None],
                 executor: Executor, ttl: float = 30.0, fd_limit: int = 1024) -> None:
        self.paths, self.path, self.lease_s = paths, paths[0], lease_s
        self.max_conns, deposits = descriptor_shares(fd_limit)
        self.tickets, self.leases = Tickets(ttl, max_total=deposits), Leases()
        self._accept_errors = Throttle(_WARN_S)
        self._detach, self._executor = detach, executor
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[socket.socket] = []
        self._conns: dict[_Conn, None] = {}  # oldest first
        # Pool-holding sessions per tenant (a quarter of the connection cap) and per client
        # user (half: tenant names are free without a tenants file; a user is the kernel's word).
        self.tenant_sessions = max(1, self.max_conns // 4)
        self.user_sessions = max(1, self.max_conns // 2)
        self._tenants: dict[int, str] = {}  # live session holding a pool -> its tenant
        self._uids: dict[int, int] = {}  # live session -> its peer's uid (SO_PEERCRED; -1 unknown)
        self._shares = threading.Lock()  # _tenants: the loop's redeems, the workers' Registers
        self._sweeper: asyncio.TimerHandle | None = None

    # --- called by the servicer (worker threads) -----------------------------------------------
    def issue(self, tenant: str, pool_id: int, fd: int) -> bytes:
        return self.tickets.issue(tenant, pool_id, fd)

    def admit(self, tenant: str, session: int) -> None:
        """Whether a Register's pool may be held by ``session`` (the connection that deposited
        its memory): ``CapacityError`` when that session would be one more holding pools of a
        tenant, or of a client user, already at its share (see the module docstring)."""
        with self._shares:
            if self._crowded(tenant, session):
                raise CapacityError("segments: sessions holding pools of this tenant (or this "
                                    "user) are at their share: hold pools on fewer sessions")

    def bind(self, pool_id: int, session: int, tenant: str | None = None) -> None:
        if tenant is not None:
            with self._shares:
                self._tenants[session] = tenant
        if not self.leases.bind(pool_id, session) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._orphaned, [pool_id])

    def forget(self, pool_id: int) -> None:
        self.leases.forget(pool_id)
        self.tickets.forget_pool(pool_id)

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)  # stale socket of a crashed daemon
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, 0o660)
            sock.listen(socket.SOMAXCONN)  # the kernel caps it (net.core.somaxconn)
            sock.setblocking(False)
            self._listeners.append(sock)
            self._loop.add_reader(sock, self._accept, sock)
        self._sweeper = self._loop.call_later(_SWEEP_S, self._sweep)

    async def stop(self) -> None:
        """Close every session without reaping (the daemon is going away with all its pools)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self._conns):
            self._close(conn, reap=False)
        for sock, path in zip(self._listeners, self.paths, strict=False):
            if self._loop is not None:
                self._loop.remove_reader(sock)
            sock.close()
            if os.path.exists(path):
                os.unlink(path)
        self._listeners = []
        self.tickets.close()

    # --- connections ----------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        assert self._loop is not None
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: rest (the connection waits in the backlog)
            self._rest(listener, exc)
            return
        if len(self._conns) >= self.max_conns and not self._make_room():
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, self.leases.open())
        self._uids[conn.session] = _peer_uid(sock)
        self._conns[conn] = None
        self._loop.add_reader(sock, self._readable, conn)

    def _make_room(self) -> bool:
        """At the connection cap: close the oldest connection that holds no pool (idle, or
        only deposits), so connections opened and left idle can't keep clients out; a client
        whose session closed reconnects on its next session call. False: every one holds a
        pool (pools cost memory, which the tiers and quotas bound)."""
        holding = self.leases.holders()
        for conn in self._conns:
            if conn.session not in holding:
                self._close(conn)
                return True
        return False

    def _rest(self, listener: socket.socket, exc: OSError) -> None:
        """Stop accepting for ``_PAUSE_S``: the pending connection stays readable, so accepting
        again at once would spin the event loop (and the log) until a descriptor is free."""
        assert self._loop is not None
        held = self._accept_errors.fail()
        if held is not None:
            log.warning("session socket: accept failed (%s, %d more times since last logged); "
                        "pausing new sessions", exc, held)
        self._loop.remove_reader(listener)
        self._loop.call_later(_PAUSE_S, self._resume, listener)

    def _resume(self, listener: socket.socket) -> None:
        if self._loop is not None and listener in self._listeners:
            self._loop.add_reader(listener, self._accept, listener)

    def _readable(self, conn: _Conn) -> None:
        try:
            data, anc, _, _ = conn.sock.recvmsg(  # room for every descriptor a message
                4096, receive_space(), socket.MSG_CMSG_CLOEXEC)  # holds: none closed in here
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, anc = b"", []
        conn.fds.extend(fds_of(anc))
        if not data or len(conn.fds) > _FDS_PER_READ:
            self._close(conn)
            return
        conn.buf += data
        while self._frame(conn):
            pass

    def _frame(self, conn: _Conn) -> bool:
        """Answer one complete frame; ``False`` when none is complete or the connection closed."""
        if len(conn.buf) < REQUEST.size:
            return False
        op, tlen, ticket = REQUEST.unpack_from(conn.buf)
        end = REQUEST.size + tlen
        if op not in (REDEEM, DEPOSIT, RENEW) or not 0 < tlen <= MAX_TENANT:
            self._close(conn)
            return False
        if len(conn.buf) < end:
            return False
        try:
            tenant = bytes(conn.buf[REQUEST.size:end]).decode()
        except UnicodeDecodeError:
            self._close(conn)
            return False
        del conn.buf[:end]
        fds, conn.fds = conn.fds, []
        status, out, fd = self._answer(op, tenant, ticket, fds, conn.session)
        return self._reply(conn, REPLY.pack(status, out), fd)

    def _answer(self, op: int, tenant: str, ticket: bytes, fds: list[int],
                session: int) -> tuple[int, bytes, int]:
        """(status, ticket, descriptor to send or -1); closes every descriptor it does not keep."""
        if op == DEPOSIT:
            if len(fds) != 1:
                close_handed(fds)
                return REFUSED, bytes(TICKET_BYTES), -1
            got = self.tickets.deposit(tenant, fds[0], session)
            return (OK, got, -1) if got is not None else (REFUSED, bytes(TICKET_BYTES), -1)
        close_handed(fds)
        none = bytes(TICKET_BYTES)
        if op == RENEW:
            pool = self.tickets.renewable(ticket, tenant)
            if pool is None:
                return DENIED, none, -1
            with self._shares:
                if self._crowded(tenant, session):
                    return REFUSED, none, -1
                if not self.leases.rebind(pool, session):
                    return DENIED, none, -1
                self._tenants[session] = tenant
            return OK, none, -1
        if not self.tickets.redeemable(ticket, tenant):
            return DENIED, none, -1
        with self._shares:
            if self._crowded(tenant, session):
                return REFUSED, none, -1
            redeemed = self.tickets.redeem(ticket, tenant)
            if redeemed is None:
                return DENIED, none, -1
            pool_id, fd = redeemed
            self._tenants[session] = tenant
        self.bind(pool_id, session)
        return OK, none, fd

    def _crowded(self, tenant: str, session: int) -> bool:
        """A session holding no pool yet, of a tenant (or a client user) whose sessions already
        hold pools in ``tenant_sessions`` of the connection cap (see the module docstring);
        ``_shares`` held."""
        if session in self._tenants:
            return False
        if sum(t == tenant for t in self._tenants.values()) >= self.tenant_sessions:
            return True
        uid = self._uids.get(session, -1)
        return uid >= 0 and sum(self._uids.get(s) == uid for s in self._tenants) >= (
            self.user_sessions)

    def _reply(self, conn: _Conn, frame: bytes, fd: int) -> bool:
        try:
            anc = [] if fd < 0 else [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [fd]))]
            sent = conn.sock.sendmsg([frame], anc)
        except OSError:
            sent = -1  # a client that does not read its replies: hang up on it
        finally:
            if fd >= 0:
                os.close(fd)
        if sent != len(frame):
            self._close(conn)
            return False
        return True

    def _close(self, conn: _Conn, *, reap: bool = True) -> None:
        if conn not in self._conns:
            return
        self._conns.pop(conn, None)
        if self._loop is not None:
            self._loop.remove_reader(conn.sock)
        drain_handed(conn.sock)  # descriptors still queued: released here, not in close()
        conn.sock.close()
        close_handed(conn.fds)
        conn.fds = []
        self.tickets.drop_conn(conn.session)
        with self._shares:
            self._tenants.pop(conn.session, None)
            self._uids.pop(conn.session, None)
        pools = self.leases.close(conn.session)
        if reap and pools:
            self._orphaned(pools)

    # --- leases ---------------------------------------------------------------------------------
    def _orphaned(self, pools: list[int]) -> None:
        assert self._loop is not None
        if self.lease_s == 0:
            self._reap(pools)
        else:
            self._loop.call_later(self.lease_s, self._reap, pools)

    def _reap(self, pools: list[int]) -> None:
        for pool_id in self.leases.reap(pools):
            self.tickets.forget_pool(pool_id)
            self._detach_later(pool_id, "its client's session closed")

    def _sweep(self) -> None:
        assert self._loop is not None
        for pool_id in self.tickets.expire():
            self._detach_later(pool_id, "its ticket expired unredeemed")
        self._sweeper = self._loop.call_later(_SWEEP_S, self._sweep)

    def _detach_later(self, pool_id: int, why: str) -> None:
        assert self._loop is not None
        try:
            self._loop.run_in_executor(self._executor, self._detach_quietly, pool_id, why)
        except RuntimeError:
            return  # the daemon is shutting down: every pool goes with it

    def _detach_quietly(self, pool_id: int, why: str) -> None:
        try:
            self._detach(pool_id)
        except KVTierError:
            return  # already detached by its client, or the engine is closing
        log.info("detached pool %d: %s", pool_id, why)


def _peer_uid(sock: socket.socket) -> int:
    """The connected peer's user id (``SO_PEERCRED``), -1 where the kernel does not say."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (OSError, AttributeError):
        return -1
    return int(_UCRED.unpack(creds)[1])


def session_paths(addrs: list[str]) -> list[str]:
    """Beside each unix listener; none for TCP-only daemons (no sessions, no CPU-mode pools)."""
    return [a[len("unix://"):] + ".fd" for a in addrs if a.startswith("unix://")]
