"""Per-batch helpers of the engine core: grouping, bulk frees, chunked submission, lane takes."""

from __future__ import annotations

from kvtier.batches import Chunks, split_by
from kvtier.scheduler import _Lane
from kvtier.transfer.base import Move
from kvtier.types import Direction


def test_split_by_keeps_first_seen_key_order_and_order_within_parts() -> None:
    assert split_by([]) == []
    assert split_by([7, 7, 7], ["a", "b", "c"], [1, 2, 3]) == [(7, [["a", "b", "c"], [1, 2, 3]])]
    parts = split_by([2, 1, 2, 3, 1], ["a", "b", "c", "d", "e"])
    assert parts == [(2, [["a", "c"]]), (1, [["b", "e"]]), (3, [["d"]])]


class _Sched:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def submit(self, moves: list[Move]) -> None:
        self.batches.append([m.src for m in moves])


def test_chunks_add_many_submits_once_the_batch_size_is_reached() -> None:
    sched = _Sched()
    chunks = Chunks(sched, 3 * 4096)  # type: ignore[arg-type]
    chunks.add_many([Move(Direction.GPU_TO_CPU, 4096, i, i) for i in range(2)])
    assert sched.batches == []
    chunks.add_many([Move(Direction.GPU_TO_CPU, 4096, i, i) for i in range(2, 5)])
    chunks.add(Move(Direction.GPU_TO_CPU, 4096, 5, 5))
    assert chunks.flush() == 6
    assert sched.batches == [[0, 1, 2, 3, 4], [5]]


def _queue(lane: _Lane, sizes: list[int]) -> None:
    for i, size in enumerate(sizes):
        move = Move(Direction.GPU_TO_CPU, size, i, i)
        lane.queue_for(move).append(move)


def test_take_respects_bytes_for_one_size_and_for_mixed_sizes() -> None:
    lane = _Lane("down")
    _queue(lane, [4096] * 7)
    assert [m.src for m in lane.take(3 * 4096)] == [0, 1, 2]
    assert [m.src for m in lane.take(3 * 4096)] == [3, 4, 5]
    assert [m.src for m in lane.take(3 * 4096)] == [6]
    mixed = _Lane("down")
    _queue(mixed, [4096, 8192, 4096, 4096, 16384])
    assert [m.src for m in mixed.take(3 * 4096)] == [0, 1]  # 4 KiB + 8 KiB = the limit
    assert [m.src for m in mixed.take(3 * 4096)] == [2, 3]  # the 16 KiB one would pass it
    assert [m.src for m in mixed.take(3 * 4096)] == [4]  # a move larger than a batch goes alone
    assert mixed.count(restores=False) == 0


def test_batch_counters_count_bytes_of_successes_only_and_mixed_leftovers_per_direction() -> None:
    from kvtier.core import EngineCore
    from kvtier.stats import EngineCounters

    core = EngineCore.__new__(EngineCore)  # only the counters are needed
    core.counters = EngineCounters()
    down = [Move(Direction.GPU_TO_CPU, 4096 * (i + 1), i, i) for i in range(3)]
    core._count(down, [True, True, True], 0.5)
    core._count(down, [True, False, True], 0.25)
    c = core.counters.moved[Direction.GPU_TO_CPU]
    assert (c.bytes, c.pages, c.failures, c.batches) == (6 * 4096 + 4 * 4096, 5, 1, 2)
    assert c.seconds == 0.75
    up = Move(Direction.CPU_TO_GPU, 4096, 0, 0)
    core._count([down[0], up], [False, True], 0.0)  # close(): leftovers of both kinds
    assert core.counters.moved[Direction.CPU_TO_GPU].pages == 1
    assert core.counters.moved[Direction.GPU_TO_CPU].failures == 2
