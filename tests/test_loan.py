"""A lane on loan: the caller launches its own batches; the lane's thread completes them."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvtier.scheduler import TransferScheduler
from kvtier.transfer.base import Moves, Queued, TransferHandler
from kvtier.types import Direction


def until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class Device(TransferHandler):
    """A queueing handler: ``launch`` records the launching thread and returns at once; each
    batch's copies finish when the test says (``finish``) or at once with ``auto``."""

    depth = 2

    def __init__(self, direction: Direction, queued: bool = True, auto: bool = True) -> None:
        self.direction, self.queued, self.auto = direction, queued, auto
        self.launched: list[tuple[int, list[int]]] = []  # (thread id, sources)
        self.copies: list[threading.Event] = []

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()

    def launch(self, batch: Moves) -> Queued:
        copied = threading.Event()
        if self.auto:
            copied.set()
        self.launched.append((threading.get_ident(), batch.srcs.tolist()))
        self.copies.append(copied)
        n = len(batch)
        return Queued(lambda: [True] * n if copied.wait(10) else [False] * n, copied.is_set)

    def finish(self, i: int) -> None:
        self.copies[i].set()


def mv(direction: Direction, srcs: range, copy: bool = True) -> Moves:
    batch = Moves(direction, 4096, list(srcs), list(srcs))
    batch.copy, batch.results = copy, [None] * len(batch)
    return batch


@pytest.fixture
def lanes():
    made: list[TransferScheduler] = []

    def make(down: Device, max_inflight: int = 1 << 20) -> tuple[TransferScheduler, list]:
        completed: list[tuple[int, list[int]]] = []  # (thread id, sources), in order
        handlers: dict[Direction, TransferHandler] = {
            d: Device(d) for d in Direction if d is not Direction.GPU_TO_CPU
        }
        handlers[Direction.GPU_TO_CPU] = down
        sched = TransferScheduler(
            handlers, batch_bytes=min(1 << 20, max_inflight), max_inflight_bytes=max_inflight,
            on_complete=lambda b, rs, s: completed.append((threading.get_ident(), b.srcs.tolist())),
        )
        made.append(sched)
        return sched, completed

    yield make
    for sched in made:
        sched.close(1)


def test_the_caller_launches_waits_and_completes_its_batches_in_order(lanes):
    down = Device(Direction.GPU_TO_CPU)
    sched, completed = lanes(down)
    me = threading.get_ident()
    with sched.lend(Direction.GPU_TO_CPU, None) as loan:
        assert loan.lent
        batches = [mv(Direction.GPU_TO_CPU, range(i, i + 3)) for i in (0, 3, 6)]
        assert all(loan.launch(b) for b in batches)
        assert sched.inflight_bytes == 6 * 4096 and len(completed) == 1  # depth 2: one reused
    assert [t for t, _ in down.launched] == [me] * 3
    assert completed == [(me, [0, 1, 2]), (me, [3, 4, 5]), (me, [6, 7, 8])]
    assert sched.inflight_bytes == 0 and not loan.lent
    sched.submit([mv(Direction.GPU_TO_CPU, range(9, 11), copy=False)])  # the lane's own again
    until(lambda: len(completed) == 4, "the lane's batch")
    assert down.launched[3][0] != me and completed[3][0] != me


def test_no_loan_from_a_handler_that_copies_in_launch_or_a_busy_lane(lanes):
    sched, _ = lanes(Device(Direction.GPU_TO_CPU, queued=False))
    with sched.lend(Direction.GPU_TO_CPU, None) as loan:
        assert not loan.lent and not loan.launch(mv(Direction.GPU_TO_CPU, range(2)))

    down = Device(Direction.GPU_TO_CPU, auto=False)
    sched, completed = lanes(down)
    sched.submit([mv(Direction.GPU_TO_CPU, range(2), copy=False)])
    until(lambda: len(down.launched) == 1, "the lane's own launch")
    with sched.lend(Direction.GPU_TO_CPU, None) as loan:
        assert not loan.lent  # a batch of its own is in flight
    down.finish(0)
    until(lambda: len(completed) == 1, "its completion")
    with sched.lend(Direction.GPU_TO_CPU, None) as loan:
        assert loan.lent
    with sched.restore_first(), sched.lend(Direction.GPU_TO_CPU, None) as loan:
        assert not loan.lent  # an acquire waits for a restore: offloads keep to the lane
    with sched.restore_first(), sched.lend(Direction.CPU_TO_GPU, None) as loan:
        assert loan.lent  # a restore's own lane is lent


