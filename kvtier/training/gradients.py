"""Gradient offload: each bucket's gradients go to a host buffer as soon as autograd has them.

``GradientOffloader(params, arena=..., bucket_mb=...)`` registers a post-accumulate-grad hook on
every parameter. When all parameters of a bucket have their gradient for this backward pass, the
gradients are copied to a pinned staging buffer (D2H stream, after an event on the compute stream),
the device gradients are freed (``p.grad = None``), and a worker thread adds the staged values into
the bucket's host gradient buffer (``accum_dtype``, default the parameter's dtype) once the copy's
event is done. The first gradient of a parameter since ``zero()`` whose dtype is the buffer's is
copied straight into the host buffer (no staging, no host-side copy). Several backward passes
therefore accumulate on the host, exactly like ``p.grad`` would; ``zero()`` forgets them.
``buckets`` (lists of parameters) may replace ``bucket_mb``. ``GradBucket.landed`` is the
completion of the bucket's latest device->host copy (ordered after the compute stream's work
when the bucket's last gradient arrived).
``wait()`` flushes partially complete buckets (parameters that got
no gradient stay absent) and waits for the worker; worker errors surface there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvtier.errors import DeadlineExceeded, InvalidArgument
from kvtier.training.base import MIB, BufferArena, default_arena, get_buffer, positive
from kvtier.training.buckets import FlatLayout, make_buckets
from kvtier.training.streams import StreamPair


class GradBucket:
    """Host gradients of one bucket: ``grads[i]`` is valid only where ``present[i]``."""

    def __init__(self, index: int, params: list[torch.Tensor], arena: BufferArena,
                 accum_dtype: torch.dtype | None) -> None:
        self.index = index
        self.params = params
        self.dtype = accum_dtype or params[0].dtype
        self.layout = FlatLayout.build([p.shape for p in params], [("grad", self.dtype)])
        self.stage_layout = FlatLayout.build([p.shape for p in params], [("g", params[0].dtype)])
        self.raw = get_buffer(arena, self.layout.nbytes)
        self.grads = self.layout.views(self.raw, "grad")
        self.present = [False] * len(params)  # written by the worker, after the copy landed
        self.claimed = [False] * len(params)  # written by the hook: a copy into grads[i] issued
        self.arrived: set[int] = set()
        self.landed: Any = None  # CopyDone of the latest device->host copy
        self.pending: list[Future[None]] = []


class GradientOffloader:
    """Moves gradients to host buffers bucket by bucket during backward (see module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], *, arena: BufferArena | None = None,
                 bucket_mb: float = 32, accum_dtype: torch.dtype | None = None,
                 on_ready: Callable[[GradBucket], None] | None = None,
                 executor: ThreadPoolExecutor | None = None, timeout_s: float = 600.0,
                 buckets: list[list[torch.Tensor]] | None = None) -> None:
        if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype)
                                            and accum_dtype.is_floating_point):
            raise InvalidArgument("accum_dtype", f"{accum_dtype!r}; accepted: a floating "
                                                 "point torch.dtype or None")
        for name, value in (("bucket_mb", bucket_mb), ("timeout_s", timeout_s)):
            if not positive(value):
                raise InvalidArgument(name, f"{value!r}; accepted: a finite number > 0")
        self.params = [p for p in params if p.requires_grad]
        self.arena = arena if arena is not None else default_arena()
        self.on_ready = on_ready
        self.timeout_s = timeout_s
        self.streams = StreamPair()
        groups = buckets if buckets is not None else make_buckets(self.params,
                                                                  int(bucket_mb * MIB))
        self.buckets: list[GradBucket] = []
        try:  # all or none: a shortfall gives back the buckets already taken
            for i, plist in enumerate(groups):
                self.buckets.append(GradBucket(i, plist, self.arena, accum_dtype))
        except BaseException:
            for gb in self.buckets:
                self.arena.put_buffer(gb.raw)
            raise
        self._own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="kvtier-grad")
        self._where: dict[int, tuple[GradBucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    # ---- backward side ---------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        bucket, i = self._where[id(p)]
        bucket.arrived.add(i)
        if len(bucket.arrived) == len(bucket.params):
            self._flush(bucket)

    def _flush(self, b: GradBucket) -> None:
        """Copy the arrived gradients of ``b`` to host, free them on the device, accumulate."""
        idx = sorted(i for i in b.arrived if b.params[i].grad is not None)
        b.arrived.clear()
        if not idx:
            return
        # a first gradient of the buffer's own dtype lands in place; the rest is staged
        direct = [i for i in idx if not b.claimed[i]] if b.dtype == b.params[0].dtype else []
        staged = [i for i in idx if i not in direct]
        raw = get_buffer(self.arena, b.stage_layout.nbytes) if staged else None
        stage = b.stage_layout.views(raw, "g") if raw is not None else []
        dsts = [b.grads[i] if i in direct else stage[i] for i in idx]
        srcs = [b.params[i].grad for i in idx]
        event = self.streams.copy_many("d2h", dsts, [g for g in srcs if g is not None])
        b.landed = event
        for i in idx:
            b.claimed[i] = True
            b.params[i].grad = None
        b.pending.append(self.executor.submit(self._accumulate, b, raw, stage, staged, direct,
                                              event))
        if self.on_ready is not None:
            self.on_ready(b)

    def _accumulate(self, b: GradBucket, raw: torch.Tensor | None, stage: list[torch.Tensor],
                    staged: list[int], direct: list[int], event: Any) -> None:
        try:
            StreamPair.synchronize(event)
            for i in direct:
                b.present[i] = True
            for i in staged:
                if b.present[i]:
                    b.grads[i].add_(stage[i])
                else:
                    b.grads[i].copy_(stage[i])
                    b.present[i] = True
        finally:
            if raw is not None:
                self.arena.put_buffer(raw)

    # ---- caller side -----------------------------------------------------------------------
    def flush(self) -> None:
        """Stage buckets that got only some of their gradients (unused parameters)."""
        for b in self.buckets:
            if b.arrived:
                self._flush(b)

    def wait(self) -> None:
        """Flush, then wait until every host gradient is up to date (worker errors raise here)."""
        self.flush()
        for b in self.buckets:
            self.wait_bucket(b)

    def wait_bucket(self, b: GradBucket) -> None:
        pending, b.pending = b.pending, []
        for f in pending:
            try:
                f.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise DeadlineExceeded(f"gradient bucket {b.index} not ready after "
                                       f"{self.timeout_s}s") from None

    def zero(self) -> None:
        """Forget accumulated gradients (the buffers stay allocated)."""
        self.wait()
        for b in self.buckets:
            b.present = [False] * len(b.params)
            b.claimed = [False] * len(b.params)

    def host_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The host gradient of ``p`` (call ``wait()`` first), or None if it got none."""
        b, i = self._where[id(p)]
        return b.grads[i] if b.present[i] else None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the host gradients in place; the same arithmetic (and parameter order) as
        ``torch.nn.utils.clip_grad_norm_`` on the device gradients. Returns the total norm."""
        self.wait()
        grads = [g for g in (self.host_grad(p) for p in self.params) if g is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own arithmetic
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    def close(self) -> None:
        """Remove the hooks, return the buffers to the arena, stop an owned worker."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.flush()
        for b in self.buckets:
            self.wait_bucket(b)
            self.arena.put_buffer(b.raw)
        self.buckets.clear()
        if self._own_executor:
            self.executor.shutdown(wait=True)
