"""``LoadLayers``: the engine's layer-group load (``engine.load_layers``) as a reply stream.

Contract:
    * ``segment_bounds(values)``: at most ``MAX_BOUNDS`` values, else
      InvalidArgument("segment_bounds"); the rest of the rule (0 = b0 < ... = the pool's
      segment count) is the engine's, raised at the generator's first step before anything is
      copied, so a refused call changes nothing and the daemon and the engine say the same.
    * ``stream(engine, executor, owned, req, ctx, caller)``: on a worker thread, checks the pool
      (``owned``: the tenancy rule every pool call follows), keys and slots (as Load), then
      runs the engine's generator there group after group, and yields one ``LoadLayersReply``
      per group, sent only after the engine has waited for that group's copies. The load never
      waits for the client to read: a slow or stalled reader holds nothing protected once the
      copies are done. A stream that ends early (an error, the client cancelling, the daemon
      draining) stops the load after the group being copied, and ``caller``
      (``kvtier/caller.py``, also gone at the call's deadline) launches no copy of it that has
      not started; the generator is always closed on the worker, which releases what the load
      protected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

from kvtier.caller import Caller
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


class _Run:
    """One load on a worker thread: every group pulled back to back (no hop through the event
    loop between groups), each count handed to the loop as it lands. ``stop()`` ends it after
    the group being copied; the generator is closed on the worker whatever happens."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.out: asyncio.Queue[int | Exception | None] = asyncio.Queue()
        self._stop = threading.Event()

    def _put(self, item: int | Exception | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self.out.put_nowait, item)

    def run(self, open_groups: Callable[[], Iterator[int]]) -> None:
        end: Exception | None = RuntimeError("the load stopped unexpectedly")
        try:
            groups = open_groups()
            try:
                for count in groups:
                    self._put(count)
                    if self._stop.is_set():
                        break
            finally:
                close = getattr(groups, "close", None)
                if close is not None:
                    close()
            end = None
        except Exception as exc:
            end = exc
        finally:  # the stream always gets its last item, so it never waits forever
            self._put(end)

    def stop(self) -> None:
        self._stop.set()


async def stream(engine: Any, executor: Executor, owned: Callable[[Any], PoolId],
                 req: pb.LoadLayersRequest, ctx: Any, caller: Caller
                 ) -> AsyncIterator[pb.LoadLayersReply]:
    def open_groups() -> Iterator[int]:
        pool = owned(req)
        keys, slots = validate.keyed_slots(req.keys, req.slots)
        groups: Iterator[int] = engine.load_layers(pool, keys, slots,
                                                   segment_bounds(req.segment_bounds), caller)
        return groups

    run = _Run(asyncio.get_running_loop())
    try:
        executor.submit(run.run, open_groups)
        group = 0
        while (item := await run.out.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield pb.LoadLayersReply(group=group, count=item)
            group += 1
    except Exception as exc:
        code, message = status_for(exc)
        if is_internal(exc):
            log.exception("internal error in LoadLayers")
        await ctx.abort(code, message)
        raise  # unreachable: abort raises
    finally:
        run.stop()  # also on cancel: the worker ends after the group being copied
        caller.give_up()  # and launches no copy of it that has not started
