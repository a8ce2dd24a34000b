"""Transfer handlers by medium pair: one registry line per (source, destination) medium.

Contract:
    * ``register_route(src, dst, build)``: ``build(ctx)`` makes the handler copying pages from
      medium ``src`` to ``dst`` (names of the tier chain: ``gpu``, ``cpu``, a registered slot
      medium) for a ``RouteContext`` (the GPU device, the host arena, the slot media at either
      end, the staging size). The handler's ``lane`` (or the default for its direction) picks
      the scheduler lane that runs it. Registering a pair again replaces it.
    * ``build_handlers(ctx, media, flush_to)``: the handler of each move the engine makes along
      a chain whose media below the CPU are ``media`` (``(name, medium)``, top down): GPU<->CPU
      always; CPU -> the first medium (demotion) and CPU -> level ``flush_to`` (the shutdown
      flush, when it is deeper); each medium -> the next (demotion);
      each medium -> CPU (a restore reads straight from the level holding the page). Two slot
      media with no registered pair get ``transfer/between.py``'s ``MediumCopy`` (through
      host bounce buffers). A missing pair with the CPU is a ``ConfigError`` naming
      ``KVCACHED_OFFLOAD_TIER_CHAIN``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import torch

from kvtier.config import ENV_PREFIX
from kvtier.errors import ConfigError
from kvtier.transfer.base import TransferHandler
from kvtier.types import BELOW_CPU, Direction, Tier

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskStore
    from kvtier.tiers.medium import SlotMedium
    from kvtier.tiers.pinned import HostArena


@dataclass(slots=True, frozen=True)
class RouteContext:
    """What a handler may be built on: ``src``/``dst`` are the route's slot media (None at
    the GPU or the CPU end)."""

    device: torch.device
    host: HostArena
    src: SlotMedium | None
    dst: SlotMedium | None
    staging_bytes: int

    @property
    def lower(self) -> SlotMedium | None:
        """The slot medium of a route to or from the CPU."""
        return self.dst if self.dst is not None else self.src


Build = Callable[[RouteContext], TransferHandler]
_ROUTES: dict[tuple[str, str], Build] = {}


def register_route(src: str, dst: str, build: Build) -> None:
    _ROUTES[(src, dst)] = build


def _pairs(names: Sequence[str], flush_to: int | None) -> dict[tuple[int, int], tuple[str, str]]:
    """(source level, destination level) -> (source name, destination name)."""
    chain = ["gpu", "cpu", *names]
    pairs: dict[tuple[int, int], tuple[str, str]] = {
        (Tier.GPU, Tier.CPU): ("gpu", "cpu"), (Tier.CPU, Tier.GPU): ("cpu", "gpu")}
    for level in range(BELOW_CPU, len(chain)):
        if level == BELOW_CPU:
            pairs[(Tier.CPU, level)] = ("cpu", chain[level])
        else:
            pairs[(level - 1, level)] = (chain[level - 1], chain[level])
        pairs[(level, Tier.CPU)] = (chain[level], "cpu")
    if flush_to is not None:
        pairs[(Tier.CPU, flush_to)] = ("cpu", chain[flush_to])
    return {(int(a), int(b)): pair for (a, b), pair in pairs.items()}


def build_handlers(
    ctx: RouteContext,
    media: Sequence[tuple[str, SlotMedium]] = (),
    flush_to: int | None = None,
) -> dict[Direction, TransferHandler]:
    stores: list[SlotMedium | None] = [None, None, *(m for _, m in media)]
    handlers: dict[Direction, TransferHandler] = {}
    for (src, dst), pair in _pairs([n for n, _ in media], flush_to).items():
        build = _ROUTES.get(pair)
        if build is None and min(src, dst) >= BELOW_CPU:
            build = _medium_copy
        if build is None:
            raise ConfigError(
                f"{ENV_PREFIX}TIER_CHAIN: no transfer handler is registered for "
                f"{pair[0]} -> {pair[1]}"
            )
        direction = Direction((src, dst))
        handler = build(replace(ctx, src=stores[src], dst=stores[dst]))
        handler.direction = direction
        handlers[direction] = handler
    return handlers


def _medium_copy(ctx: RouteContext) -> TransferHandler:
    from kvtier.transfer.between import MediumCopy

    assert ctx.src is not None and ctx.dst is not None
    return MediumCopy(ctx.src, ctx.dst)


def _offload(ctx: RouteContext) -> TransferHandler:
    if ctx.device.type == "cuda":
        from kvtier.transfer.cuda import CudaOffload

        return CudaOffload(ctx.host, ctx.device, ctx.staging_bytes)
    from kvtier.transfer.host import HostOffload

    return HostOffload(ctx.host)


def _restore(ctx: RouteContext) -> TransferHandler:
    if ctx.device.type == "cuda":
        from kvtier.transfer.cuda import CudaRestore

        return CudaRestore(ctx.host, ctx.device, ctx.staging_bytes)
    from kvtier.transfer.host import HostRestore

    return HostRestore(ctx.host)


def _disk_write(ctx: RouteContext) -> TransferHandler:
    from kvtier.transfer.disk import DiskWrite

    return DiskWrite(ctx.host, cast("DiskStore", ctx.dst))


def _disk_read(ctx: RouteContext) -> TransferHandler:
    from kvtier.transfer.disk import DiskRead

    return DiskRead(ctx.host, cast("DiskStore", ctx.src))


register_route("gpu", "cpu", _offload)
register_route("cpu", "gpu", _restore)
register_route("cpu", "disk", _disk_write)
register_route("disk", "cpu", _disk_read)
