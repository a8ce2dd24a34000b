"""A dict-backed slot medium (what a remote page store would start from), written as a
newcomer adds a medium: the tier file, the handler file and the registry lines, here in one
test module. ``dict`` (64 pages) and ``dicta``/``dictb`` (8 pages each) name it in the tier
chain; ``OPENED`` lists every one the engines opened, newest last."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvtier.config import OffloadConfig
from kvtier.tiers.base import MediumSlot, TierCounters
from kvtier.tiers.medium import NoRecords
from kvtier.tiers.pinned import HostArena
from kvtier.tiers.registry import register_medium
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.transfer.registry import RouteContext, register_route
from kvtier.types import Direction


# -- the tier file -----------------------------------------------------------------------------
class DictMedium(NoRecords):
    """Pages as ``bytes`` in a dict, by (page size, slot), within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.counters = TierCounters()
        self.budget = budget_bytes
        self.pages: dict[tuple[int, int], bytes] = {}
        self._used: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.budget

    @property
    def used_bytes(self) -> int:
        return sum(len(s) * size for size, s in self._used.items())

    def alloc(self, page_size: int, n: int) -> list[MediumSlot] | None:
        with self._lock:
            if self.used_bytes + n * page_size > self.budget:
                return None
            used = self._used.setdefault(page_size, set())
            free = (s for s in range(self.budget // page_size) if s not in used)
            out = [next(free) for _ in range(n)]
            used.update(out)
            return [MediumSlot(s) for s in out]

    def free(self, page_size: int, slots: Sequence[int]) -> None:
        with self._lock:
            for s in slots:
                self._used[page_size].remove(int(s))
                self.pages.pop((page_size, int(s)), None)

    def write(
        self, page_size: int, slots: Sequence[int], srcs: Sequence[torch.Tensor]
    ) -> Future[list[bool]]:
        for s, src in zip(slots, srcs, strict=True):
            self.pages[(page_size, int(s))] = src.numpy().tobytes()
        self.counters.bytes_written += len(slots) * page_size
        return _done([True] * len(slots))

    def read(
        self, page_size: int, slots: Sequence[int], dsts: Sequence[torch.Tensor]
    ) -> Future[list[bool]]:
        ok = []
        for s, dst in zip(slots, dsts, strict=True):
            data = self.pages.get((page_size, int(s)))
            if data is not None:
                dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            ok.append(data is not None)
        self.counters.bytes_read += sum(ok) * page_size
        return _done(ok)

    def close(self) -> None:
        self.pages.clear()


def _done(results: list[bool]) -> Future[list[bool]]:
    future: Future[list[bool]] = Future()
    future.set_result(results)
    return future


# -- the handler file --------------------------------------------------------------------------
class DictWrite(TransferHandler):
    direction = Direction.CPU_TO_DISK
    lane = "dict"  # its own lane, beside up, down and disk

    def __init__(self, host: HostArena, medium: DictMedium) -> None:
        self._host, self._medium = host, medium

    def run(self, batch: Moves) -> list[bool]:
        rows = self._host.rows(batch.page_size, batch.srcs.tolist())
        return self._medium.write(batch.page_size, batch.dsts.tolist(), rows).result()


class DictRead(DictWrite):
    direction = Direction.DISK_TO_CPU

    def run(self, batch: Moves) -> list[bool]:
        rows = self._host.rows(batch.page_size, batch.dsts.tolist())
        return self._medium.read(batch.page_size, batch.srcs.tolist(), rows).result()


# -- the registry lines ------------------------------------------------------------------------
OPENED: list[DictMedium] = []


def _opener(pages: int) -> Callable[[OffloadConfig], DictMedium]:
    def _open(config: OffloadConfig) -> DictMedium:
        OPENED.append(DictMedium(pages * config.page_size))
        return OPENED[-1]

    return _open


def _medium(ctx: RouteContext) -> DictMedium:
    assert isinstance(ctx.lower, DictMedium)
    return ctx.lower


register_medium("dict", _opener(64))
register_route("cpu", "dict", lambda ctx: DictWrite(ctx.host, _medium(ctx)))
register_route("dict", "cpu", lambda ctx: DictRead(ctx.host, _medium(ctx)))
# Two small ones, for a chain with two media below the CPU (medium -> medium moves need no
# route of their own: ``transfer/between.py`` copies through host buffers).
for _name in ("dicta", "dictb"):
    register_medium(_name, _opener(8))
    register_route("cpu", _name, lambda ctx: DictWrite(ctx.host, _medium(ctx)))
    register_route(_name, "cpu", lambda ctx: DictRead(ctx.host, _medium(ctx)))
