"""Activation offload: saved tensors of chosen layers go to pinned host memory and come back
one layer ahead of backward. See ``kvtier.training.base`` for the contract.

Usage (TransformerEngine style)::

    ctx, sync_fn = get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync_fn(x)

Which saved tensors are offloaded: floating point, contiguous, not an ``nn.Parameter``, not passed
to :func:`mark_not_offload`, at least ``min_numel`` elements, and on a CUDA or CPU device. A tensor
saved twice in one layer is copied once.

Every decision follows the saved tensor's own device, never whether CUDA is available: a CUDA
tensor is copied on the offload stream (after an event on its device's compute stream) and reloaded
on the reload stream; a CPU tensor is copied synchronously into its arena buffer when it is saved,
exactly as on a machine without a GPU (so its saved value survives a later in-place write). A CUDA
tensor written in place before its copy is known to be done raises :class:`OffloadRaceError` (the
copy may have read either value). Tensors that are kept (not offloaded) get autograd's own check
back: the saved-tensor hooks would otherwise hide an in-place write after the save and silently
give wrong gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import InvalidArgument
from kvtier.training.base import BufferArena, OffloadRaceError, default_arena, get_buffer, typed
from kvtier.training.streams import CopyDone, StreamPair

DEFAULT_MIN_NUMEL = 256 * 1024
_NO_OFFLOAD_ATTR = "_kvtier_no_offload"


def mark_not_offload(*tensors: torch.Tensor | None) -> None:
    """Keep these tensors on the device even when a layer saving them is offloaded."""
    for t in tensors:
        if t is not None:
            setattr(t, _NO_OFFLOAD_ATTR, True)


@dataclass(slots=True)
class OffloadStats:
    """Plain counters of one offloader."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0
    deduplicated: int = 0
    reloaded_bytes: int = 0
    prefetches: int = 0


class _Saved:
    """One offloaded tensor. ``src`` (device) lives until the copy is known done; ``raw``/``host``
    (arena buffer) until every autograd reference is gone; ``dev`` is the reloaded copy."""

    __slots__ = (
        "copy_done",
        "dev",
        "device",
        "dtype",
        "host",
        "owner",
        "raw",
        "refs",
        "reload_done",
        "shape",
        "src",
        "version",
    )

    def __init__(self, t: torch.Tensor, owner: ActivationOffloader) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.src: torch.Tensor | None = t
        self.version = t._version
        self.raw: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.copy_done: CopyDone | None = None
        self.reload_done: CopyDone | None = None
        self.refs = 0
        self.owner = owner


