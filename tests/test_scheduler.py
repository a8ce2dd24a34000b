"""Restore-first ordering, batching and cancellation of the transfer scheduler."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from kvtier.scheduler import TransferScheduler
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction


class Gated(TransferHandler):
    """Records batches; the first batch blocks until the gate opens (keeps the lane busy)."""

    def __init__(self, direction: Direction, log: list, gate: threading.Event) -> None:
        self.direction, self.log, self.gate = direction, log, gate

    def run(self, batch: Moves) -> list[bool]:
        self.gate.wait(10)
        self.log.append((self.direction, list(batch.srcs)))
        return [True] * len(batch)


def mv(direction: Direction, srcs: range | list[int], urgent: bool = False, pages=()) -> Moves:
    """A raw batch copying ``srcs`` to the same slot numbers."""
    return Moves(direction, 4096, list(srcs), list(srcs), list(pages), urgent=urgent)


def wait_taken(sched: TransferScheduler) -> None:
    """Wait (bounded) until the lane has taken everything queued so far."""
    for _ in range(1000):
        if sched.depth() == (0, 0):
            return
        threading.Event().wait(0.005)
    raise AssertionError("lane never took the first batch")


def make(gate: threading.Event, batch_bytes: int = 4096,
         gated: tuple[Direction, ...] = tuple(Direction)):
    """A scheduler whose ``gated`` directions block on ``gate``; the others run at once."""
    log: list = []
    done: list[int] = []  # sources of completed columns
    open_gate = threading.Event()
    open_gate.set()
    handlers = {d: Gated(d, log, gate if d in gated else open_gate) for d in Direction}
    sched = TransferScheduler(
        handlers,
        batch_bytes=batch_bytes,
        max_inflight_bytes=1 << 20,
        on_complete=lambda b, rs, s: done.extend(b.srcs),
    )
    return sched, log, done


def test_queued_restore_goes_before_queued_offloads_on_the_shared_disk_lane():
    gate = threading.Event()
    sched, log, done = make(gate)
    try:
        sched.submit([mv(Direction.CPU_TO_DISK, [0])])  # occupies the lane
        wait_taken(sched)
        sched.submit([mv(Direction.CPU_TO_DISK, [i]) for i in range(1, 20)])
        sched.submit([mv(Direction.DISK_TO_CPU, [99])])
        gate.set()
        while len(done) < 21:
            threading.Event().wait(0.01)
        order = [src for _, srcs in log for src in srcs]
        assert order[0] == 0 and order[1] == 99, order  # the restore overtook 19 queued offloads
    finally:
        sched.close(1)


def test_restore_lane_is_not_blocked_by_an_offload_backlog():
    """The offload lane stays stuck on its first batch while a restore is submitted: the
    restore must finish anyway, with the offload backlog still queued."""
    gate = threading.Event()
    sched, _log, done = make(gate, gated=(Direction.GPU_TO_CPU,))
    try:
        sched.submit([mv(Direction.GPU_TO_CPU, range(50))])
        for _ in range(1000):  # until the offload lane holds a batch (blocked on the gate)
            if sched.depth()[1] < 50:
                break
            threading.Event().wait(0.005)
        sched.submit([mv(Direction.CPU_TO_GPU, [777])])
        for _ in range(2000):
            if 777 in done:
                break
            threading.Event().wait(0.005)
        assert done == [777], done  # no offload finished: the restore did not wait behind them
        assert sched.depth()[0] == 0 and sched.depth()[1] > 0
    finally:
        gate.set()
        sched.close(1)


def test_urgent_offload_jumps_the_offload_queue_and_batches_respect_bytes():
    gate = threading.Event()
    sched, log, done = make(gate, batch_bytes=3 * 4096)
    try:
        sched.submit([mv(Direction.GPU_TO_CPU, [0])])
        wait_taken(sched)
        sched.submit([mv(Direction.GPU_TO_CPU, [i]) for i in range(1, 7)])
        sched.submit([mv(Direction.GPU_TO_CPU, [42], urgent=True)])
        gate.set()
        while len(done) < 8:
            threading.Event().wait(0.01)
        batches = [srcs for d, srcs in log if d is Direction.GPU_TO_CPU]
        assert batches[1][0] == 42
        assert all(len(b) <= 3 for b in batches)
    finally:
        sched.close(1)


def test_cancel_removes_a_queued_column_and_close_fails_the_rest():
    gate = threading.Event()
    sched, _log, done = make(gate)
    pages = [10, 11, 12, 13]  # page-table rows
    sched.submit([mv(Direction.GPU_TO_CPU, [0])])
    wait_taken(sched)
    queued = mv(Direction.GPU_TO_CPU, range(1, 4), pages=pages[1:])
    sched.submit([queued])
    assert cols(sched.cancel(queued, np.array([pages[1], 99]))) == [[11], [1], [1]]
    assert cols(sched.cancel(queued, np.array([pages[1]]))) == [[], [], []]
    assert sched.depth() == (0, 2)
    gate.set()
    sched.close(2)
    assert 1 not in done and {2, 3} <= set(done)


def test_a_taken_batch_can_no_longer_be_cancelled():
    gate = threading.Event()
    sched, _log, done = make(gate, batch_bytes=2 * 4096)
    pages = [10, 11, 12, 13]  # page-table rows
    batch = mv(Direction.GPU_TO_CPU, range(4), pages=pages)
    sched.submit([batch])
    wait_taken_some(sched, 2)
    assert cols(sched.cancel(batch, np.array([pages[0]]))) == [[], [], []]  # split off, taken
    assert cols(sched.cancel(batch, np.array([pages[3]]))) == [[13], [3], [3]]  # still queued
    gate.set()
    sched.close(2)
    assert sorted(done) == [0, 1, 2]


def cols(got: tuple[np.ndarray, ...]) -> list[list[int]]:
    return [a.tolist() for a in got]


def wait_taken_some(sched: TransferScheduler, left: int) -> None:
    for _ in range(1000):
        if sched.depth()[1] == left:
            return
        threading.Event().wait(0.005)
    raise AssertionError("lane never took the first batch")


def test_completed_batches_belong_to_the_engine():
    """on_complete may change a batch at once: in-flight bytes are counted without it."""
    done = threading.Event()
    seen: list[int] = []

    def reuse(batch: Moves, results: list[bool], seconds: float) -> None:
        seen.extend(batch.srcs)
        batch.page_size, batch.direction = 1 << 30, Direction.CPU_TO_DISK
        if len(seen) == 8:
            done.set()

    gate = threading.Event()
    gate.set()
    handlers = {d: Gated(d, [], gate) for d in Direction}
    sched = TransferScheduler(
        handlers, batch_bytes=2 * 4096, max_inflight_bytes=1 << 20, on_complete=reuse
    )
    try:
        sched.submit([mv(Direction.GPU_TO_CPU, range(8))])
        assert done.wait(10)
        for _ in range(1000):
            if sched.inflight_bytes == 0:
                break
            threading.Event().wait(0.005)
        assert sched.inflight_bytes == 0 and sorted(seen) == list(range(8))
    finally:
        sched.close(1)


def test_a_lane_keeps_copying_while_completions_are_refused_and_completes_in_order():
    """try_complete refusing (the engine lock is held) defers completions; copies go on."""
    held = threading.Event()
    held.set()
    refused: list[int] = []
    completed: list[int] = []

    def try_complete(batch: Moves, results: list[bool], seconds: float) -> bool:
        if held.is_set():
            refused.append(int(batch.srcs[0]))
            return False
        completed.extend(batch.srcs.tolist())
        return True

    def complete(batch: Moves, results: list[bool], seconds: float) -> None:
        while held.is_set():  # blocks as an acquire of the held lock would
            threading.Event().wait(0.005)
        completed.extend(batch.srcs.tolist())

    log: list = []
    gate = threading.Event()
    gate.set()
    handlers = {d: Gated(d, log, gate) for d in Direction}
    sched = TransferScheduler(
        handlers,
        batch_bytes=4096,
        max_inflight_bytes=1 << 20,
        on_complete=complete,
        try_complete=try_complete,
    )
    try:
        sched.submit([mv(Direction.GPU_TO_CPU, range(6))])
        for _ in range(1000):  # every batch copied while none could be completed
            if len(log) == 6:
                break
            threading.Event().wait(0.005)
        assert len(log) == 6 and refused and not completed
        held.clear()
        for _ in range(1000):
            if sched.inflight_bytes == 0 and len(completed) == 6:
                break
            threading.Event().wait(0.005)
        assert completed == list(range(6))  # in launch order
    finally:
        sched.close(1)


class InFlight(TransferHandler):
    """Counts batches launched and not yet waited for; its copies take a moment each."""

    depth = 3

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.lock = threading.Lock()
        self.now = self.most = 0

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()

    def launch(self, batch: Moves):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

        def wait() -> list[bool]:
            threading.Event().wait(0.002)
            with self.lock:
                self.now -= 1
            return [True] * len(batch)

        return wait


def _most_in_flight(restoring: bool, urgent: bool) -> int:
    handlers = {d: InFlight(d) for d in Direction}
    done: list[int] = []
    sched = TransferScheduler(
        handlers,
        batch_bytes=4096,
        max_inflight_bytes=1 << 20,
        on_complete=lambda b, rs, s: done.extend(b.srcs),
    )
    try:
        with sched.restore_first() if restoring else contextlib.nullcontext():
            sched.submit([mv(Direction.GPU_TO_CPU, [i], urgent=urgent) for i in range(12)])
            for _ in range(1000):
                if len(done) == 12:
                    break
                threading.Event().wait(0.005)
        assert sorted(done) == list(range(12))
        return handlers[Direction.GPU_TO_CPU].most
    finally:
        sched.close(1)


def test_plain_offloads_go_one_batch_at_a_time_while_a_restore_is_waited_for():
    assert _most_in_flight(restoring=False, urgent=False) == 3  # the handler's depth
    assert _most_in_flight(restoring=True, urgent=False) == 1
    assert _most_in_flight(restoring=True, urgent=True) == 3  # they make room for it


class Stepped(TransferHandler):
    """Each launched batch's copy ends when the test says so; tells when a lane waits on one."""

    depth = 3

    def __init__(self) -> None:
        self.launched: list[int] = []
        self.waiting = threading.Event()
        self.finish = threading.Event()

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()

    def launch(self, batch: Moves):
        self.launched.append(int(batch.srcs[0]))

        def wait() -> list[bool]:
            self.waiting.set()
            self.finish.wait(10)
            return [True] * len(batch)

        return wait


