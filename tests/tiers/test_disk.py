"""DiskStore: durable checksummed pages, torn and corrupt bytes detected, index across restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.errors import FailedPrecondition, InvalidArgument
from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.diskio import probe_direct
from kvtier.tiers.pinned import HostArena

from .conftest import REPO, python_env

PS = 8192


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PS,), dtype=torch.uint8, generator=g) for _ in range(n)]


def store_pages(store: DiskStore, data: list[torch.Tensor], tag: str) -> list[DiskSlot]:
    slots = store.alloc(PS, len(data))
    assert slots is not None
    assert store.write(PS, slots, data).result(timeout=10) == [True] * len(data)
    for i, s in enumerate(slots):
        store.set_record(PS, s, DiskRecord(f"{tag}{i}".encode(), "t1", meta={"i": i}))
    return slots


def read_back(store: DiskStore, slots: list[DiskSlot]) -> tuple[list[bool], list[torch.Tensor]]:
    dsts = [torch.empty(PS, dtype=torch.uint8) for _ in slots]
    return store.read(PS, slots, dsts).result(timeout=10), dsts


@pytest.mark.parametrize("direct", [True, False])
def test_roundtrip_through_arena_rows(tmp_path: Path, direct: bool) -> None:
    with (
        DiskStore(tmp_path, 1 << 20, direct_io=direct) as store,
        HostArena(1 << 20, 64 << 10, pin=False) as arena,
    ):
        assert store.direct_io == (direct and probe_direct(str(tmp_path)))
        src_slots = arena.alloc(PS, 4)
        assert src_slots is not None
        srcs = arena.rows(PS, src_slots)
        for t, d in zip(srcs, pages(4, 1), strict=True):
            t.copy_(d)
        slots = store.alloc(PS, 4)
        assert slots == [0, 1, 2, 3]
        assert store.write(PS, slots, srcs).result(timeout=10) == [True] * 4
        dst_slots = arena.alloc(PS, 4)
        assert dst_slots is not None
        dsts = arena.rows(PS, dst_slots)
        assert store.read(PS, slots[::-1], dsts).result(timeout=10) == [True] * 4
        for got, want in zip(dsts, srcs[::-1], strict=True):
            assert torch.equal(got, want)
        assert store.counters.bytes_written == 4 * PS and store.counters.bytes_read == 4 * PS


def test_unaligned_buffers_bounce(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        backing = torch.zeros(2 * PS + 1, dtype=torch.uint8)
        src = backing[1 : PS + 1]
        src.copy_(pages(1, 2)[0])
        slots = store.alloc(PS, 1)
        assert slots is not None and src.data_ptr() % 4096 != 0
        assert store.write(PS, slots, [src]).result(timeout=10) == [True]
        dst = backing[PS + 1 :]
        assert store.read(PS, slots, [dst]).result(timeout=10) == [True]
        assert torch.equal(dst, src)


@pytest.mark.parametrize("direct", [True, False])
def test_page_size_not_a_multiple_of_4k_is_padded_on_disk(tmp_path: Path, direct: bool) -> None:
    """A registered pool's page need not be a multiple of 4 KiB (61 layers of 18 KiB MLA
    latents): its slots are padded to 4 KiB on disk, pages written and read exactly (from
    arena rows packed back to back, so no page but the first starts aligned), across a
    reopen, with checksums over the page's own bytes."""
    odd = 3 * 4096 + 100
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 256, (odd,), dtype=torch.uint8, generator=g) for _ in range(5)]
    backing = torch.empty(5 * odd, dtype=torch.uint8)
    rows = [backing[i * odd : (i + 1) * odd] for i in range(5)]
    for row, d in zip(rows, data, strict=True):
        row.copy_(d)
    with DiskStore(tmp_path, 1 << 20, direct_io=direct) as store:
        assert store.direct_io == (direct and probe_direct(str(tmp_path)))
        slots = store.alloc(odd, 5)
        assert slots == [0, 1, 2, 3, 4]
        assert store.reserved_bytes % 4096 == 0 and store.used_bytes == 5 * 4 * 4096
        assert store.write(odd, slots, rows).result(timeout=10) == [True] * 5
        for i, s in enumerate(slots):
            store.set_record(odd, s, DiskRecord(f"k{i}".encode(), "t1"))
        backing.zero_()
        assert store.read(odd, slots[::-1], rows).result(timeout=10) == [True] * 5
        assert all(torch.equal(r, d) for r, d in zip(rows, data[::-1], strict=True))
    assert os.path.getsize(tmp_path / f"pages-{odd}.dat") % (4 * 4096) == 0
    with DiskStore(tmp_path, 1 << 20, direct_io=direct) as store:
        assert sorted(str(r.key) for _, _, r in store.records()) == [
            str(f"k{i}".encode()) for i in range(5)]
        backing.zero_()
        assert store.read(odd, slots, rows).result(timeout=10) == [True] * 5
        assert all(torch.equal(r, d) for r, d in zip(rows, data, strict=True))


def test_budget_is_a_return_value(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 5 * PS, extent_bytes=1 << 20) as store:
        assert store.alloc(PS, 6) is None
        got = store.alloc(PS, 5)
        assert got == [0, 1, 2, 3, 4]
        assert store.alloc(PS, 1) is None
        assert os.path.getsize(tmp_path / f"pages-{PS}.dat") == 5 * PS
        assert store.alloc(16384, 1) is None  # budget is shared across page sizes
        store.free(PS, got[1:2])
        assert store.alloc(PS, 1) == [1]
        assert store.alloc(1000, 1) is None  # an odd size (padded to 4 KiB) shares the budget
        with pytest.raises(InvalidArgument):
            store.alloc(0, 1)


