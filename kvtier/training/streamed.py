"""``gpu_stream`` mode's mechanism: bucket states staged through two device slots, stepped on
the device, written back to their host (or disk) home.

``DeviceStepper(buckets, states, streams, hyper)``:
    * ``stage(k)`` starts loading bucket ``k``'s blob into a free slot (H2D stream, after the
      slot's previous write-back and after bucket ``k``'s own previous write-back, not after
      the compute stream's queued work); False when no slot is free. A bucket already staged
      or stepped this step is left alone.
    * ``step_bucket(k)`` makes the compute stream wait for bucket ``k``'s blob, enqueues its step
      (the bucket's gradients are consumed and freed), starts the write-back (D2H stream) and
      stages bucket ``k + 1`` into the slot that frees up. Nothing blocks the host except the
      disk tier (its host slot is reused two buckets later). False when it could not be staged.
    * Called from post-accumulate-grad hooks during backward (``step_in_backward``) or from
      ``finish()`` (every bucket not stepped yet, those already staged first); ``finish()`` also
      drops the device slots, so they hold memory only while a step is in progress.
    * ``done`` holds the buckets stepped since the last ``finish()``; ``out[k]`` is bucket
      ``k``'s latest write-back (host memory reused only after it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.training.stepping import OptBucket, hyper_of
from kvtier.training.streams import CopyDone, StreamPair

SLOTS = 2


class DeviceStepper:
    """See the module docstring."""

    def __init__(self, buckets: list[OptBucket], states: Any, streams: StreamPair,
                 hyper: Callable[[OptBucket], dict[str, Any]]) -> None:
        self.buckets, self.states, self.streams, self.hyper = buckets, states, streams, hyper
        self.out: list[CopyDone | None] = [None] * len(buckets)
        self.done: set[int] = set()
        self._slots: list[torch.Tensor] = []
        self._free: list[int] = []
        self._slot_after: list[CopyDone | None] = []
        self._staged: dict[int, tuple[int, torch.Tensor, CopyDone | None]] = {}

    def _ensure_slots(self) -> None:
        if self._slots or not self.buckets:
            return
        device = self.buckets[0].params[0].device
        size = max(b.layout.nbytes for b in self.buckets)
        self._slots = [torch.empty(size, dtype=torch.uint8, device=device)
                       for _ in range(SLOTS)]
        self._free = list(range(SLOTS))
        # fresh memory may still be read by compute work queued before it was given out
        self._slot_after = [StreamPair.mark(device)] * SLOTS

    def stage(self, k: int) -> bool:
        if k >= len(self.buckets) or k in self._staged or k in self.done:
            return True
        self._ensure_slots()
        if not self._free:
            return False
        s = self._free.pop(0)
        self.states.prefetch(k)
        blob = self.states.acquire(k)
        n = self.buckets[k].layout.nbytes
        # a load waits for the slot's last write-back and the bucket's own, never for the
        # compute stream: the hooks run far ahead of the backward the device is executing
        ready = self.streams.copy_many("h2d", [self._slots[s][:n]], [blob],
                                       after=[self._slot_after[s], self.out[k]],
                                       after_compute=False)
        self._staged[k] = (s, blob, ready)
        return True

    def step_bucket(self, k: int) -> bool:
        if not self.stage(k):
            return False
        s, blob, ready = self._staged.pop(k)
        StreamPair.wait_on_compute(ready)
        b = self.buckets[k]
        out = self._step(b, self._slots[s][: b.layout.nbytes], blob)
        self.out[k], self._slot_after[s] = out, out
        self._free.append(s)
        self.done.add(k)
        if self.states.on_disk:
            StreamPair.synchronize(out)
            self.states.release(k, dirty=True)
        self.stage(k + 1)
        return True

    @torch.no_grad()
    def _step(self, b: OptBucket, dev: torch.Tensor, blob: torch.Tensor) -> CopyDone | None:
        """Step bucket ``b`` staged in ``dev``; start writing it back to ``blob``."""
        views = b.views(dev)
        # the states are staged contiguous and a fused kernel steps a parameter, its gradient
        # and its states as if their strides were the same: a strided parameter (a transposed
        # weight, a slice) steps on a contiguous copy that is then copied back
        targets = views["master"] if b.has_master else [p.contiguous() for p in b.params]
        mdt = b.master_dtype
        grads = [None if p.grad is None else (p.grad.to(mdt) if mdt else p.grad).contiguous()
                 for p in b.params]
        b.used = hyper_of(self.hyper(b))
        b.run(targets, grads, views, self.hyper(b))
        for p in b.params:
            p.grad = None  # consumed: the device memory goes back before backward ends
        for p, t in zip(b.params, targets, strict=True):
            if t is not p:
                p.copy_(t)
        return self.streams.copy_many("d2h", [blob], [dev])

    def finish(self) -> None:
        """Step every bucket not stepped yet (staged ones first: each step frees the slot the
        next one needs), then drop the device slots."""
        while len(self.done) < len(self.buckets):
            k = next(iter(self._staged), None)
            if k is None:
                k = min(set(range(len(self.buckets))) - self.done)
            stepped = self.step_bucket(k)
            assert stepped, "with nothing staged every slot is free"
        self.done.clear()
        self._slots, self._free, self._slot_after = [], [], []
        self.states.flush()
