"""The disk index journal: records survive kill -9 without a persist, torn tails are ignored,
drops replay, old generations are skipped, and the tier's files are private whatever the umask."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk_index import load_index
from kvtier.tiers.disk_journal import FRAME, HEADER, Journal, frame, journal_files, replay

from .conftest import REPO, python_env

PS = 8192

# Records 8 pages, forgets slot 7's record, then waits to be killed: it never persists or closes.
CHILD = r"""
import sys, time, torch
from kvtier.tiers.base import DiskRecord
from kvtier.tiers.disk import DiskStore
PS = int(sys.argv[2])
store = DiskStore(sys.argv[1], 1 << 24)
slots = store.alloc(PS, 8)
g = torch.Generator().manual_seed(11)
data = [torch.randint(0, 256, (PS,), dtype=torch.uint8, generator=g) for _ in slots]
assert store.write(PS, slots, data).result() == [True] * 8
for i, s in enumerate(slots):
    store.set_record(PS, s, DiskRecord(bytes([i]), "t", meta={"i": i}))
store.clear_record(PS, slots[7])
time.sleep(0.1)  # the journal writes its buffer out every 10 ms
print("recorded", flush=True)
time.sleep(600)
"""


def original(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (PS,), dtype=torch.uint8, generator=g) for _ in range(n)]


def killed_child(path: Path) -> None:
    """Run CHILD in ``path`` and kill -9 it once it has recorded its pages."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(PS)],
        cwd=REPO, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "recorded", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def check_pages(store: DiskStore, n: int) -> None:
    """Slots 0..n-1 are recorded and read back exactly as written."""
    recs = store.records()
    assert [(s, r.key, r.meta) for _, s, r in recs] == [(i, bytes([i]), {"i": i}) for i in range(n)]
    dsts = [torch.empty(PS, dtype=torch.uint8) for _ in range(n)]
    slots = [DiskSlot(i) for i in range(n)]
    assert store.read(PS, slots, dsts).result(timeout=10) == [True] * n
    for got, want in zip(dsts, original(n), strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def killed(tmp_path: Path) -> Iterator[Path]:
    killed_child(tmp_path)
    yield tmp_path


def test_records_survive_kill_without_persist(killed: Path) -> None:
    assert load_index(str(killed))[0] == []  # nothing came from a snapshot
    with DiskStore(killed, 1 << 24) as store:
        check_pages(store, 7)  # slot 7's drop replayed too
        assert store.alloc(PS, 1) == [7]
        assert store.counters.dropped_records == 0
    # reopening compacted: the snapshot holds the records, only a fresh journal is left
    assert len(load_index(str(killed))[0]) == 7
    assert len(journal_files(str(killed))) == 1


@pytest.mark.parametrize("tail", ["garbage", "torn", "bad_checksum"])
def test_torn_or_garbage_tail_is_ignored(killed: Path, tail: str) -> None:
    [(_, path)] = journal_files(str(killed))
    extra = frame({"op": "drop", "page_size": PS, "slot": 0})  # would forget slot 0 if applied
    with open(path, "ab") as fh:
        if tail == "garbage":
            fh.write(os.urandom(3) + extra)
        elif tail == "torn":
            fh.write(extra[:-3])
        else:
            fh.write(extra[:-1] + bytes([extra[-1] ^ 1]))
    with DiskStore(killed, 1 << 24) as store:
        check_pages(store, 7)


def test_malformed_record_is_dropped_and_replay_goes_on(killed: Path) -> None:
    [(_, path)] = journal_files(str(killed))
    with open(path, "ab") as fh:
        fh.write(frame({"op": "put", "page_size": PS, "slot": 9, "checksum": -1}))
        fh.write(frame({"op": "drop", "page_size": PS, "slot": 6}))
    with DiskStore(killed, 1 << 24) as store:
        check_pages(store, 6)
        assert store.counters.dropped_records == 1


def test_journal_older_than_the_snapshot_is_not_replayed(tmp_path: Path) -> None:
    data = original(2)
    with DiskStore(tmp_path, 1 << 24) as store:
        slots = store.alloc(PS, 2)
        assert slots is not None
        assert store.write(PS, slots, data).result(timeout=10) == [True, True]
        for i, s in enumerate(slots):
            store.set_record(PS, s, DiskRecord(bytes([i]), "t", meta={"i": i}))
    snapshot_gen = load_index(str(tmp_path))[2]
    # a crash between saving a snapshot and deleting the journal it contains leaves this behind
    stale = tmp_path / f"journal-{snapshot_gen - 1}.log"
    from kvtier.tiers.disk_journal import MAGIC, VERSION

    stale.write_bytes(
        HEADER.pack(MAGIC, VERSION, 0, snapshot_gen - 1)
        + frame({"op": "drop", "page_size": PS, "slot": 0})
    )
    with DiskStore(tmp_path, 1 << 24) as store:
        check_pages(store, 2)
    assert not stale.exists()


def test_compaction_keeps_records_and_bounds_the_journal(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 24) as store:
        slots = store.alloc(PS, 2)
        assert slots is not None
        assert store.write(PS, slots, original(2)).result(timeout=10) == [True, True]
        for _ in range(3):
            for i, s in enumerate(slots):
                store.set_record(PS, s, DiskRecord(bytes([i]), "t", meta={"i": i}))
        store.compact()
        [(gen, path)] = journal_files(str(tmp_path))
        assert os.path.getsize(path) == 16  # just the header
        assert load_index(str(tmp_path))[2] == gen
    with DiskStore(tmp_path, 1 << 24) as store:
        check_pages(store, 2)


def test_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o777)
        with DiskStore(tmp_path / "fresh", 1 << 24) as store:
            slots = store.alloc(PS, 1)
            assert slots is not None
            assert store.write(PS, slots, original(1)).result(timeout=10) == [True]
            store.set_record(PS, slots[0], DiskRecord(b"k", "t"))
            store.persist()
        with DiskStore(shared, 1 << 24):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700
    assert stat.S_IMODE(shared.stat().st_mode) == 0o750
    names = sorted(p.name for p in (tmp_path / "fresh").iterdir())
    assert "index.json" in names and f"pages-{PS}.dat" in names
    assert any(n.startswith("journal-") for n in names)
    for p in (tmp_path / "fresh").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name