def test_unwritten_slot_is_never_good(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        slots = store.alloc(PS, 1)
        assert slots is not None
        assert read_back(store, slots)[0] == [False]
        assert store.counters.checksum_failures == 0
        with pytest.raises(FailedPrecondition):
            store.set_record(PS, slots[0], DiskRecord(b"k", "t"))


def test_flipped_bit_is_a_checksum_failure(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        data = pages(3, 3)
        slots = store_pages(store, data, "k")
        with open(tmp_path / f"pages-{PS}.dat", "r+b") as fh:
            fh.seek(slots[1] * PS + 100)
            byte = fh.read(1)[0]
            fh.seek(slots[1] * PS + 100)
            fh.write(bytes([byte ^ 0x10]))
        ok, dsts = read_back(store, slots)
        assert ok == [True, False, True]
        assert store.counters.checksum_failures == 1
        assert torch.equal(dsts[0], data[0]) and torch.equal(dsts[2], data[2])


def test_index_and_pages_survive_reopen(tmp_path: Path) -> None:
    data = pages(3, 4)
    with DiskStore(tmp_path, 1 << 20) as store:
        slots = store_pages(store, data, "k")
        store.clear_record(PS, slots[2])
    assert not (tmp_path / "index.json.tmp").exists()
    with DiskStore(tmp_path, 1 << 20) as store:
        recs = store.records()
        assert [(ps, s, r.key, r.tenant, r.meta) for ps, s, r in recs] == [
            (PS, 0, b"k0", "t1", {"i": 0}),
            (PS, 1, b"k1", "t1", {"i": 1}),
        ]
        ok, dsts = read_back(store, [DiskSlot(0), DiskSlot(1)])
        assert ok == [True, True]
        assert torch.equal(dsts[0], data[0]) and torch.equal(dsts[1], data[1])
        assert store.alloc(PS, 1) == [2]  # recorded slots stay allocated; slot 2 was unrecorded
        assert store.counters.dropped_records == 0


def test_truncated_file_drops_records(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20, extent_bytes=4 * PS) as store:
        store_pages(store, pages(4, 5), "k")
    os.truncate(tmp_path / f"pages-{PS}.dat", 2 * PS + 100)  # half of slot 2 survives
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.counters.dropped_records == 2
        assert [s for _, s, _ in store.records()] == [0, 1]
        assert read_back(store, [DiskSlot(0), DiskSlot(1)])[0] == [True, True]


def test_malformed_index_entries_are_dropped(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20) as store:
        store_pages(store, pages(2, 6), "k")
    doc = json.loads((tmp_path / "index.json").read_text())
    good = doc["records"]
    doc["records"] = [
        *good,
        {**good[0], "slot": 1},  # duplicate slot
        {**good[0], "checksum": "abc"},
        {**good[0], "checksum": -1},
        {**good[0], "checksum": 1 << 64},
        {**good[0], "key": "zz"},
        "junk",
    ]
    (tmp_path / "index.json").write_text(json.dumps(doc))
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.counters.dropped_records == 6
        assert len(store.records()) == 2


CHILD = r"""
import sys, torch
from kvtier.tiers.base import DiskRecord
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.diskio import probe_direct
PS = int(sys.argv[2])
store = DiskStore(sys.argv[1], 1 << 24)
slots = store.alloc(PS, 8)
g = torch.Generator().manual_seed(7)
data = [torch.randint(0, 256, (PS,), dtype=torch.uint8, generator=g) for _ in slots]
assert store.write(PS, slots, data).result() == [True] * 8
for i, s in enumerate(slots):
    store.set_record(PS, s, DiskRecord(bytes([i]), "t"))
store.persist()
victims = slots[:4]
n = 0
while True:  # overwrite the first four recorded pages forever, never persisting again
    for t in data[:4]:
        t.fill_(n % 251)
    assert store.write(PS, victims, data[:4]).result() == [True] * 4
    n += 1
    if n == 1:
        print("overwritten", flush=True)
"""


def test_sigkill_mid_write_never_yields_torn_pages(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), str(PS)],
        cwd=REPO,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "overwritten", proc.stderr.read()  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    g = torch.Generator().manual_seed(7)
    original = [torch.randint(0, 256, (PS,), dtype=torch.uint8, generator=g) for _ in range(8)]
    with DiskStore(tmp_path, 1 << 24) as store:
        assert [s for _, s, _ in store.records()] == list(range(8))
        ok, dsts = read_back(store, [DiskSlot(s) for s in range(8)])
        assert ok == [False] * 4 + [True] * 4  # rewritten or torn: never reported as good
        assert store.counters.checksum_failures == 4
        for i in range(4, 8):
            assert torch.equal(dsts[i], original[i])


def test_a_few_pages_of_many_sizes_cannot_take_the_disk(tmp_path: Path) -> None:
    """A page size's file grew by a whole extent (64 MiB) at its first page and never gave it
    back: one page each of a few sizes held the disk, and every other size got no slot. Files
    now double from their first page up to an extent."""
    with DiskStore(tmp_path, 64 << 20, extent_bytes=64 << 20) as store:
        for k in range(1, 9):
            assert store.alloc(k * PS, 1) is not None, k
        assert store.reserved_bytes == sum(k * PS for k in range(1, 9))
        got = [store.alloc(PS, 1) for _ in range(6)]  # the first size's file doubles: 2, 4, 8
        assert all(g is not None for g in got)
        assert os.path.getsize(tmp_path / f"pages-{PS}.dat") == 8 * PS
