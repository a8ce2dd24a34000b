"""``LoadLayers``: the engine's layer-group load (``engine.load_layers``) as a reply stream.

Contract:
    * ``segment_bounds(values)``: at most ``MAX_BOUNDS`` values, else
      InvalidArgument("segment_bounds"); the rest of the rule (0 = b0 < ... = the pool's
      segment count) is the engine's, raised at the generator's first step before anything is
      copied, so a refused call changes nothing and the daemon and the engine say the same.
    * ``stream(engine, executor, owned, req, ctx)``: checks the pool (``owned``: the tenancy
      rule every pool call follows), keys and slots (as Load) on a worker thread, then pulls the
      engine's generator there one group at a time, yielding one ``LoadLayersReply`` per group.
      A group's reply is sent only after the engine has waited for its copies. Whatever ends
      the stream (the last group, an error, the client cancelling, the daemon draining) closes
      the generator, which releases what the load protected; a group being copied when the
      client goes away finishes first (the close waits for it, on the worker thread).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.types import PoolId
from kvtier.v1 import kvtier_pb2 as pb

from . import validate
from .errors import is_internal, status_for

log = logging.getLogger(__name__)
MAX_BOUNDS = validate.MAX_SEGMENTS + 1  # a group per segment at most


def segment_bounds(values: Sequence[int]) -> list[int]:
    """The wire's cap on ``segment_bounds`` (checked before the list is copied); the rule itself
    (0, increasing, the pool's segment count) is the engine's, at the generator's first step."""
    if len(values) > MAX_BOUNDS:
        raise InvalidArgument("segment_bounds", f"at most {MAX_BOUNDS} bounds "
                                                f"({MAX_BOUNDS - 1} groups), got {len(values)}")
    return list(values)


class _Groups:
    """The engine's generator, stepped and closed under one lock: a close never races a step
    that is still copying (the generator is then finished by the worker that closes it)."""

    def __init__(self, groups: Iterator[int]) -> None:
        self._groups = groups
        self._lock = threading.Lock()

    def next(self) -> int | None:
        with self._lock:
            return next(self._groups, None)

    def close(self) -> None:
        with self._lock:
            close = getattr(self._groups, "close", None)
            if close is not None:
                close()


async def stream(engine: Any, executor: Executor, owned: Callable[[Any], PoolId],
                 req: pb.LoadLayersRequest, ctx: Any) -> AsyncIterator[pb.LoadLayersReply]:
    loop = asyncio.get_running_loop()

    def opened() -> _Groups:
        pool = owned(req)
        keys, slots = validate.keyed_slots(req.keys, req.slots)
        bounds = segment_bounds(req.segment_bounds)
        return _Groups(engine.load_layers(pool, keys, slots, bounds))

    groups: _Groups | None = None
    try:
        groups = await loop.run_in_executor(executor, opened)
        group = 0
        while (count := await loop.run_in_executor(executor, groups.next)) is not None:
            yield pb.LoadLayersReply(group=group, count=count)
            group += 1
    except Exception as exc:
        code, message = status_for(exc)
        if is_internal(exc):
            log.exception("internal error in LoadLayers")
        await ctx.abort(code, message)
        raise  # unreachable: abort raises
    finally:
        if groups is not None:  # also on cancel: the close is queued, never skipped
            try:
                executor.submit(groups.close)
            except RuntimeError:  # the executor is shut down (the daemon is stopping)
                groups.close()
