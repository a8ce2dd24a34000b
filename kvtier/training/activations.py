"""Activation offload front ends: saved tensors of chosen layers go to pinned host memory and
come back one layer ahead of backward. See ``kvtier.training.base`` for the contract and
``kvtier.training.saved`` for the mechanism (when device memory goes, how the host is paced).

Usage (TransformerEngine style)::

    ctx, sync_fn = get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync_fn(x)

Which saved tensors are offloaded: floating point, not an ``nn.Parameter`` or a view of one, not
passed to :func:`mark_not_offload`, at least ``min_numel`` elements, on a CUDA or CPU device, and
either contiguous or a view whose storage is at most ``MAX_SPAN_RATIO`` times its size (the
storage is copied once for all its saved views in a layer). Tensors saved twice in one layer are
copied once.

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

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from kvtier.errors import InvalidArgument
from kvtier.training.base import BufferArena
from kvtier.training.records import NO_OFFLOAD_ATTR, OffloadStats
from kvtier.training.saved import (
    DEFAULT_MAX_INFLIGHT_GROUPS,
    DEFAULT_MIN_NUMEL,
    DEFAULT_PACE_LAG,
    ActivationOffloader,
    Groups,
)

__all__ = ["DEFAULT_MIN_NUMEL", "ActivationOffloader", "ManualOffloadSynchronizer",
           "ModuleOffload", "OffloadContext", "OffloadStats", "get_cpu_offload_context",
           "mark_not_offload", "offload_modules"]


def mark_not_offload(*tensors: torch.Tensor | None) -> None:
    """Keep these tensors on the device even when a layer saving them is offloaded."""
    for t in tensors:
        if t is not None:
            setattr(t, NO_OFFLOAD_ATTR, True)


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

    def flush(self) -> None:
        """Wait for the copies in flight and give idle host buffers back to the arena."""
        self.offloader.flush()

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

    def _pick(self, group: int | None) -> tuple[Groups, int]:
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
    pace_lag: int = DEFAULT_PACE_LAG,
    max_inflight_groups: int | None = DEFAULT_MAX_INFLIGHT_GROUPS,
    drain_before_group: int | None = None, reload_ahead: int = 1,
) -> tuple[Any, ...]:
    """``(ctx, sync_fn)``, plus a :class:`ManualOffloadSynchronizer` in manual mode.

    Offloads the first ``num_layers`` of ``model_layers`` layers (each ``with ctx`` block followed
    by one ``sync_fn`` call is one layer; the count wraps at ``model_layers``). ``pace_lag``: how
    many saves or boundaries the host may run ahead of the device while copies are in flight.
    ``max_inflight_groups``: at each boundary wait for the copies of all but the last that many
    layers (default 1: memory first, a forward no faster than the copies); None: never wait for
    a copy (fastest; offload only as many layers as the forward can hide).
    ``drain_before_group=n``: entering layer ``n`` the compute stream waits for every copy in
    flight and their device memory goes at once (memory first before the peak, no host wait;
    pair it with ``max_inflight_groups=None``). ``reload_ahead``: layers reloaded ahead of
    backward (default 1).
    """
    if not 0 <= num_layers <= model_layers:
        raise InvalidArgument("num_layers", f"must be in [0, model_layers={model_layers}]")
    if not enabled:
        ident: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # noqa: E731
        return (nullcontext(), ident, None) if manual_synchronization else (nullcontext(), ident)
    off = ActivationOffloader(arena=arena, should_offload=lambda g: g < num_layers,
                              group_count=model_layers, min_numel=min_numel,
                              manual=manual_synchronization, offload_stream=offload_stream,
                              pace_lag=pace_lag, max_inflight_groups=max_inflight_groups,
                              drain_before_group=drain_before_group, reload_ahead=reload_ahead)
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
