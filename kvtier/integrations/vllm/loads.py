"""One step's loads, overlapped with the forward: each layer is waited for on its own.

``LoadJob(mover, transfers, layers)``; ``run()`` on a thread of its own, then from the engine's
thread ``wait_layer(i)`` and ``result()``:

- ``layers[i]``: the ``BlockRows`` segments of layer ``i`` (forward order).
- Staging mode: the daemon fills staging slots with whole pages (as many blocks of the step's
  transfers as the staging pool holds: a round), then the job copies them into vLLM's tensors
  layer by layer, in forward order. ``wait_layer(i)`` returns once layer ``i``'s copies of the
  last round are done (on CUDA: issued on the job's stream; the caller's stream then waits for
  their event, not the host) — never waiting for a later layer's copy.
- Registered mode: the daemon writes straight into vLLM's memory, one layer at a time
  (``LoadLayers``, bounds at the layer boundaries: ``groups.layer_groups``). Every transfer's
  stream is opened at once (the daemon copies them side by side); the job then reads group
  ``g``'s reply of each transfer in turn and marks the layers of group ``g`` ready once every
  transfer has passed it. A reply comes after the daemon has waited for its copies, so no CUDA
  event is needed. A transfer's result is the last count its stream gave; a stream broken or
  ended before its last group confirms no block of it.
- ``result() -> list[int]``: per transfer, its leading blocks that now hold exactly the stored
  bytes (the rest must be recomputed); waits for the job. A daemon error ends the job: blocks
  not yet loaded count as failed and the error is in ``error`` (the caller re-attaches).
- A transfer stops at its first block that did not load; its later blocks are never written.

``before_layer(i)`` (tests) is called on the job's thread before layer ``i``'s copies (registered
mode: before the job reads the replies of the group holding layer ``i``, for its first layer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvtier.client.block_mover import BlockMover, BlockTransfer, Staged

from .groups import layer_groups

_Piece = tuple[int, int, int]  # (transfer index, first block, end block)


def rounds(transfers: Sequence[BlockTransfer], cap: int) -> list[list[_Piece]]:
    """Pieces of at most ``cap`` blocks, packed in order into rounds of at most ``cap``."""
    out: list[list[_Piece]] = [[]]
    room = cap
    for ti, t in enumerate(transfers):
        start = 0
        while start < len(t.keys):
            if room == 0:
                out.append([])
                room = cap
            end = min(len(t.keys), start + room)
            out[-1].append((ti, start, end))
            room -= end - start
            start = end
    return [r for r in out if r]


class LoadJob:
    def __init__(self, mover: BlockMover, transfers: Sequence[BlockTransfer],
                 layers: Sequence[range], *,
                 before_layer: Callable[[int], None] | None = None, groups: int = 1) -> None:
        self.mover, self.transfers, self.layers = mover, list(transfers), list(layers)
        self.groups = groups  # registered: at most this many layer groups (``layer_groups``)
        self.got = [0] * len(self.transfers)
        self.error: BaseException | None = None
        self._before = before_layer
        self._ready = [threading.Event() for _ in self.layers]
        self._events: list[Any] = [None] * len(self.layers)
        self._finished = threading.Event()
        dev = mover.rows.segments[0].device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def run(self) -> None:
        try:
            # vLLM's KV tensors are inference tensors: written in place only in inference mode,
            # which is per thread (the engine's thread has it, this one must enter it)
            with torch.inference_mode():
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._run()
                else:
                    self._run()
        except BaseException as exc:
            self.error = exc
        finally:
            for ev in self._ready:
                ev.set()
            self._finished.set()

    def _run(self) -> None:
        c = self.mover.counters
        try:
            if self.mover.registered:
                self._groups()
                return
            stopped: set[int] = set()
            plan = rounds(self.transfers, self.mover.staging_slots)
            for r, pieces in enumerate(plan):
                self._round(pieces, stopped, last=r == len(plan) - 1)
        finally:
            c.load_calls += len(self.transfers)
            c.loaded_blocks += sum(self.got)
            c.load_failed_blocks += sum(len(t.keys) for t in self.transfers) - sum(self.got)

    def _groups(self) -> None:
        """Registered mode: every transfer layer by layer, side by side (module docstring)."""
        bounds, group_of = layer_groups(self.layers, len(self.mover.rows.segments), self.groups)
        first = {g: li for li, g in reversed(list(enumerate(group_of)))}
        streams: list[Iterator[int]] = []
        try:
            for t in self.transfers:  # the daemon refuses an empty load: nothing to ask
                streams.append(self.mover.load_groups(t, bounds) if t.keys
                               else iter([0] * (len(bounds) - 1)))
            last = [0] * len(streams)
            ended: set[int] = set()
            for g in range(len(bounds) - 1):
                if self._before is not None and g in first:
                    self._before(first[g])
                for ti, stream in enumerate(streams):
                    n = None if ti in ended else next(stream, None)
                    if n is None:  # ended early: none of its blocks is confirmed
                        ended.add(ti)
                    last[ti] = 0 if n is None else n
                for li, lg in enumerate(group_of):
                    if lg == g:
                        self._ready[li].set()
            self.got = last
        finally:
            for stream in streams:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()

    def _round(self, pieces: list[_Piece], stopped: set[int], *, last: bool) -> None:
        staged: list[tuple[_Piece, Staged]] = []
        try:
            for piece in pieces:
                ti, start, end = piece
                if ti in stopped:
                    continue
                s = self.mover.stage(self.transfers[ti].keys[start:end])
                staged.append((piece, s))
                if s.got < end - start:
                    stopped.add(ti)
            for li, segs in enumerate(self.layers):
                if self._before is not None and last:
                    self._before(li)
                for (ti, start, _), s in staged:
                    if s.rows is not None:
                        blocks = self.transfers[ti].block_ids[start : start + s.got]
                        self.mover.rows.scatter(blocks, s.rows, segs)
                if last:
                    self._mark(li)
            if self._stream is not None:
                self._stream.synchronize()  # the staging slots are reused after this
            # Counted once every layer of the round is copied in: a daemon that failed while
            # a later piece was staged (or a copy that raised) left these blocks unwritten, and
            # counting them at staging time reported them loaded (wrong tokens).
            for (ti, _, _), s in staged:
                self.got[ti] += s.got
        finally:
            for _, s in staged:
                self.mover.unstage(s)

    def _mark(self, li: int) -> None:
        if self._stream is not None:
            ev = torch.cuda.Event()
            ev.record(self._stream)
            self._events[li] = ev
        self._ready[li].set()

    def wait_layer(self, li: int) -> None:
        self._ready[li].wait()
        ev = self._events[li]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)  # the device waits, not the host

    def result(self) -> list[int]:
        self._finished.wait()
        return list(self.got)