def test_work_queued_while_a_lane_waits_is_launched_without_waiting_for_the_engine_lock():
    """The lane waited on its only batch; a second one was queued meanwhile and a caller
    holds the engine lock: the lane launches the second instead of blocking on the lock."""
    held = threading.Event()
    held.set()
    completed: list[int] = []

    def try_complete(batch: Moves, results: list[bool], seconds: float) -> bool:
        if held.is_set():
            return False
        completed.extend(batch.srcs.tolist())
        return True

    def complete(batch: Moves, results: list[bool], seconds: float) -> None:
        while held.is_set():
            threading.Event().wait(0.005)
        completed.extend(batch.srcs.tolist())

    handler = Stepped()
    sched = TransferScheduler(
        {d: handler for d in Direction},
        batch_bytes=4096,
        max_inflight_bytes=1 << 20,
        on_complete=complete,
        try_complete=try_complete,
    )
    try:
        sched.submit([mv(Direction.CPU_TO_GPU, [1])])
        assert handler.waiting.wait(10)  # the lane waits on batch 1's copy
        sched.submit([mv(Direction.CPU_TO_GPU, [2])])
        handler.finish.set()  # batch 1 copied; its completion cannot run (lock held)
        for _ in range(1000):
            if len(handler.launched) == 2:
                break
            threading.Event().wait(0.005)
        assert handler.launched == [1, 2] and not completed
        held.clear()
        for _ in range(1000):
            if len(completed) == 2:
                break
            threading.Event().wait(0.005)
        assert completed == [1, 2]
    finally:
        held.clear()  # a failed run must not leave close() blocked in ``complete``
        sched.close(1)


