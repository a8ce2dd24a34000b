"""``kvtier.v1.KVTier``: translate requests into engine calls and replies, map errors. No logic.

Every engine call runs on a worker thread (engine calls block: restores, disk reads); the event
loop only parses, validates and replies. Errors map to status codes in ``errors.py`` only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, Future
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc
import numpy as np

from kvtier.caller import Caller
from kvtier.errors import FailedPrecondition, KVTierError
from kvtier.types import PageId, PoolId, SlotIndex, Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

from . import convert, layers, validate
from .errors import is_internal, shortfall, status_for
from .fastlane import FastLane
from .fdpass import FdExchange
from .tenancy import Tenancy
from .watch import WatchHub

log = logging.getLogger(__name__)
T = TypeVar("T")
Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class KVTierServicer(pb_grpc.KVTierServicer):
    def __init__(
        self, engine: Any, *, device: str, default_page_size: int, version: str,
        tenancy: Tenancy, executor: Executor, watches: WatchHub,
        lane: FastLane | None = None, sessions: FdExchange | None = None,
    ) -> None:
        self._engine = engine
        self._device = device
        self._page_size = default_page_size
        self._version = version
        self._tenancy = tenancy
        self._executor = executor
        self._lane = lane
        self._sessions = sessions
        self._watches = watches

    async def _run(self, ctx: Ctx, fn: Callable[[], T],
                   undo: Callable[[T], None] | None = None, caller: Caller | None = None) -> T:
        """``fn`` on a worker thread. A call that ends while ``fn`` runs gets no reply: cancelled
        by its caller, or past its deadline. ``undo(result)`` then takes back what ``fn`` handed
        out (pins, pages, pools) once ``fn`` is done, so nothing stays held for nobody. The
        caller's deadline passes before the daemon's (by the time the request took to arrive):
        a result ready within ``reply_margin`` of the daemon's deadline is taken back too, and
        the caller told DEADLINE_EXCEEDED, rather than sent to a caller likely gone. A cancel
        gives up ``caller`` (``caller_of``): ``fn`` stops what it does for it at its next step."""
        margin = reply_margin(ctx.time_remaining())
        work = self._executor.submit(fn)
        try:
            result = await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            if caller is not None:
                caller.give_up()
            if undo is not None:
                work.add_done_callback(functools.partial(_take_back, undo))
            raise
        except Exception as exc:
            code, message = status_for(exc)
            if is_internal(exc):
                log.exception("internal error in %s", fn)
            await _abort(ctx, code, message)
        left = ctx.time_remaining()
        if undo is not None and left is not None and left <= margin:
            # Not awaited: a take-back queued behind busy workers must run even if this call is
            # cancelled meanwhile (its deadline is that close); awaiting it let the cancel drop
            # the queued job, and the pins stayed.
            self._executor.submit(_take_back, undo, work)
            await _abort(ctx, grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
        return result

    def _acquire_resident(self, req: pb.AcquireRequest) -> list[int] | None:
        """The engine's non-blocking fast path; ``None`` sends the call down the full path."""
        ref = req.pool
        if not req.HasField("pool") or ref.instance != self._tenancy.instance or not req.page_ids:
            return None
        if len(req.page_ids) > 4096 or not 0 <= req.timeout_s < math.inf:
            return None  # the full path reports a bad timeout_s
        pages = np.array(req.page_ids, dtype=np.int64)  # in C; the engine refuses bad ids
        result: list[int] | None = self._engine.try_acquire(ref.tenant, PoolId(ref.pool_id), pages)
        return result

    def _pool(self, msg: Any) -> PoolId:
        return self._tenancy.owned(msg.pool, present=msg.HasField("pool"))

    # --- pools ------------------------------------------------------------------------------
    async def Attach(self, req: pb.AttachRequest, ctx: Ctx) -> pb.AttachReply:
        local = self._sessions is not None and ctx.peer().startswith("unix:")

        def call() -> pb.AttachReply:
            tenant = validate.tenant(req.tenant)
            validate.layout(req.layout)
            size = validate.page_size(req.page_size, self._page_size)
            slots = validate.num_slots(req.num_pages, req.bytes, req.WhichOneof("size"), size)
            prio = validate.default_priority(req.default_priority)
            if self._device == "cpu" and not local:
                raise FailedPrecondition(
                    "CPU-mode pool memory is handed over the daemon's unix session socket: "
                    "connect over unix://")
            pool = self._engine.attach(tenant, slots, size, default_priority=prio,
                                       device=req.device or None)
            log.info("attached pool %s: tenant=%s slots=%d layout=%r", pool.pool_id, tenant,
                     slots, req.layout[:200])
            reply = convert.attach_reply(pool, self._tenancy.instance)
            self._lease(reply, tenant, int(pool.pool_id), pool.dev.fd, None)
            if self._lane is not None:
                reply.fast_lane.path = self._lane.path
                reply.fast_lane.capability = self._lane.grant(int(pool.pool_id), tenant)
            return reply

        return await self._run(ctx, call, self._undo_attach)

    async def Register(self, req: pb.RegisterRequest, ctx: Ctx) -> pb.AttachReply:
        from .segments import open_segments  # torch views: only needed here

        def call() -> pb.AttachReply:
            tenant = validate.tenant(req.tenant)
            validate.layout(req.layout)
            prio = validate.default_priority(req.default_priority)
            tickets = None if self._sessions is None else self._sessions.tickets
            views, session = open_segments(req.segments, self._device, tenant, tickets)
            try:
                if self._sessions is not None and session is not None:
                    self._sessions.admit(tenant, session)  # its share of pool-holding sessions
                pool = self._engine.register(tenant, views, default_priority=prio)
            finally:
                views.clear()  # the pool keeps its own; a refused one leaves nothing mapped
            reply = convert.attach_reply(pool, self._tenancy.instance, registered=True)
            self._lease(reply, tenant, int(pool.pool_id), -1, session)
            return reply

        return await self._run(ctx, call, self._undo_attach)

    def _undo_attach(self, reply: pb.AttachReply) -> None:
        self._detach(PoolId(reply.pool_id))

    def _detach(self, pool_id: PoolId) -> None:
        self._engine.detach(pool_id)
        if self._lane is not None:
            self._lane.revoke(int(pool_id))
        if self._sessions is not None:
            self._sessions.forget(int(pool_id))

    def _lease(self, reply: pb.AttachReply, tenant: str, pool_id: int, fd: int,
               session: int | None) -> None:
        """Bind the pool to the session that brought its memory (if any); issue its lease ticket
        (redeemed for the memfd in CPU mode; kept by the client to renew its lease)."""
        if self._sessions is None:
            return
        if session is not None:
            self._sessions.bind(pool_id, session, tenant)
        reply.lease.path = self._sessions.path
        reply.lease.ticket = self._sessions.issue(tenant, pool_id, fd)

    async def Detach(self, req: pb.DetachRequest, ctx: Ctx) -> pb.DetachReply:
        def call() -> pb.DetachReply:
            self._detach(self._pool(req))
            return pb.DetachReply()

        return await self._run(ctx, call)

    # --- pages ------------------------------------------------------------------------------
    async def Allocate(self, req: pb.AllocateRequest, ctx: Ctx) -> pb.AllocateReply:
        def call() -> pb.AllocateReply:
            pool = self._pool(req)
            n = validate.count(req.count, "count")
            prio = validate.priority(req.priority) if req.HasField("priority") else None
            seq = (validate.count(req.sequence_length, "sequence_length", 1 << 40)
                   if req.HasField("sequence_length") else None)
            got = self._engine.allocate(pool, n, priority=prio, sequence_length=seq)
            if got is None:
                raise shortfall(f"pool {pool} has no room for {n} pages")
            return pb.AllocateReply(pages=[pb.PageSlot(page_id=p, slot=s) for p, s in got])

        def undo(reply: pb.AllocateReply) -> None:
            self._engine.free(self._pool(req), [PageId(p.page_id) for p in reply.pages])

        return await self._run(ctx, call, undo)

    async def Free(self, req: pb.PagesRequest, ctx: Ctx) -> pb.Empty:
        return await self._pages(ctx, req, self._engine.free, lambda _: pb.Empty())

    async def Release(self, req: pb.PagesRequest, ctx: Ctx) -> pb.Empty:
        return await self._pages(ctx, req, self._engine.release, lambda _: pb.Empty())

    async def Offload(self, req: pb.PagesRequest, ctx: Ctx) -> pb.CountReply:
        return await self._pages(ctx, req, self._engine.offload, lambda n: pb.CountReply(count=n))

    async def Prefetch(self, req: pb.PagesRequest, ctx: Ctx) -> pb.CountReply:
        return await self._pages(ctx, req, self._engine.prefetch, lambda n: pb.CountReply(count=n))

    async def _pages(self, ctx: Ctx, req: pb.PagesRequest, op: Callable[..., Any],
                     reply: Callable[[Any], T]) -> T:
        def call() -> T:
            pool = self._pool(req)
            return reply(op(pool, validate.ids(req.page_ids, "page_ids")))

        return await self._run(ctx, call)

    async def Acquire(self, req: pb.AcquireRequest, ctx: Ctx) -> pb.AcquireReply:
        remaining = ctx.time_remaining()

        def undo(_: object = None) -> None:
            self._engine.release(self._pool(req), validate.ids(req.page_ids, "page_ids"))

        fast = self._acquire_resident(req)
        if fast is not None:  # every page resident: no thread hop, no waiting
            left = ctx.time_remaining()
            if left is not None and left <= reply_margin(remaining):  # as _run takes back
                undo()
                await _abort(ctx, grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
            return pb.AcquireReply(slots=fast)

        def call() -> pb.AcquireReply:
            pool = self._pool(req)
            pages = validate.ids(req.page_ids, "page_ids")
            timeout = validate.timeout(req.timeout_s) or remaining
            if timeout is not None and remaining is not None:
                # no reply can reach the caller after that (nor, see _run, just before)
                timeout = min(timeout, max(0.0, remaining - reply_margin(remaining)))
            slots = self._engine.acquire(pool, pages, timeout=timeout)  # an array, as the ids
            if slots is None:
                raise shortfall(f"pool {pool} has too few unpinned slots for {len(pages)} pages")
            return pb.AcquireReply(slots=slots.tolist())

        return await self._run(ctx, call, undo)

    async def SetPriority(self, req: pb.SetPriorityRequest, ctx: Ctx) -> pb.Empty:
        def call() -> pb.Empty:
            pool = self._pool(req)
            pages = validate.ids(req.page_ids, "page_ids")
            self._engine.set_priority(pool, pages, validate.priority(req.priority))
            return pb.Empty()

        return await self._run(ctx, call)

    async def PageTiers(self, req: pb.PagesRequest, ctx: Ctx) -> pb.PageTiersReply:
        def call() -> pb.PageTiersReply:
            pool = self._pool(req)
            infos = [self._engine.page_info(pool, PageId(p))
                     for p in validate.ids(req.page_ids, "page_ids").tolist()]
            return pb.PageTiersReply(
                tiers=[convert.tier(i.tier if i.tier is not None else Tier.GPU) for i in infos],
                lost=[i.tier is None for i in infos])

        return await self._run(ctx, call)

    # --- prefix reuse -----------------------------------------------------------------------
    async def Store(self, req: pb.StoreRequest, ctx: Ctx) -> pb.CountReply:
        pool_id = PoolId(req.pool.pool_id)
        caller = caller_of(ctx)  # no copy once the caller may have reused its memory

        def call() -> pb.CountReply:
            pool = self._pool(req)
            keys, slots = validate.keyed_slots(req.keys, req.slots)
            n = self._engine.store(pool, keys, [SlotIndex(s) for s in slots], caller)
            return pb.CountReply(count=n)

        def undo(_: pb.CountReply) -> None:  # the caller gave up: it may have reused its memory
            self._engine.forget(pool_id, list(req.keys))

        return await self._run(ctx, call, undo, caller)

    async def Lookup(self, req: pb.LookupRequest, ctx: Ctx) -> pb.LookupReply:
        def call() -> pb.LookupReply:
            tiers = self._engine.lookup(validate.tenant(req.tenant), validate.keys(req.keys))
            return pb.LookupReply(tiers=[convert.tier(t) for t in tiers])

        return await self._run(ctx, call)

    async def Load(self, req: pb.LoadRequest, ctx: Ctx) -> pb.CountReply:
        caller = caller_of(ctx)  # a load writes the caller's slots: not once it may reuse them

        def call() -> pb.CountReply:
            pool = self._pool(req)
            keys, slots = validate.keyed_slots(req.keys, req.slots)
            n = self._engine.load(pool, keys, [SlotIndex(s) for s in slots], caller)
            return pb.CountReply(count=n)

        return await self._run(ctx, call, caller=caller)

    async def LoadLayers(self, req: pb.LoadLayersRequest, ctx: Ctx
                         ) -> AsyncIterator[pb.LoadLayersReply]:
        async for reply in layers.stream(self._engine, self._executor, self._pool, req, ctx,
                                       caller_of(ctx)):
            yield reply

    # --- operations -------------------------------------------------------------------------
    async def Stats(self, req: pb.StatsRequest, ctx: Ctx) -> pb.StatsReply:
        def call() -> pb.StatsReply:  # a tenant's own view; empty tenant: the daemon's
            tenant = validate.tenant(req.tenant) if req.tenant else None
            stats = self._engine.stats(tenant)
            return convert.stats_reply(stats, self._version, self._tenancy.instance)

        return await self._run(ctx, call)

    async def WatchEvents(self, req: pb.WatchRequest, ctx: Ctx) -> AsyncIterator[pb.Event]:
        def check() -> None:
            validate.tenant(req.tenant)
            if validate.non_negative(req.pool_id, "pool_id"):
                self._tenancy.owned(pb.PoolRef(tenant=req.tenant, pool_id=req.pool_id))

        await self._run(ctx, check)
        try:
            watch = self._watches.open(req.tenant, req.pool_id)  # waits on the loop, no thread
        except KVTierError as exc:
            await ctx.abort(*status_for(exc))
            raise  # unreachable: abort raises
        try:
            while (event := await watch.next()) is not None:
                yield convert.event(event)
        finally:
            self._watches.close(watch)


def caller_of(ctx: Ctx) -> Caller:
    """The call's caller (``kvtier/caller.py``): gone at the call's deadline less ``reply_margin``
    (the caller's own deadline passes that much sooner), or once cancelled (``_run``)."""
    left = ctx.time_remaining()
    return Caller() if left is None else Caller(time.monotonic() + left - reply_margin(left))


def reply_margin(remaining: float | None) -> float:
    """How close to its deadline a call's result is taken back instead of sent (see ``_run``):
    a tenth of the time it was given, 5 to 50 ms (the time a request takes to arrive)."""
    return 0.0 if remaining is None else min(0.05, max(0.005, 0.1 * remaining))


async def _abort(ctx: Ctx, code: grpc.StatusCode, message: str) -> NoReturn:
    """``ctx.abort``; on a call gRPC already ended (its deadline passed meanwhile) there is
    nothing to send: it ends as cancelled (no error logged for an ordinary client timeout)."""
    try:
        await ctx.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception:  # gRPC's "execute_batch" failure: the call is over
        raise asyncio.CancelledError from None
    raise AssertionError("abort returned")


def _take_back(undo: Callable[[Any], None], work: Future[Any]) -> None:
    """``undo`` of what a call whose caller went away handed out (see ``_run``)."""
    if work.cancelled() or work.exception() is not None:
        return  # it handed out nothing
    try:
        undo(work.result())
    except Exception:  # the pool went meanwhile: nothing left to take back
        log.debug("taking back what a cancelled call handed out failed", exc_info=True)