def test_work_queued_by_another_caller_ends_the_loan_and_the_lane_takes_it(lanes):
    down = Device(Direction.GPU_TO_CPU)
    sched, completed = lanes(down)
    me = threading.get_ident()
    loan = sched.lend(Direction.GPU_TO_CPU, None)
    assert loan.launch(mv(Direction.GPU_TO_CPU, range(2)))
    sched.submit([mv(Direction.GPU_TO_CPU, range(10, 12), copy=False)])
    threading.Event().wait(0.05)
    assert len(down.launched) == 1  # the lane waits while it is lent
    assert not loan.launch(mv(Direction.GPU_TO_CPU, range(2, 4)))  # the loan ends here
    assert not loan.lent and completed[0] == (me, [0, 1])
    until(lambda: len(completed) == 2, "the queued batch")
    assert [s for _, s in down.launched] == [[0, 1], [10, 11]]
    assert down.launched[1][0] != me and completed[1][0] != me


def test_a_turn_whose_buffers_are_in_use_pauses_the_caller(lanes):
    down = Device(Direction.GPU_TO_CPU, auto=False)
    sched, completed = lanes(down)
    pauses: list[int] = []

    def pause() -> None:
        pauses.append(1)
        if len(pauses) == 3:
            down.finish(0)  # the first batch's copies land while the caller pauses
        threading.Event().wait(0.001)

    with sched.lend(Direction.GPU_TO_CPU, None, pause) as loan:
        assert loan.launch(mv(Direction.GPU_TO_CPU, range(0, 2)))
        assert loan.launch(mv(Direction.GPU_TO_CPU, range(2, 4)))
        assert not pauses and not completed
        assert loan.launch(mv(Direction.GPU_TO_CPU, range(4, 6)))  # reuses the first's turn
        assert len(pauses) == 3 and len(down.launched) == 3
        assert [s for _, s in completed] == [[0, 1]]  # completed before the turn was reused
        for i in (1, 2):
            down.finish(i)
    assert [s for _, s in completed] == [[0, 1], [2, 3], [4, 5]]


def test_no_room_in_flight_ends_the_loan(lanes):
    down = Device(Direction.GPU_TO_CPU, auto=False)
    sched, completed = lanes(down, max_inflight=3 * 4096)
    loan = sched.lend(Direction.GPU_TO_CPU, None)
    assert loan.launch(mv(Direction.GPU_TO_CPU, range(2)))  # 8 KiB in flight
    threading.Timer(0.05, down.finish, (0,)).start()
    assert not loan.launch(mv(Direction.GPU_TO_CPU, range(2, 4)))  # 16 KiB would not fit
    assert not loan.lent and len(completed) == 1 and sched.inflight_bytes == 0


def test_a_pause_that_raises_still_completes_the_loans_batches(lanes):
    down = Device(Direction.GPU_TO_CPU, auto=False)
    sched, completed = lanes(down)

    def pause() -> None:
        threading.Timer(0.05, down.finish, (0,)).start()
        raise KeyboardInterrupt

    loan = sched.lend(Direction.GPU_TO_CPU, None, pause)
    assert loan.launch(mv(Direction.GPU_TO_CPU, range(2)))
    with pytest.raises(KeyboardInterrupt):
        loan.give_back()
    assert completed and completed[0][1] == [0, 1]  # waited for, completed all the same
    assert sched.inflight_bytes == 0 and not loan.lent
    sched.submit([mv(Direction.GPU_TO_CPU, range(2, 4), copy=False)])
    until(lambda: len(down.launched) == 2, "the lane's own launch after the loan")
    down.finish(1)
    until(lambda: len(completed) == 2, "its completion")