class _Kept:
    """A saved tensor left where it is, with its version at save time (autograd's own check)."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.version = t._version

    def get(self) -> torch.Tensor:
        if self.t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.t.dtype}{list(self.t.shape)}] is at version "
                f"{self.t._version}; expected version {self.version} instead (saved while the "
                "kvtier activation offloader was active, which kept it on its device)"
            )
        return self.t


class _Ref:
    """What autograd stores instead of the tensor; the record is freed with the last ref."""

    __slots__ = ("__weakref__", "rec")

    def __init__(self, rec: _Saved) -> None:
        self.rec = rec
        rec.refs += 1

    def __del__(self) -> None:
        # at interpreter shutdown the arena may be gone already
        with suppress(Exception):
            self.rec.owner._unref(self.rec)


class ActivationOffloader:
    """Mechanism shared by the context and the module hooks: pack/unpack and layer boundaries."""

    def __init__(self, *, arena: BufferArena | None, should_offload: Callable[[int], bool],
                 group_count: int, min_numel: int = DEFAULT_MIN_NUMEL, manual: bool = False,
                 offload_stream: Any = None) -> None:
        if min_numel < 0:
            raise InvalidArgument("min_numel", f"must be >= 0, got {min_numel}")
        self.arena = arena if arena is not None else default_arena()
        self.should_offload = should_offload
        self.group_count = group_count
        self.min_numel = min_numel
        self.manual = manual
        self.streams = StreamPair(d2h=offload_stream)
        self.stats = OffloadStats()
        self.group = 0
        self.groups: dict[int, list[_Saved]] = {}
        self._dedup: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], _Saved]] = {}

    # ---- saved-tensor hooks ----------------------------------------------------------------
    def eligible(self, t: torch.Tensor) -> bool:
        return (
            t.is_floating_point()
            and t.numel() >= max(self.min_numel, 1)
            and not isinstance(t, torch.nn.Parameter)
            and not getattr(t, _NO_OFFLOAD_ATTR, False)
            and t.is_contiguous()
            and t.device.type in ("cuda", "cpu")
        )

    def pack(self, t: torch.Tensor) -> Any:
        if not self.should_offload(self.group) or not self.eligible(t):
            self.stats.kept_tensors += 1
            return _Kept(t)
        key = (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype)
        hit = self._dedup.get(key)
        if hit is not None and hit[0]() is t:
            self.stats.deduplicated += 1
            return _Ref(hit[1])
        rec = _Saved(t, self)
        self._dedup[key] = (weakref.ref(t), rec)
        self.groups.setdefault(self.group, []).append(rec)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        if not self.manual:
            self._copy_out(rec)
        return _Ref(rec)

    def unpack(self, ref: Any) -> torch.Tensor:
        if isinstance(ref, _Kept):
            return ref.get()
        rec: _Saved = ref.rec
        if rec.src is not None:
            self._check_version(rec)
            return rec.src
        self._reload(rec)
        assert rec.dev is not None
        self.streams.wait_on_compute(rec.reload_done)
        return rec.dev

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ---- copies ----------------------------------------------------------------------------
    def _copy_out(self, rec: _Saved) -> None:
        """Start the device->host copy of ``rec`` (ordered after the kernels that made it)."""
        src = rec.src
        assert src is not None and rec.raw is None
        self._check_version(rec)
        rec.raw = get_buffer(self.arena, src.numel() * src.element_size())
        rec.host = typed(rec.raw, 0, src.shape, src.dtype)
        rec.copy_done = self.streams.d2h_copy(rec.host, src)
        if rec.copy_done is None:  # not a CUDA tensor: copied synchronously, ``src`` can go now
            rec.src = None

    def _release(self, rec: _Saved) -> None:
        """Drop the device copy once its host copy is done (the compute stream waits on it)."""
        if rec.src is None:
            return
        if rec.raw is None:
            self._copy_out(rec)
        if rec.src is None:
            return
        self._check_version(rec)
        self.streams.wait_on_compute(rec.copy_done)
        rec.src = None

    def _reload(self, rec: _Saved) -> None:
        if rec.dev is not None or rec.src is not None or rec.host is None:
            return
        rec.dev = torch.empty(rec.shape, dtype=rec.dtype, device=rec.device)
        rec.reload_done = self.streams.h2d_copy(rec.dev, rec.host, after=rec.copy_done)
        self.stats.reloaded_bytes += rec.host.numel() * rec.host.element_size()

    def _check_version(self, rec: _Saved) -> None:
        if rec.src is not None and rec.src._version != rec.version:
            raise OffloadRaceError(
                "a saved tensor was modified in place before its offload copy was known to be done;"
                " mark_not_offload() it or clone it before the in-place op"
            )

    def _unref(self, rec: _Saved) -> None:
        rec.refs -= 1
        if rec.refs > 0:
            return
        self.streams.synchronize(rec.copy_done, rec.reload_done)
        if rec.raw is not None:
            self.arena.put_buffer(rec.raw)
        rec.raw = rec.host = rec.dev = rec.src = None

    # ---- layer boundaries ------------------------------------------------------------------
    def commit_forward(self) -> tuple[dict[int, list[_Saved]], int]:
        """End the current group: release the previous group's device copies, advance."""
        groups, g = self.groups, self.group
        if not self.manual:
            for rec in groups.get(g - 1, ()):
                self._release(rec)
        self._dedup.clear()
        self.group += 1
        if self.group >= self.group_count:
            self.group = 0
            self.groups = {}
        return groups, g

    def commit_backward(self, groups: dict[int, list[_Saved]], g: int) -> None:
        """Group ``g``'s backward is next: make sure it is reloading and prefetch ``g - 1``."""
        for rec in groups.get(g, ()):
            self._reload(rec)
        prev = groups.get(g - 1, ())
        if prev:
            self.stats.prefetches += 1
        for rec in prev:
            self._reload(rec)

    def start_offload(self, groups: dict[int, list[_Saved]], g: int) -> None:
        for rec in groups.get(g, ()):
            if rec.src is not None and rec.raw is None:
                self._copy_out(rec)

    def release(self, groups: dict[int, list[_Saved]], g: int) -> None:
        for rec in groups.get(g, ()):
            self._release(rec)


