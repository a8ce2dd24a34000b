"""Training offload primitives built on the kvtier tiers (pinned host arena, disk store).

Each primitive is a sibling module; all of them take their pinned host memory from one
:class:`~kvtier.tiers.pinned.HostArena` (``get_buffer``/``put_buffer``: exact-size pooled buffers)
and never call ``pin_memory()`` themselves. Contracts:

``get_cpu_offload_context(...) -> (ctx, sync_fn[, synchronizer])`` (``activations.py``)
    * ``with ctx: x = layer(x)`` then ``x = sync_fn(x)`` once per layer. Saved tensors of offloaded
      layers (by default the first ``num_layers`` of ``model_layers``) are copied to host when they
      are *saved* (on CUDA: on the offload stream, after an event recorded on the compute stream),
      their device memory is dropped as soon as the host sees the copy's event done (the compute
      stream never waits for it; the host is held a few saves behind the device while copies are
      in flight, and by default waits at each boundary for the copies of all but the latest layer:
      ``max_inflight_groups=None`` never waits), and they are reloaded one layer ahead of backward
      (the sync_fn's backward prefetches; ``reload_ahead`` layers); one whose device copy is
      still held then is used as is. ``drain_before_group=n``: entering layer ``n`` the compute
      stream waits for the copies in flight and their device memory goes at once.
    * Offloaded: floating point, not an ``nn.Parameter`` or a view of one, not
      ``mark_not_offload``-ed, ``numel() >= min_numel`` (default ``256 * 1024``), contiguous or a
      view whose storage is at most 4x its size (copied once for all its views). Everything else
      stays where it is.
    * ``offload_modules(model, names)`` does the same per named submodule.

``GradientOffloader`` (``gradients.py``)
    * Each parameter's gradient is moved to a host buffer as soon as autograd has accumulated it
      (a post-accumulate-grad hook) and the device gradient is freed. Gradients of several
      backward passes accumulate on the host until ``zero()``. ``clip_grad_norm_`` clips the
      host gradients with the same arithmetic as ``torch.nn.utils.clip_grad_norm_``.

``OffloadedOptimizer`` (``optimizer.py``)
    * Wraps a ``torch.optim`` class; master weights (optional, fp32) and optimizer states live on
      the host (``state_tier="cpu"``) or on disk (``"disk"``, prefetched one bucket ahead).
    * ``mode="cpu"``: gradients offloaded as above, the step runs on the CPU per bucket (in a
      worker thread) as soon as the bucket's gradients have landed (during backward unless
      ``step_in_backward=False`` or inside ``no_sync()``), and the worker copies each bucket's
      updated weights back at once. ``mode="gpu_stream"``: the step runs on the device bucket by
      bucket (during backward by default), states streamed through two device staging buffers.
    * A round of gradients is applied exactly once. A bucket stepped in backward is final at
      once (both modes, as ``torch.optim`` stepped in post-accumulate-grad hooks): skipping
      that step (``zero_grad()`` before ``step()``) or changing hyper-parameters after it is
      refused (``FailedPrecondition``, nothing changed), ``state_dict()`` reads the state with
      it applied, and ``load_state_dict()`` does not make ``step()`` apply it again; skip
      steps with ``step_in_backward=False``. A ``step()`` that timed out is finished, not
      repeated, by the next ``step()``.
    * ``state_dict()``/``load_state_dict()`` round-trip master weights and states exactly; loading
      re-syncs the working weights from the master weights.

Streams and events: every hand-off between the compute stream and a copy stream goes through an
event; host memory handed back to the arena is never still the target or source of a copy.
On a machine without CUDA the "device" is the CPU and every copy is synchronous.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import torch

from kvtier.errors import CapacityError, FailedPrecondition

MIB = 1024 * 1024
ALIGN = 64  # byte alignment of every typed view carved out of a flat buffer


class BufferArena(Protocol):
    """What the training primitives need from the host tier (``HostArena`` provides it)."""

    def get_buffer(self, nbytes: int) -> torch.Tensor | None: ...

    def put_buffer(self, buf: torch.Tensor) -> None: ...


class OffloadRaceError(FailedPrecondition):
    """A saved tensor was modified in place while its offload copy could still be reading it."""


def default_arena(budget_bytes: int | None = None, chunk_bytes: int = 64 * MIB) -> BufferArena:
    """A fresh ``HostArena``; the default budget is half of physical memory."""
    from kvtier.tiers.pinned import HostArena

    if budget_bytes is None:
        budget_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    return HostArena(budget_bytes, chunk_bytes, pin=torch.cuda.is_available())


def get_buffer(arena: BufferArena, nbytes: int) -> torch.Tensor:
    """An exact-size uint8 host buffer; a budget shortfall is an error at this edge."""
    buf = arena.get_buffer(max(nbytes, 1))
    if buf is None:
        raise CapacityError(f"host arena budget exhausted asking for {nbytes} bytes")
    return buf


def get_buffers(arena: BufferArena, sizes: list[int]) -> list[torch.Tensor]:
    """``get_buffer`` for each size, all or none: on a shortfall those taken go back."""
    out: list[torch.Tensor] = []
    try:
        for n in sizes:
            out.append(get_buffer(arena, n))
    except BaseException:
        for buf in out:
            arena.put_buffer(buf)
        raise
    return out


def positive(value: object) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def typed(buf: torch.Tensor, offset: int, shape: torch.Size | tuple[int, ...],
          dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` view of ``shape`` at byte ``offset`` of a flat uint8 buffer."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return buf[offset : offset + nbytes].view(dtype).view(shape)


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"
