"""Lanes per GPU: one GPU's stuck or backlogged copies never delay another GPU's restore.

The scheduler routes GPU<->CPU batches by their device (``device_of``); here two named devices
(``gpu0`` the default, ``gpu1``) with real lane threads and handlers that record and may block.
"""

from __future__ import annotations

import threading

from kvtier.scheduler import TransferScheduler
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction

GPU1_FROM = 1000  # sources from here on are gpu1's pages


class Gated(TransferHandler):
    """Records every batch it copies; blocks each batch until its gate opens."""

    def __init__(self, name: str, log: list, gate: threading.Event) -> None:
        self.name, self.log, self.gate = name, log, gate

    def run(self, batch: Moves) -> list[bool]:
        assert self.gate.wait(10), f"{self.name} gate never opened"
        self.log.append((self.name, batch.srcs.tolist()))
        return [True] * len(batch)


def device_of(batch: Moves) -> str:
    return "gpu1" if batch.srcs[0] >= GPU1_FROM else "gpu0"


def mv(direction: Direction, srcs: range | list[int]) -> Moves:
    return Moves(direction, 4096, list(srcs), list(srcs))


def make(gpu1_gate: threading.Event, max_inflight: int = 1 << 20):
    """gpu0 (default, with the disk) copies at once; gpu1's copies wait for ``gpu1_gate``."""
    log: list = []
    done: list[int] = []
    lock = threading.Lock()
    free = threading.Event()
    free.set()

    def complete(batch: Moves, results: list[bool], seconds: float) -> None:
        with lock:
            done.extend(batch.srcs.tolist())

    gpu0 = {d: Gated(f"gpu0-{d.name}", log, free) for d in Direction}
    gpu1 = {
        d: Gated(f"gpu1-{d.name}", log, gpu1_gate)
        for d in (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU)
    }
    sched = TransferScheduler(
        gpu0, batch_bytes=4096, max_inflight_bytes=max_inflight, on_complete=complete,
        device="gpu0", gpus={"gpu1": gpu1}, device_of=device_of,
    )
    return sched, log, done


def wait_for(done: list[int], wanted: set[int], timeout: float = 10.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if wanted <= set(done):
            return
        deadline.wait(0.01)
    raise AssertionError(f"{sorted(wanted - set(done))} never completed; done: {done}")


def test_each_further_gpu_gets_its_own_up_and_down_lanes() -> None:
    sched, _log, _done = make(threading.Event())
    try:
        assert sched.lanes == ["up", "down", "disk", "up@gpu1", "down@gpu1"]
    finally:
        sched.close(0.1)


def test_a_stuck_gpu_does_not_delay_another_gpus_restore_or_offload() -> None:
    """gpu1's up and down lanes stay stuck on their first batches, with a backlog of offloads
    and a restore queued behind them: gpu0's restore and offload still complete, in order,
    with gpu1's work untouched until its gate opens."""
    gate = threading.Event()
    sched, log, done = make(gate)
    try:
        backlog = [mv(Direction.GPU_TO_CPU, [GPU1_FROM + i]) for i in range(50)]
        sched.submit([*backlog, mv(Direction.CPU_TO_GPU, [GPU1_FROM + 500])])
        sched.submit([mv(Direction.CPU_TO_GPU, [1, 2]), mv(Direction.GPU_TO_CPU, [3])])
        wait_for(done, {1, 2, 3})
        assert not [s for s in done if s >= GPU1_FROM]  # gpu1 still held
        assert ("gpu0-CPU_TO_GPU", [1]) in log  # gpu0's own handlers copied them
        assert ("gpu0-GPU_TO_CPU", [3]) in log
        gate.set()
        wait_for(done, {GPU1_FROM + i for i in range(50)} | {GPU1_FROM + 500})
        gpu1_names = {name for name, srcs in log if srcs[0] >= GPU1_FROM}
        assert gpu1_names == {"gpu1-GPU_TO_CPU", "gpu1-CPU_TO_GPU"}
    finally:
        gate.set()
        sched.close(2)


def test_one_gpus_batches_in_flight_leave_the_other_gpu_its_room() -> None:
    """The in-flight bound is per GPU: gpu1 holding a whole bound's worth of stuck batches
    does not make gpu0's restore wait for room."""
    gate = threading.Event()
    sched, _log, done = make(gate, max_inflight=2 * 4096)
    try:
        sched.submit([mv(Direction.GPU_TO_CPU, [GPU1_FROM + i]) for i in range(6)])
        sched.submit([mv(Direction.CPU_TO_GPU, [GPU1_FROM + 100 + i]) for i in range(6)])
        threading.Event().wait(0.1)  # gpu1's lanes fill their bound
        assert sched.inflight_bytes == 2 * 4096
        sched.submit([mv(Direction.CPU_TO_GPU, [7])])
        wait_for(done, {7})
    finally:
        gate.set()
        sched.close(2)


def test_a_batch_of_a_device_without_lanes_goes_to_the_default_lanes() -> None:
    sched, log, done = make(threading.Event())
    try:
        sched.submit([mv(Direction.CPU_TO_GPU, [5])])
        wait_for(done, {5})
        assert log == [("gpu0-CPU_TO_GPU", [5])]
    finally:
        sched.close(0.1)