OPS = st.lists(
    st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, (1 << 64) - 1)), max_size=30
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, cut=st.floats(0, 1), garbage=st.binary(max_size=24))
def test_replay_of_any_cut_matches_a_dict_model(
    ops: list[tuple[bool, int, int]], cut: float, garbage: bytes
) -> None:
    """Cutting the journal anywhere (plus garbage) replays exactly the records wholly before the
    cut, applied in order to a plain dict."""
    with tempfile.TemporaryDirectory() as d:
        j = Journal(d, 1)
        for put, slot, checksum in ops:
            if put:
                j.put(PS, DiskSlot(slot), DiskRecord(b"k%d" % slot, "t", checksum))
            else:
                j.drop(PS, DiskSlot(slot))
        j.close()
        [(_, path)] = journal_files(d)
        data = Path(path).read_bytes()
        ends, pos = [], HEADER.size
        while pos < len(data):
            pos += FRAME.size + FRAME.unpack_from(data, pos)[0]
            ends.append(pos)
        keep = int(cut * len(data))
        Path(path).write_bytes(data[:keep] + garbage)
        model: dict[int, int] = {}
        for (put, slot, checksum), end in zip(ops, ends, strict=True):
            if end > keep:
                break
            if put:
                model[slot] = checksum
            else:
                model.pop(slot, None)
        got = replay(d, [], 1).entries
        assert {int(s): r.checksum for _, s, r in got} == model
        assert all(r.key == b"k%d" % s for _, s, r in got)


def test_persist_compacts_only_a_journal_that_outgrew_the_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.tiers.disk as disk

    monkeypatch.setattr(disk, "COMPACT_RECORDS", 4)
    with DiskStore(tmp_path, 1 << 24) as store:
        slots = store.alloc(PS, 2)
        assert slots is not None
        assert store.write(PS, slots, original(2)).result(timeout=10) == [True, True]
        [(first, _)] = journal_files(str(tmp_path))
        for _ in range(2):
            for i, s in enumerate(slots):
                store.set_record(PS, s, DiskRecord(bytes([i]), "t", meta={"i": i}))
        store.persist()  # 4 records: not more than 4, kept
        assert [g for g, _ in journal_files(str(tmp_path))] == [first]
        store.set_record(PS, slots[0], DiskRecord(b"\x00", "t", meta={"i": 0}))
        store.persist()  # 5 records: folded into a snapshot
        [(gen, path)] = journal_files(str(tmp_path))
        assert gen == first + 1 and os.path.getsize(path) == HEADER.size
        assert len(load_index(str(tmp_path))[0]) == 2
    with DiskStore(tmp_path, 1 << 24) as store:
        check_pages(store, 2)


def test_out_of_range_generations_are_not_trusted(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 24) as store:
        slots = store.alloc(PS, 2)
        assert slots is not None
        assert store.write(PS, slots, original(2)).result(timeout=10) == [True, True]
        for i, s in enumerate(slots):
            store.set_record(PS, s, DiskRecord(bytes([i]), "t", meta={"i": i}))
    (tmp_path / f"journal-{'9' * 30}.log").write_bytes(b"junk")  # not a journal name
    with DiskStore(tmp_path, 1 << 24) as store:
        check_pages(store, 2)
    doc = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps({**doc, "journal": 1 << 64}))
    with DiskStore(tmp_path, 1 << 24) as store:  # the snapshot is distrusted, the daemon starts
        assert store.records() == []
        assert store.counters.dropped_records == 2
