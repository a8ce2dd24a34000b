"""The saved-tensor offload mechanism behind ``activations.py``: what a saved tensor becomes, when
its device memory goes, when it comes back.

Contract of :class:`ActivationOffloader`:
    * ``pack`` copies an offloadable tensor's bytes to an arena buffer when it is saved (CUDA: on
      the copy stream, ordered after the compute stream; CPU: synchronously). The unit is a byte
      range of the tensor's storage: its own bytes when it is contiguous, else the whole storage
      when that is at most ``MAX_SPAN_RATIO`` times its own bytes (so the q/k/v views of one qkv
      output, or an attention output and its transposed view, share one copy in one layer).
    * The device copy is dropped as soon as the host sees the copy done (an event query at every
      save and layer boundary; the compute stream never waits for an offload copy, and freeing a
      saved tensor never blocks the host). While copies are in flight the host is held at most
      ``pace_lag`` saves or boundaries ahead of the compute stream (it waits on an event recorded
      there): the caching allocator hands memory out in host order, so a host running a layer
      ahead would allocate that layer before the copies that free memory for it are seen done.
    * ``max_inflight_groups=k`` (default 1, as TransformerEngine) puts memory first: at a boundary
      the host also waits for the copies of all but the last ``k`` groups (their memory is then
      free for the next layer), so the forward runs no faster than the copies. ``None`` never
      waits for a copy: fastest, and the right choice when only as many layers are offloaded as
      the forward can hide (copies still running at the end of forward stay in the peak).
    * ``drain_before_group=n``: at the boundary entering group ``n`` the compute stream (not the
      host) waits for every copy in flight and their device copies are dropped at once: memory
      first at one chosen point (before the peak), with no host wait and no later in-place
      write able to race a copy. ``reload_ahead``: how many groups below the one whose backward
      is next are reloaded (default 1).
    * Host buffers go back to the arena once their copies are seen done; until then the offloader
      keeps them and reuses one for a copy of the same size, ordered after them on the device.
    * A reload allocates on the compute stream, fills on the reload stream, and the compute stream
      waits on it before use (or before the buffer is freed unused). A tensor whose device copy is
      still held when backward asks for it is used as is, without a reload.
    * In-place writes: a device copy written in place before its offload copy was seen done makes
      its unpack raise :class:`OffloadRaceError`; kept tensors get autograd's version check.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvtier.errors import InvalidArgument
from kvtier.training.base import BufferArena, OffloadRaceError, default_arena, get_buffer
from kvtier.training.records import (
    NO_OFFLOAD_ATTR,
    Kept,
    OffloadStats,
    Ref,
    Saved,
    byte_view,
    span_of,
)
from kvtier.training.streams import CopyDone, StreamPair

DEFAULT_MIN_NUMEL = 256 * 1024
DEFAULT_PACE_LAG = 3  # saves or boundaries: enough queued work to keep the device busy
DEFAULT_MAX_INFLIGHT_GROUPS = 1

Groups = dict[int, list[Saved]]


class ActivationOffloader:
    """Mechanism shared by the context and the module hooks: pack/unpack and layer boundaries."""

    def __init__(self, *, arena: BufferArena | None, should_offload: Callable[[int], bool],
                 group_count: int, min_numel: int = DEFAULT_MIN_NUMEL, manual: bool = False,
                 offload_stream: Any = None, streams: Any = None,
                 pace_lag: int = DEFAULT_PACE_LAG,
                 max_inflight_groups: int | None = DEFAULT_MAX_INFLIGHT_GROUPS,
                 drain_before_group: int | None = None, reload_ahead: int = 1) -> None:
        if min_numel < 0:
            raise InvalidArgument("min_numel", f"must be >= 0, got {min_numel}")
        if pace_lag < 1:
            raise InvalidArgument("pace_lag", f"must be >= 1, got {pace_lag}")
        if max_inflight_groups is not None and max_inflight_groups < 1:
            raise InvalidArgument("max_inflight_groups",
                                  f"must be >= 1 or None, got {max_inflight_groups}")
        if reload_ahead < 1:
            raise InvalidArgument("reload_ahead", f"must be >= 1, got {reload_ahead}")
        if drain_before_group is not None and not (
                isinstance(drain_before_group, int) and 0 <= drain_before_group < group_count):
            raise InvalidArgument("drain_before_group", f"must be a layer in [0, {group_count}) "
                                  f"or None, got {drain_before_group!r}")
        self.pace_lag = pace_lag
        self.drain_before_group = drain_before_group
        self.reload_ahead = reload_ahead
        self.max_inflight_groups = max_inflight_groups
        self.epoch = 0  # boundaries passed (never wraps)
        self.arena = arena if arena is not None else default_arena()
        self.should_offload = should_offload
        self.group_count = group_count
        self.min_numel = min_numel
        self.manual = manual
        self.streams = streams if streams is not None else StreamPair(d2h=offload_stream)
        self.stats = OffloadStats()
        self.group = 0
        self.groups: Groups = {}
        self._dedup: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], Saved]] = {}
        self._inflight: deque[Saved] = deque()  # copies started, device copy still held
        # host buffers whose last copies may still run, by size, oldest first
        self._cooling: dict[int, deque[tuple[torch.Tensor, list[CopyDone | None]]]] = {}
        self._marks: deque[CopyDone] = deque()  # compute-stream events at recent boundaries

    # ---- saved-tensor hooks ----------------------------------------------------------------
    def eligible(self, t: torch.Tensor) -> bool:
        return (
            t.is_floating_point()
            and t.layout == torch.strided
            and t.numel() >= max(self.min_numel, 1)
            and not isinstance(t, torch.nn.Parameter)
            # a view of a parameter (``weight.t()``, saved by every linear layer) frees nothing
            and not isinstance(t._base, torch.nn.Parameter)
            and not getattr(t, NO_OFFLOAD_ATTR, False)
            and t.device.type in ("cuda", "cpu")
        )

    def pack(self, t: torch.Tensor) -> Any:
        span = span_of(t) if self.should_offload(self.group) and self.eligible(t) else None
        if span is None:
            self.stats.kept_tensors += 1
            self.stats.kept_bytes += t.numel() * t.element_size()
            return Kept(t)
        key = (t.untyped_storage().data_ptr(), *span, t._version)
        hit = self._dedup.get(key)
        # the address names the same storage while we or the first saver still hold it; a record
        # whose refs are all gone has given its buffers back
        if hit is not None and hit[1].refs > 0 and (hit[1].views is not None
                                                    or hit[0]() is not None):
            self.stats.deduplicated += 1
            return Ref(hit[1], t, span[0])
        rec = Saved(t, span, self, self.epoch)
        self._dedup[key] = (weakref.ref(t), rec)
        self.groups.setdefault(self.group, []).append(rec)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += rec.nbytes
        ref = Ref(rec, t, span[0])
        if not self.manual:
            rec.releasable = True
            self._copy_out(rec)
        self._reap()
        self._pace()
        return ref

    def unpack(self, ref: Any) -> torch.Tensor:
        if isinstance(ref, Kept):
            return ref.get()
        rec: Saved = ref.rec
        if rec.raced:
            raise OffloadRaceError(
                "a saved tensor was modified in place before its offload copy was known to be done;"
                " mark_not_offload() it or clone it before the in-place op")
        if rec.views is not None:
            return ref.from_held()
        self._reload(rec)
        assert rec.dev is not None
        self.streams.wait_on_compute(rec.reload_done)
        return ref.rebuild(rec.dev)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ---- copies ----------------------------------------------------------------------------
    def _copy_out(self, rec: Saved) -> None:
        """Start the device->host copy of ``rec`` (ordered after the kernels that made it)."""
        assert rec.views is not None and rec.raw is None
        rec.raw, after = self._take_buffer(rec.nbytes)
        rec.copy_done = self.streams.copy_many("d2h", [rec.raw], [byte_view(rec)], after,
                                               record=False)
        if rec.copy_done is None:  # not a CUDA tensor: copied synchronously
            self._drop_views(rec)
        else:
            rec.inflight = True
            self._inflight.append(rec)

    def _drop_views(self, rec: Saved) -> None:
        if rec.views is not None and rec.changed():
            rec.raced = True
        rec.views = None

    def _release(self, rec: Saved) -> None:
        """Let ``rec``'s device copy go once its host copy is seen done."""
        rec.releasable = True
        if rec.views is None:
            return
        if rec.raw is None:
            self._copy_out(rec)
        elif not rec.inflight and not rec.keep:
            self._drop_views(rec)

    def _reap(self) -> None:
        """Drop device copies whose offload copy is done (one copy stream: done in order)."""
        q = self._inflight
        while q and (q[0].copy_done is None or q[0].copy_done.query()):
            rec = q.popleft()
            rec.inflight = False
            if rec.releasable and not rec.keep:
                self._drop_views(rec)
                self.stats.released_bytes += rec.nbytes

    def _pace(self) -> None:
        """While copies are in flight, keep the host within ``pace_lag`` marks of the device."""
        if not self._inflight:
            self._marks.clear()
            return
        mark = self.streams.mark(self._inflight[0].device)
        if mark is None:
            return
        self._marks.append(mark)
        while len(self._marks) > self.pace_lag:
            done = self._marks.popleft()
            if not done.query():
                self.stats.host_waits += 1
                done.synchronize()

    def _bound_inflight(self) -> None:
        """Wait for the copies of all but the last ``max_inflight_groups`` groups."""
        k = self.max_inflight_groups
        while k is not None and self._inflight and self._inflight[0].epoch <= self.epoch - k:
            done = self._inflight[0].copy_done
            if done is not None and not done.query():
                self.stats.copy_waits += 1
                done.synchronize()
            self._reap()

    def _drain_on_device(self) -> None:
        """The compute stream waits for every copy in flight; their device copies go now."""
        q = self._inflight
        if not q:
            return
        self.streams.wait_on_compute(q[-1].copy_done)  # one copy stream: the last covers all
        self.stats.device_waits += 1
        while q:
            rec = q.popleft()
            rec.inflight = False
            if rec.releasable and not rec.keep:
                self._drop_views(rec)
                self.stats.released_bytes += rec.nbytes

    def _take_buffer(self, nbytes: int) -> tuple[torch.Tensor, list[CopyDone | None]]:
        """A host buffer: a cooling one of that size (the copy is ordered after its last use
        on the device), else one from the arena."""
        same = self._cooling.get(nbytes)
        if same:
            return same.popleft()
        return get_buffer(self.arena, nbytes), []

    def _recycle_done(self) -> None:
        """Give buffers whose copies are done back to the arena (oldest first, per size)."""
        for q in self._cooling.values():
            while q and all(d is None or d.query() for d in q[0][1]):
                self.arena.put_buffer(q.popleft()[0])

    def _cool(self, buf: torch.Tensor, dones: list[CopyDone | None]) -> None:
        if all(d is None or d.query() for d in dones):
            self.arena.put_buffer(buf)
        else:
            self._cooling.setdefault(buf.numel(), deque()).append((buf, dones))

    def _reload(self, rec: Saved) -> None:
        if rec.dev is not None or rec.views is not None or rec.raw is None:
            return
        rec.dev = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)
        rec.reload_done = self.streams.copy_many("h2d", [rec.dev], [rec.raw],
                                                 after=rec.copy_done, record=False)
        self.stats.reloaded_bytes += rec.nbytes

    def unref(self, rec: Saved) -> None:
        rec.refs -= 1
        if rec.refs > 0:
            return
        if rec.dev is not None:  # freed maybe unused: the compute stream must not reuse it early
            self.streams.wait_on_compute(rec.reload_done)
        if rec.raw is not None:
            self._cool(rec.raw, [rec.copy_done, rec.reload_done])
        rec.raw = rec.dev = None
        rec.keep, rec.releasable = False, True
        if not rec.inflight:
            rec.views = None

    def flush(self) -> None:
        """Wait for every copy in flight, drop what they held, return idle host buffers."""
        for rec in self._inflight:
            if rec.copy_done is not None:
                rec.copy_done.synchronize()
        self._reap()
        for q in self._cooling.values():
            for _, dones in q:
                self.streams.synchronize(*dones)
        self._recycle_done()

    # ---- layer boundaries ------------------------------------------------------------------
    def commit_forward(self) -> tuple[Groups, int]:
        """End the current group and advance (the host is paced while copies are in flight)."""
        groups, g = self.groups, self.group
        self._pace()
        self._reap()
        self._bound_inflight()
        self._recycle_done()
        self._dedup.clear()
        self.epoch += 1
        self.group += 1
        if self.group >= self.group_count:
            self.group = 0
            self.groups = {}
        if self.group == self.drain_before_group:
            self._drain_on_device()
        return groups, g

    def commit_backward(self, groups: Groups, g: int) -> None:
        """Group ``g``'s backward is next: make sure it is reloading and prefetch ``g - 1``."""
        self._pace()
        self._reap()
        self._recycle_done()
        prev = [r for k in range(1, self.reload_ahead + 1) for r in groups.get(g - k, ())]
        if prev:
            self.stats.prefetches += 1
        for rec in (*groups.get(g, ()), *prev):
            if rec.views is not None:
                rec.keep = True  # backward uses the device copy still held: no reload
            else:
                self._reload(rec)

    def start_offload(self, groups: Groups, g: int) -> None:
        for rec in groups.get(g, ()):
            if rec.views is not None and rec.raw is None:
                self._copy_out(rec)

    def release(self, groups: Groups, g: int) -> None:
        for rec in groups.get(g, ()):
            self._release(rec)
        self._reap()