class _GroupCommit(torch.autograd.Function):
    """Identity marking a layer boundary; its backward prefetches the layer below."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, off: ActivationOffloader) -> torch.Tensor:
        ctx.off = off
        ctx.groups, ctx.g = off.commit_forward()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.off.commit_backward(ctx.groups, ctx.g)
        return grad, None


class OffloadContext(AbstractContextManager["OffloadContext"]):
    """Re-enterable context installing the offloader's saved-tensor hooks (one layer per use)."""

    def __init__(self, offloader: ActivationOffloader) -> None:
        self.offloader = offloader
        self._active: list[torch.autograd.graph.saved_tensors_hooks] = []

    @property
    def stats(self) -> OffloadStats:
        return self.offloader.stats

    def __enter__(self) -> OffloadContext:
        hooks = self.offloader.hooks()
        hooks.__enter__()
        self._active.append(hooks)
        return self

    def __exit__(self, *exc: object) -> None:
        self._active.pop().__exit__(*exc)

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        """The layer boundary (``sync_fn``)."""
        out: torch.Tensor = _GroupCommit.apply(x, self.offloader)
        return out


class ManualOffloadSynchronizer:
    """Manual schedule: the caller starts offloads, releases device copies, starts reloads."""

    def __init__(self, offloader: ActivationOffloader) -> None:
        self.offloader = offloader

    def _pick(self, group: int | None) -> tuple[dict[int, list[_Saved]], int]:
        off = self.offloader
        if group is not None:
            return off.groups, group
        return off.groups, (off.group - 1) % max(off.group_count, 1)

    def start_offload(self, group: int | None = None) -> None:
        """Start the copies of ``group`` (default: the layer that last passed ``sync_fn``)."""
        self.offloader.start_offload(*self._pick(group))

    def release(self, group: int | None = None) -> None:
        """Drop ``group``'s device copies once their copies are done."""
        self.offloader.release(*self._pick(group))

    def start_reload(self, group: int | None = None) -> None:
        self.offloader.commit_backward(*self._pick(group))


def get_cpu_offload_context(
    enabled: bool = True, num_layers: int = 1, model_layers: int = 1,
    manual_synchronization: bool = False, offload_stream: Any = None, *,
    arena: BufferArena | None = None, min_numel: int = DEFAULT_MIN_NUMEL,
) -> tuple[Any, ...]:
    """``(ctx, sync_fn)``, plus a :class:`ManualOffloadSynchronizer` in manual mode.

    Offloads the first ``num_layers`` of ``model_layers`` layers (each ``with ctx`` block followed
    by one ``sync_fn`` call is one layer; the count wraps at ``model_layers``).
    """
    if not 0 <= num_layers <= model_layers:
        raise InvalidArgument("num_layers", f"must be in [0, model_layers={model_layers}]")
    if not enabled:
        ident: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # noqa: E731
        return (nullcontext(), ident, None) if manual_synchronization else (nullcontext(), ident)
    off = ActivationOffloader(arena=arena, should_offload=lambda g: g < num_layers,
                              group_count=model_layers, min_numel=min_numel,
                              manual=manual_synchronization, offload_stream=offload_stream)
    ctx = OffloadContext(off)
    if manual_synchronization:
        return ctx, ctx.sync, ManualOffloadSynchronizer(off)
    return ctx, ctx.sync


class ModuleOffload:
    """Handle returned by :func:`offload_modules`: ``stats``, ``remove()``."""

    def __init__(self, ctx: OffloadContext, handles: list[Any]) -> None:
        self.ctx = ctx
        self._handles = handles

    @property
    def stats(self) -> OffloadStats:
        return self.ctx.stats

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _commit_output(ctx: OffloadContext, out: Any) -> Any:
    """Apply the boundary to the first output tensor that needs a gradient."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        return ctx.sync(out)
    if isinstance(out, tuple | list):
        items = list(out)
        for i, item in enumerate(items):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                items[i] = ctx.sync(item)
                return type(out)(items)
    ctx.offloader.commit_forward()
    return out


def offload_modules(model: torch.nn.Module, names: Iterable[str], *,
                    arena: BufferArena | None = None,
                    min_numel: int = DEFAULT_MIN_NUMEL) -> ModuleOffload:
    """Offload what the named submodules save (Megatron style): one group per module call.

    Each named module is expected to run once per forward, in the order given.
    """
    names = list(names)
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise InvalidArgument("names", f"no such submodules: {missing}")
    off = ActivationOffloader(arena=arena, should_offload=lambda g: True,
                              group_count=len(names), min_numel=min_numel)
    ctx = OffloadContext(off)
    def pre(_m: torch.nn.Module, _args: Any) -> None:
        ctx.__enter__()

    def post(_m: torch.nn.Module, _args: Any, out: Any) -> Any:
        ctx.__exit__(None, None, None)
        return _commit_output(ctx, out)

    handles: list[Any] = []
    for n in names:
        handles.append(modules[n].register_forward_pre_hook(pre))
        handles.append(modules[n].register_forward_hook(post, always_call=True))
    return ModuleOffload(ctx, handles)
