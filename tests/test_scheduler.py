"""Restore-first ordering, batching and cancellation of the transfer scheduler."""

from __future__ import annotations

import threading

from kvtier.scheduler import TransferScheduler
from kvtier.transfer.base import Move, TransferHandler
from kvtier.types import Direction


class Gated(TransferHandler):
    """Records batches; the first batch blocks until the gate opens (keeps the lane busy)."""

    def __init__(self, direction: Direction, log: list, gate: threading.Event) -> None:
        self.direction, self.log, self.gate = direction, log, gate

    def run(self, moves: list[Move]) -> list[bool]:
        self.gate.wait(10)
        self.log.append((self.direction, [m.src for m in moves]))
        return [True] * len(moves)


def wait_taken(sched: TransferScheduler) -> None:
    """Wait (bounded) until the lane has taken everything queued so far."""
    for _ in range(1000):
        if sched.depth() == (0, 0):
            return
        threading.Event().wait(0.005)
    raise AssertionError("lane never took the first batch")


def make(gate: threading.Event, batch_bytes: int = 4096):
    log: list = []
    done: list[Move] = []
    handlers = {d: Gated(d, log, gate) for d in Direction}
    sched = TransferScheduler(
        handlers,
        batch_bytes=batch_bytes,
        max_inflight_bytes=1 << 20,
        on_complete=lambda ms, rs, s: done.extend(ms),
    )
    return sched, log, done


def test_queued_restore_goes_before_queued_offloads_on_the_shared_disk_lane():
    gate = threading.Event()
    sched, log, done = make(gate)
    try:
        sched.submit([Move(Direction.CPU_TO_DISK, 4096, 0, 0)])  # occupies the lane
        wait_taken(sched)
        sched.submit([Move(Direction.CPU_TO_DISK, 4096, i, i) for i in range(1, 20)])
        sched.submit([Move(Direction.DISK_TO_CPU, 4096, 99, 99)])
        gate.set()
        while len(done) < 21:
            threading.Event().wait(0.01)
        order = [src for _, srcs in log for src in srcs]
        assert order[0] == 0 and order[1] == 99, order  # the restore overtook 19 queued offloads
    finally:
        sched.close(1)


def test_restore_lane_is_not_blocked_by_an_offload_backlog():
    gate = threading.Event()
    sched, _log, done = make(gate)
    try:
        sched.submit([Move(Direction.GPU_TO_CPU, 4096, i, i) for i in range(50)])
        restore = Move(Direction.CPU_TO_GPU, 4096, 7, 7)
        gate.set()
        sched.submit([restore])
        while restore not in done:
            threading.Event().wait(0.001)
        assert sched.depth()[0] == 0
    finally:
        sched.close(1)


def test_urgent_offload_jumps_the_offload_queue_and_batches_respect_bytes():
    gate = threading.Event()
    sched, log, done = make(gate, batch_bytes=3 * 4096)
    try:
        sched.submit([Move(Direction.GPU_TO_CPU, 4096, 0, 0)])
        wait_taken(sched)
        sched.submit([Move(Direction.GPU_TO_CPU, 4096, i, i) for i in range(1, 7)])
        sched.submit([Move(Direction.GPU_TO_CPU, 4096, 42, 42, urgent=True)])
        gate.set()
        while len(done) < 8:
            threading.Event().wait(0.01)
        batches = [srcs for d, srcs in log if d is Direction.GPU_TO_CPU]
        assert batches[1][0] == 42
        assert all(len(b) <= 3 for b in batches)
    finally:
        sched.close(1)


def test_cancel_removes_a_queued_move_and_close_fails_the_rest():
    gate = threading.Event()
    sched, _log, done = make(gate)
    first = Move(Direction.GPU_TO_CPU, 4096, 0, 0)
    queued = [Move(Direction.GPU_TO_CPU, 4096, i, i) for i in range(1, 4)]
    sched.submit([first])
    wait_taken(sched)
    sched.submit(queued)
    assert sched.cancel(queued[0]) is True
    assert sched.cancel(queued[0]) is False
    gate.set()
    sched.close(2)
    assert queued[0] not in done
    assert {id(m) for m in done} >= {id(m) for m in queued[1:]}


def test_completed_moves_belong_to_the_engine():
    """on_complete may reuse a batch's moves at once: in-flight bytes are counted without them."""
    done = threading.Event()
    seen: list[int] = []

    def reuse(moves: list[Move], results: list[bool], seconds: float) -> None:
        seen.extend(m.src for m in moves)
        for m in moves:  # as the engine does with spare moves
            m.page_size, m.direction = 1 << 30, Direction.CPU_TO_DISK
        if len(seen) == 8:
            done.set()

    gate = threading.Event()
    gate.set()
    handlers = {d: Gated(d, [], gate) for d in Direction}
    sched = TransferScheduler(
        handlers, batch_bytes=2 * 4096, max_inflight_bytes=1 << 20, on_complete=reuse
    )
    try:
        sched.submit([Move(Direction.GPU_TO_CPU, 4096, i, i) for i in range(8)])
        assert done.wait(10)
        for _ in range(1000):
            if sched.inflight_bytes == 0:
                break
            threading.Event().wait(0.005)
        assert sched.inflight_bytes == 0 and sorted(seen) == list(range(8))
    finally:
        sched.close(1)
