"""``OffloadedOptimizer``: any ``torch.optim`` class with master weights and states off the GPU.

    opt = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, mode="cpu", lr=1e-3)
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Contract:
    * ``mode="cpu"``: gradients leave the device bucket by bucket during backward (see
      ``gradients.py``; they accumulate on the host across backward passes), the step runs on the
      CPU in a worker thread (``fused=True`` when the class supports it), and each bucket's
      updated weights are copied back (cast to the working dtype on the CPU, then one H2D copy)
      by the worker as soon as that bucket has stepped, ordered after the bucket's own gradient
      copy only. ``step()`` consumes the host gradients and makes the compute stream wait for
      each bucket's weight copy (the host waits only for steps not yet done).
      ``step_in_backward=True`` (default): a bucket's step starts as soon as its gradients have
      landed, during the backward, unless inside ``no_sync()`` (use it for every micro-batch of
      an accumulation but the last; a bucket that gets gradients again after its step started
      raises :class:`FailedPrecondition` — or, when that bucket's new weights were written
      while the next forward held the old ones, autograd's own in-place error comes first;
      either way that backward fails); clipping then needs ``step_in_backward=False``.
      Steps in backward assume that no backward work queued after a parameter's gradient is
      complete reads that parameter (true of autograd's own nodes, which read a weight in the
      node that produces its gradient; not of a use through ``.detach()``).
      A step taken in backward is final, as with ``torch.optim`` steps run in
      post-accumulate-grad hooks (nothing is kept to undo it: no second copy of the states,
      no copy on the hot path): ``zero_grad()`` after it without ``step()`` (a skipped step)
      raises :class:`FailedPrecondition`, and so does ``step()`` when the group's
      hyper-parameters (``lr``, ...) changed after the bucket stepped (it used those current
      at its step), both changing nothing; skip steps (e.g. on a non-finite loss) or change
      hyper-parameters between backward and ``step()`` only with ``step_in_backward=False``.
      ``state_dict()`` before ``step()`` gives the current state, those steps included;
      ``load_state_dict()`` replaces it and ``step()`` then steps only the buckets not
      stepped yet (the round's gradients are applied once). A ``step()`` that raised
      :class:`DeadlineExceeded` stays in flight and owned: calling ``step()`` again finishes
      it (the gradients are applied once); ``zero_grad()`` waits for it and keeps it.
    * ``mode="gpu_stream"``: gradients stay on the device; states (and fp32 master weights when
      the working dtype is not fp32 and ``master_weights``) live on the host and are streamed
      through two device staging buffers (``streamed.py``): bucket ``i + 1`` is loaded while
      bucket ``i`` steps and bucket ``i - 1`` is written back. With ``step_in_backward`` (not
      for the disk tier) a bucket steps on the compute stream as soon as autograd has
      accumulated its gradients (``arrivals.py``), which are then freed; ``no_sync()``,
      skipped steps, changed hyper-parameters and checkpoints between backward and
      ``step()`` as in cpu mode.
      Parameters of any strides (transposed, sliced) step exactly: each bucket steps on
      contiguous tensors (the host copies in cpu mode, a contiguous copy in gpu_stream mode).
    * ``state_tier="disk"``: the per-bucket blobs live in a ``DiskStore`` (``disk_path``) and are
      read one bucket ahead of use; the directory is locked for this optimizer until
      ``close()`` (``diskhome.py``: a second user is refused).
    * Construction checks its arguments first (``options.py``: ``InvalidArgument`` naming the
      argument; classes that create their state when constructed, as ``Adagrad``, are
      refused) and gives back everything it took when it fails. Param groups carry the
      wrapped class's defaults (``lr`` ...), as ``torch.optim``'s.
    * ``master_weights`` (cpu mode: the host copy is fp32 when True, the working dtype when
      False). Working weights are rewritten from the master after every step and on load.
    * ``state_dict()``/``load_state_dict()`` carry master weights, states and hyper-parameters,
      keyed by parameter position as in ``torch.optim``; resume continues bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

import torch

from kvtier.errors import DeadlineExceeded, FailedPrecondition
from kvtier.training.arrivals import GradArrivals
from kvtier.training.base import MIB, BufferArena, default_arena, get_buffer
from kvtier.training.buckets import FlatLayout, make_buckets
from kvtier.training.checkpoint import check_state_dict, load_state, saved_state
from kvtier.training.diskhome import DiskHome, open_disk
from kvtier.training.gradients import GradBucket, GradientOffloader
from kvtier.training.options import check_options, class_defaults
from kvtier.training.states import StateStore
from kvtier.training.stepping import OptBucket, hyper_of, same_hyper, state_keys, with_fused
from kvtier.training.streamed import DeviceStepper
from kvtier.training.streams import StreamPair


class OffloadedOptimizer(torch.optim.Optimizer):
    """See the module docstring for the contract."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer]
                 = torch.optim.AdamW, *, mode: str = "cpu", master_weights: bool = True,
                 state_tier: str = "cpu", arena: BufferArena | None = None,
                 disk_path: str | None = None, disk_store: Any = None, bucket_mb: float = 64,
                 step_in_backward: bool = True, timeout_s: float = 600.0,
                 **optim_kwargs: Any) -> None:
        check_options(mode=mode, state_tier=state_tier, disk_path=disk_path,
                      disk_store=disk_store, timeout_s=timeout_s, bucket_mb=bucket_mb)
        self._closed = False
        self._kwargs = with_fused(optimizer_class, optim_kwargs)
        # every group carries the class's hyper-parameters, as torch.optim's (schedulers read lr)
        super().__init__(params, class_defaults(optimizer_class, self._kwargs))
        self.mode, self.master_weights, self.timeout_s = mode, master_weights, timeout_s
        self.step_in_backward = step_in_backward and (mode == "cpu" or state_tier == "cpu")
        self.arena = arena if arena is not None else default_arena()
        self.streams = StreamPair()
        self._no_sync = False
        self.buckets = self._make_buckets(optimizer_class, int(bucket_mb * MIB))
        self._home: DiskHome | None = None
        self._cast: list[torch.Tensor | None] = []
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-opt")
        self.grads: GradientOffloader | None = None
        self._arrivals: GradArrivals | None = None
        try:  # a failed construction gives back all it took (buffers, disk, lock, threads)
            self._build(disk_path, disk_store)
        except BaseException:
            self._release()
            raise

    def _build(self, disk_path: str | None, disk_store: Any) -> None:
        if disk_path is not None and disk_store is None:
            need = sum(2 * b.layout.nbytes + (8 << 20) for b in self.buckets)
            self._home = open_disk(disk_path, need)
        self._disk = disk = self._home.store if self._home is not None else disk_store
        self.states = StateStore([b.layout.nbytes for b in self.buckets], self.arena, disk)
        for b in self.buckets:
            self._cast.append(self._cast_buffer(b))
        self._init_masters()
        if self.mode == "cpu":
            self.grads = GradientOffloader(
                [p for g in self.param_groups for p in g["params"] if p.requires_grad],
                arena=self.arena, accum_dtype=torch.float32 if self.master_weights else None,
                executor=self.executor, on_ready=self._on_grads_ready,
                buckets=[b.params for b in self.buckets], timeout_s=self.timeout_s)
        self.stepper: DeviceStepper | None = None
        if self.mode == "gpu_stream":
            self.stepper = DeviceStepper(self.buckets, self.states, self.streams, self._hyper)
            if self.step_in_backward:
                self._arrivals = GradArrivals(self.buckets, self.stepper, lambda: self._no_sync)
        self._h2d: list[Any] = [None] * len(self.buckets)  # cpu mode: weight copy per bucket

    # ---- construction ----------------------------------------------------------------------
    def _make_buckets(self, cls: type[torch.optim.Optimizer], nbytes: int) -> list[OptBucket]:
        out: list[OptBucket] = []
        # groups carry every default, some of them not constructor arguments (AdamW's
        # decoupled_weight_decay): the inner optimizers get those the class takes
        accepted = set(inspect.signature(cls).parameters) - {"params"}
        for gi, group in enumerate(self.param_groups):
            # the state a group keeps depends on its own options (amsgrad, momentum, ...)
            kwargs = {**self._kwargs, **{k: v for k, v in group.items() if k in accepted}}
            keys_by_dtype: dict[torch.dtype, list[tuple[str, torch.dtype]]] = {}
            for plist in make_buckets([p for p in group["params"] if p.requires_grad], nbytes):
                mdt = self._master_dtype(plist[0])
                sdt = mdt or plist[0].dtype
                if sdt not in keys_by_dtype:
                    keys_by_dtype[sdt] = state_keys(cls, kwargs, sdt)
                dev = plist[0].device if self.mode == "gpu_stream" else torch.device("cpu")
                out.append(OptBucket(len(out), gi, plist, master_dtype=mdt,
                                     keys=keys_by_dtype[sdt], optimizer_class=cls,
                                     kwargs=kwargs, compute_device=dev))
        return out

    def _master_dtype(self, p: torch.Tensor) -> torch.dtype | None:
        if self.mode == "cpu":
            return torch.float32 if self.master_weights else p.dtype
        if self.master_weights and p.dtype != torch.float32:
            return torch.float32
        return None

    def _cast_buffer(self, b: OptBucket) -> torch.Tensor | None:
        """cpu mode: a working-dtype host copy the H2D reads (when dtypes differ, or on disk)."""
        if self.mode != "cpu" or (b.master_dtype == b.params[0].dtype
                                  and not self.states.on_disk):
            return None
        return get_buffer(self.arena, self._cast_layout(b).nbytes)

    @torch.no_grad()
    def _init_masters(self) -> None:
        for b in self.buckets:
            blob = self.states.acquire(b.index)
            if b.has_master:
                for m, p in zip(b.layout.views(blob, "master"), b.params, strict=True):
                    m.copy_(p)
            self.states.release(b.index, dirty=True)
        self.states.flush()

    # ---- gradients -------------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients only (no early bucket steps). Leaving
        it ends the accumulation: gradients of buckets that got only some of theirs move to the
        host (cpu mode) and no bucket counts a parameter as arrived for the next backward."""
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            if not prev:
                self._end_accumulation()
            self._no_sync = prev

    def _end_accumulation(self) -> None:
        if self.grads is not None:
            self.grads.flush()  # no step: still inside no_sync
        if self._arrivals is not None:
            self._arrivals.clear()

    def _on_grads_ready(self, gb: GradBucket) -> None:
        if not self.step_in_backward or self._no_sync:
            return
        b = self.buckets[gb.index]
        if b.pending:
            raise FailedPrecondition(
                f"optimizer bucket {b.index} got gradients again after its step started in "
                "backward: accumulate inside no_sync() or pass step_in_backward=False")
        self._submit(b, in_backward=True)

    def _submit(self, b: OptBucket, in_backward: bool = False) -> None:
        # the hyper-parameters are read here, not by the worker: a change made after
        # backward is then always seen by step()'s check, never half used
        b.pending, b.in_backward, b.used = True, in_backward, hyper_of(self._hyper(b))
        b.future = self.executor.submit(self._cpu_step, b, b.used)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all gradients by their total norm (wherever they are); returns the norm."""
        if self.stepper is not None and self.stepper.done:
            raise FailedPrecondition("bucket steps already started (step_in_backward): "
                                     "gradients can no longer be clipped")
        if self.grads is None:
            params = [p for g in self.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite)
        if any(b.pending for b in self.buckets):
            raise FailedPrecondition("bucket steps already started (step_in_backward): "
                                     "gradients can no longer be clipped")
        return self.grads.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients. Refused (nothing changed) after buckets stepped in backward
        and before ``step()``: that step was already applied and is not undone."""
        self._check_open()
        if (self.stepper is not None and self.stepper.done) \
                or any(b.in_backward for b in self.buckets):
            raise FailedPrecondition(
                "zero_grad() before step(): the step was already applied during backward "
                "(step_in_backward) and cannot be skipped; call step() to finish it, or pass "
                "step_in_backward=False to skip steps (e.g. on a non-finite loss)")
        if any(b.pending for b in self.buckets):
            self._finish()  # a step() that timed out is kept: it was asked for
            for b in self.buckets:
                b.pending = False
        for b in self.buckets:
            for p in b.params:
                if p.grad is None or set_to_none:
                    p.grad = None
                    continue  # as torch.optim: zeroed in place, out of any graph
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
        if self.grads is not None:
            self.grads.zero()

    # ---- step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_untracked()
        self._check_hyper()
        if self.mode == "cpu":
            self._step_cpu()
        else:
            self._step_gpu_stream()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "buckets"):  # torch.optim's constructor adds the initial groups
            raise FailedPrecondition("add_param_group after construction is not supported: "
                                     "build a new OffloadedOptimizer over every group")
        super().add_param_group(param_group)

    def _check_untracked(self) -> None:
        """Refuse (before any change) a parameter frozen at construction that got a grad."""
        tracked = {id(p) for b in self.buckets for p in b.params}
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in tracked and p.grad is not None:
                    raise FailedPrecondition(
                        "a parameter frozen when the optimizer was built has a gradient: "
                        "unfreezing is not supported, build a new OffloadedOptimizer")

    def _check_hyper(self) -> None:
        """Refuse (before any change) a step whose buckets stepped in backward with
        hyper-parameters since changed: that step cannot be redone."""
        done = self.stepper.done if self.stepper is not None else set()
        for b in self.buckets:
            if (b.in_backward or b.index in done) \
                    and not same_hyper(b.used, hyper_of(self._hyper(b))):
                raise FailedPrecondition(
                    f"hyper-parameters of group {b.group} changed after optimizer bucket "
                    f"{b.index} stepped in backward with the previous ones (the step was "
                    "already applied): set them back and call step(), set them before "
                    "backward, or pass step_in_backward=False")

    def _hyper(self, b: OptBucket) -> dict[str, Any]:
        return self.param_groups[b.group]

    @torch.no_grad()
    def _cpu_step(self, b: OptBucket, hyper: dict[str, Any]) -> None:
        """Worker thread: step bucket ``b`` on its host copy, then start its weight copy back."""
        assert self.grads is not None
        gb = self.grads.buckets[b.index]
        StreamPair.synchronize(self._h2d[b.index])  # the last copy back read the host weights
        blob = self.states.acquire(b.index)
        self.states.prefetch_next(b.index)
        views = b.views(blob)
        grads = [g if ok else None for g, ok in zip(gb.grads, gb.present, strict=True)]
        b.run(views["master"], grads, views, hyper)
        cast = self._cast[b.index]
        srcs = views["master"]
        if cast is not None:
            srcs = self._cast_layout(b).views(cast, "w")
            for dst, src in zip(srcs, views["master"], strict=True):
                dst.copy_(src)
        # the bucket's weights were last used by backward work enqueued before its gradient
        # copy: the copy back needs no later point of the compute stream
        self._h2d[b.index] = self.streams.copy_many(
            "h2d", list(b.params), srcs, after=gb.landed, after_compute=gb.landed is None)
        self.states.release(b.index, dirty=True)

    @staticmethod
    def _cast_layout(b: OptBucket) -> FlatLayout:
        return FlatLayout.build([p.shape for p in b.params], [("w", b.params[0].dtype)])

    def _wait(self, b: OptBucket) -> None:
        """Wait for bucket ``b``'s step in flight, if any. One not done in time stays owned
        (still in flight, still pending): waiting again later picks it up, never resubmits."""
        if b.future is None:
            return
        try:
            b.future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise DeadlineExceeded(f"optimizer bucket {b.index} step not done after "
                                   f"{self.timeout_s}s") from None
        b.future = None

    def _step_cpu(self) -> None:
        assert self.grads is not None
        self.grads.flush()
        for b in self.buckets:
            b.in_backward = False  # the step is asked for: one that times out stays owned
            if not b.pending:
                self._submit(b)
        for b in self.buckets:
            self._wait(b)
        for b in self.buckets:
            StreamPair.wait_on_compute(self._h2d[b.index])
            b.pending = False
        self.states.flush()
        self.grads.zero()

    def _step_gpu_stream(self) -> None:
        assert self.stepper is not None
        self.stepper.finish()
        if self._arrivals is not None:
            self._arrivals.clear()  # parameters that got no gradient this step

    # ---- checkpoints -----------------------------------------------------------------------
    def _finish(self) -> None:
        """Wait for every step in flight; steps of the current round stay pending."""
        for b in self.buckets:
            self._wait(b)
        StreamPair.synchronize(*self._h2d, *(self.stepper.out if self.stepper else []))
        self.states.flush()

    def state_dict(self) -> dict[str, Any]:
        """Master weights, states and hyper-parameters, keyed by parameter position; the
        current state, with the steps already taken in backward."""
        self._check_open()
        self._finish()
        return saved_state(self)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved; working weights are re-synced from the master.
        Buckets already stepped this round stay stepped: ``step()`` steps only the others."""
        self._check_open()
        self._finish()
        check_state_dict(self, state_dict)
        load_state(self, state_dict)

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the offloaded optimizer is closed")

    def close(self) -> None:
        """Stop the worker, remove hooks, return host buffers to the arena, close a disk
        directory it opened and drop its lock (once)."""
        if self._closed:
            return
        self._finish()
        self._release()

    def _release(self) -> None:
        """Give back whatever construction took (everything, once built)."""
        self._closed = True
        if self._arrivals is not None:
            self._arrivals.remove()
        if self.grads is not None:
            self.grads.close()
        self.executor.shutdown(wait=True)
        for cast in self._cast:
            if cast is not None:
                self.arena.put_buffer(cast)
        self._cast = []
        if hasattr(self, "states"):
            self.states.close()
        if self._home is not None:
            self._home.close()  # threads, files, lock (a disk_store given is the caller's)
