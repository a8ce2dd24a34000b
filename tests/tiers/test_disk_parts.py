"""A disk batch cut into parts run at once on the store's I/O threads: every page lands exactly
once, a bad page fails alone, and the batch completes only after every part (and the sync)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk_parts import Parts, split
from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Moves
from kvtier.transfer.disk import DiskRead, DiskWrite
from kvtier.types import Direction

PS = 8192


@given(
    runs=st.lists(st.integers(1, 40), min_size=0, max_size=6),
    part_pages=st.integers(0, 50),
)
def test_split_covers_each_page_once_in_whole_pages(runs: list[int], part_pages: int) -> None:
    coalesced, at = [], 0
    for i, n in enumerate(runs):  # run i: n pages at file slot 100 * i, buffer 1 MiB * i
        coalesced.append((100 * i * PS, (1 << 20) * i, n * PS, list(range(at, at + n))))
        at += n
    parts = split(coalesced, PS, part_pages * PS)
    assert sorted(p for part in parts for p in part[3]) == list(range(at))
    for offset, ptr, nbytes, positions in parts:
        assert nbytes == len(positions) * PS and 1 <= len(positions) <= max(1, part_pages)
        run = next(r for r in coalesced if positions[0] in r[3])
        skip = (positions[0] - run[3][0]) * PS  # a part stays one system call inside its run
        assert (offset, ptr) == (run[0] + skip, run[1] + skip)


def test_parts_finish_once_after_every_part_and_pass_errors_on() -> None:
    finished: list[int] = []
    parts = Parts(5, lambda: finished.append(1) or [True])
    threads = [threading.Thread(target=parts.done) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not parts.future.done() and not finished
    parts.done()
    assert parts.future.result(timeout=1) == [True] and finished == [1]

    failing = Parts(2, lambda: [True])
    failing.done(OSError("part 1"))
    assert not failing.future.done()
    failing.done()
    with pytest.raises(OSError, match="part 1"):
        failing.future.result(timeout=1)


def _rows(arena: HostArena, n: int) -> list[torch.Tensor]:
    slots = arena.alloc(PS, n)
    assert slots is not None
    return arena.rows(PS, slots)


@pytest.mark.parametrize("direct", [True, False])
def test_a_batch_of_many_parts_round_trips_and_a_bad_page_fails_alone(
    tmp_path: Path, direct: bool
) -> None:
    with (
        DiskStore(tmp_path, 1 << 20, direct_io=direct, io_threads=4, part_bytes=3 * PS) as store,
        HostArena(4 << 20, 1 << 20, pin=False) as arena,
    ):
        srcs, dsts = _rows(arena, 40), _rows(arena, 40)  # one run each: cut into 14 parts
        g = torch.Generator().manual_seed(5)
        for t in srcs:
            t.copy_(torch.randint(0, 256, (PS,), dtype=torch.uint8, generator=g))
        slots = store.alloc(PS, 40)
        assert slots is not None
        assert store.write(PS, slots, srcs).result(timeout=10) == [True] * 40
        with open(tmp_path / f"pages-{PS}.dat", "r+b") as fh:  # one flipped bit, mid-part
            fh.seek(slots[22] * PS + 7)
            byte = fh.read(1)[0]
            fh.seek(slots[22] * PS + 7)
            fh.write(bytes([byte ^ 1]))
        ok = store.read(PS, slots, dsts).result(timeout=10)
        assert ok == [i != 22 for i in range(40)]
        assert store.counters.checksum_failures == 1
        for i, (got, want) in enumerate(zip(dsts, srcs, strict=True)):
            assert torch.equal(got, want) or i == 22
        assert store.counters.bytes_read == 39 * PS


def test_the_disk_lane_handlers_keep_batches_in_flight(tmp_path: Path) -> None:
    """Two batches launched before either is waited for (as the disk lane does) each hold
    exactly their own pages."""
    with (
        DiskStore(tmp_path, 4 << 20, io_threads=2, part_bytes=PS) as store,
        HostArena(8 << 20, 1 << 20, pin=False) as arena,
    ):
        host = arena.alloc(PS, 96)
        assert host is not None
        for i, row in enumerate(arena.rows(PS, host)):
            row.fill_(i % 251)
        disk = store.alloc(PS, 48)
        assert disk is not None
        write, read = DiskWrite(arena, store), DiskRead(arena, store)
        assert write.depth > 1 and read.depth > 1
        halves = (slice(0, 24), slice(24, 48))
        waits = [
            write.launch(Moves(Direction.CPU_TO_DISK, PS, np.array(host[h]), np.array(disk[h])))
            for h in halves
        ]
        assert [w() for w in waits] == [[True] * 24] * 2
        back = host[48:]
        waits = [
            read.launch(Moves(Direction.DISK_TO_CPU, PS, np.array(disk[h]), np.array(back[h])))
            for h in halves
        ]
        assert [w() for w in waits] == [[True] * 24] * 2
        for i, row in enumerate(arena.rows(PS, back)):
            assert int(row.min()) == int(row.max()) == i % 251