def _runs(thread_name: str) -> int | None:
    """How many times the named thread has been put on a CPU (Linux schedstat), or None."""
    tid = next(t.native_id for t in threading.enumerate() if t.name == thread_name)
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[2])
    except (OSError, IndexError, ValueError):
        return None


def until(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        threading.Event().wait(0.005)
    raise AssertionError(what)


def test_idle_lanes_sleep_through_another_lanes_batches():
    """Fifty offload batches, one after another, complete on the down lane: the idle up and
    disk lanes are not woken for them (each wake-up would take the interpreter from the
    working lanes; the old shared condition woke both at every submit and completion)."""
    gate = threading.Event()
    gate.set()
    sched, _log, done = make(gate)
    try:
        before = {n: _runs(n) for n in ("kvtier-up", "kvtier-disk")}
        if None in before.values():
            pytest.skip("no per-thread schedstat on this system")
        for i in range(50):
            sched.submit([mv(Direction.GPU_TO_CPU, [i])])
            until(lambda n=i + 1: len(done) == n, "offload never completed")
        sched.submit([mv(Direction.CPU_TO_GPU, [1000])])  # the up lane still wakes for its own
        until(lambda: 1000 in done, "restore never completed")
        woke = {n: _runs(n) - before[n] for n in before}  # type: ignore[operator]
        assert woke["kvtier-disk"] <= 2 and woke["kvtier-up"] <= 4, woke
    finally:
        sched.close(1)


def test_a_lane_waiting_for_room_in_flight_wakes_when_another_lane_frees_it():
    gate = threading.Event()
    log: list = []
    done: list[int] = []
    sched = TransferScheduler(
        {d: Gated(d, log, gate) for d in Direction},
        batch_bytes=4096,
        max_inflight_bytes=4096,  # one batch in flight across all lanes
        on_complete=lambda b, rs, s: done.extend(b.srcs),
    )
    try:
        sched.submit([mv(Direction.GPU_TO_CPU, [1])])
        until(lambda: sched.inflight_bytes == 4096, "offload never launched")
        sched.submit([mv(Direction.CPU_TO_GPU, [2])])  # no room: the up lane waits
        threading.Event().wait(0.05)
        assert done == [] and sched.depth() == (1, 0)
        gate.set()  # the offload completes, its room goes to the waiting restore
        until(lambda: done == [1, 2], f"restore never ran after the room freed: {done}")
    finally:
        sched.close(1)
