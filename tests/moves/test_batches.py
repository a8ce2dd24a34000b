"""Per-batch helpers of the engine core: batch split/join/cancel, lane takes, counters."""

from __future__ import annotations

from kvtier.lanes import Lane as _Lane
from kvtier.transfer.base import Moves
from kvtier.types import Direction

DOWN = Direction.GPU_TO_CPU


def _raw(size: int, cols: range, **kw: object) -> Moves:
    return Moves(DOWN, size, list(cols), [c + 100 for c in cols], **kw)  # type: ignore[arg-type]


def test_take_splits_columns_and_join_appends_them() -> None:
    batch = _raw(4096, range(5))
    head = batch.take(2)
    assert (head.srcs.tolist(), head.dsts.tolist()) == ([0, 1], [100, 101])
    assert batch.srcs.tolist() == [2, 3, 4] and batch.dsts.tolist() == [102, 103, 104]
    assert batch.nbytes == 3 * 4096
    head.join(batch)
    assert head.srcs.tolist() == [0, 1, 2, 3, 4] and len(head) == 5
    assert not _raw(8192, range(1)).compatible(head)  # another page size
    assert not _raw(4096, range(1), copy=True).compatible(head)  # copy batches stay whole


def test_split_copy_batches_report_results_to_the_original() -> None:
    batch = _raw(4096, range(5), copy=True)
    batch.results = [None] * 5
    head = batch.take(2)
    middle = batch.take(2)
    middle.report([True, False])
    batch.report([True])
    assert batch.results == [None, None, True, False, True]
    head.report([True, True])
    assert batch.results == [True, True, True, False, True]


def _queue(lane: _Lane, sizes: list[int]) -> None:
    for i, size in enumerate(sizes):
        batch = _raw(size, range(i, i + 1))
        lane.queue_for(batch).append(batch)


def test_take_respects_bytes_for_one_size_and_for_mixed_sizes() -> None:
    lane = _Lane("down")
    _queue(lane, [4096] * 7)
    assert lane.take(3 * 4096).srcs.tolist() == [0, 1, 2]
    assert lane.take(3 * 4096).srcs.tolist() == [3, 4, 5]
    assert lane.take(3 * 4096).srcs.tolist() == [6]
    big = _raw(4096, range(10, 17))
    lane.queue_for(big).append(big)
    assert lane.take(3 * 4096).srcs.tolist() == [10, 11, 12]  # a large batch is split ...
    assert lane.count(restores=False) == 4  # ... and the rest stays queued
    mixed = _Lane("down")
    _queue(mixed, [4096, 8192, 4096, 4096, 16384])
    assert mixed.take(3 * 4096).srcs.tolist() == [0]  # other page sizes are not joined
    assert mixed.take(3 * 4096).srcs.tolist() == [1]
    assert mixed.take(3 * 4096).srcs.tolist() == [2, 3]
    assert mixed.take(3 * 4096).srcs.tolist() == [4]  # a page larger than a batch goes alone
    assert mixed.count(restores=False) == 0


def test_take_halves_the_end_of_a_final_queue_down_to_the_least() -> None:
    def sizes(final: bool) -> list[int]:
        lane = _Lane("down")
        _queue(lane, [4096] * 20)  # 20 pages, batches of 8, at least 2
        lane.queues[3][-1].final = final
        out = []
        while lane.count(restores=False):
            out.append(len(lane.take(8 * 4096, least_pages=2)))
        return out

    # 20 >= 16: a full batch; then half of 12, 6, 3 (at least 2) ...
    assert sizes(final=True) == [8, 6, 3, 2, 1]
    # ... but only once the producer is done: while it may queue more, full batches.
    assert sizes(final=False) == [8, 8, 4]
    lane = _Lane("down")
    _queue(lane, [4096] * 12)
    lane.queues[3][-1].final = True
    assert len(lane.take(8 * 4096, least_pages=8)) == 8  # a batch is the least: no halving


def test_batch_counters_count_bytes_of_successes_only() -> None:
    from kvtier.moves.completion import Completion
    from kvtier.state.placement import Placement
    from kvtier.stats import EngineCounters

    core = Placement.__new__(Placement)  # only the counters are needed
    core.counters = EngineCounters()
    completion = Completion.__new__(Completion)
    completion._place = core
    down = _raw(4096, range(3))
    completion._count(down, [True, True, True], 0.5)
    completion._count(down, [True, False, True], 0.25)
    c = core.counters.moved[DOWN]
    assert (c.bytes, c.pages, c.failures, c.batches) == (5 * 4096, 5, 1, 2)
    assert c.seconds == 0.75
    leftovers = Moves(Direction.CPU_TO_GPU, 4096, [0], [0])  # close()
    completion._count(leftovers, [False], 0.0)
    assert core.counters.moved[Direction.CPU_TO_GPU].failures == 1


def test_growing_chunks_start_with_two_batches_and_double() -> None:
    from kvtier.moves.starter import growing_chunks

    assert growing_chunks(16, 1) == [(0, 2), (2, 6), (6, 14), (14, 16)]
    assert growing_chunks(3, 4) == [(0, 3)]
    assert growing_chunks(0, 4) == []
