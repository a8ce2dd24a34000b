"""Transfer handlers by medium pair: one registry line per (source, destination) medium.

Contract:
    * ``register_route(src, dst, build)``: ``build(ctx)`` makes the handler copying pages from
      medium ``src`` to ``dst`` (names of the tier chain: ``gpu``, ``cpu``, a registered slot
      medium) for a ``RouteContext`` (the GPU device, the host arena, the medium below the CPU,
      the staging size). The handler's ``lane`` (or the default for its direction) picks the
      scheduler lane that runs it. Registering a pair again replaces it.
    * ``build_handlers(ctx, lower_name)``: the handler of each engine direction: GPU<->CPU
      always, CPU<->``lower_name`` when ``ctx.lower`` is open. A chain whose medium has no
      registered pair is a ``ConfigError`` naming ``KVCACHED_OFFLOAD_TIER_CHAIN``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from kvtier.config import ENV_PREFIX
from kvtier.errors import ConfigError
from kvtier.transfer.base import TransferHandler
from kvtier.types import Direction

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskStore
    from kvtier.tiers.medium import SlotMedium
    from kvtier.tiers.pinned import HostArena


@dataclass(slots=True, frozen=True)
class RouteContext:
    """What a handler may be built on."""

    device: torch.device
    host: HostArena
    lower: SlotMedium | None
    staging_bytes: int


Build = Callable[[RouteContext], TransferHandler]
_ROUTES: dict[tuple[str, str], Build] = {}


def register_route(src: str, dst: str, build: Build) -> None:
    _ROUTES[(src, dst)] = build


def build_handlers(ctx: RouteContext, lower_name: str) -> dict[Direction, TransferHandler]:
    pairs = {Direction.GPU_TO_CPU: ("gpu", "cpu"), Direction.CPU_TO_GPU: ("cpu", "gpu")}
    if ctx.lower is not None:
        pairs[Direction.CPU_TO_DISK] = ("cpu", lower_name)
        pairs[Direction.DISK_TO_CPU] = (lower_name, "cpu")
    handlers: dict[Direction, TransferHandler] = {}
    for direction, pair in pairs.items():
        build = _ROUTES.get(pair)
        if build is None:
            raise ConfigError(
                f"{ENV_PREFIX}TIER_CHAIN: no transfer handler is registered for "
                f"{pair[0]} -> {pair[1]}"
            )
        handlers[direction] = build(ctx)
    return handlers


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

    return DiskWrite(ctx.host, cast("DiskStore", ctx.lower))


def _disk_read(ctx: RouteContext) -> TransferHandler:
    from kvtier.transfer.disk import DiskRead

    return DiskRead(ctx.host, cast("DiskStore", ctx.lower))


register_route("gpu", "cpu", _offload)
register_route("cpu", "gpu", _restore)
register_route("cpu", "disk", _disk_write)
register_route("disk", "cpu", _disk_read)
