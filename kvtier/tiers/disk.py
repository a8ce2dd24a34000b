"""The disk tier: one preallocated slot file per page size, checksummed pages, a persisted index.

Contract (see ``kvtier.tiers.base``): ``DiskStore(path, budget_bytes, direct_io, io_threads,
*, extent_bytes, part_bytes)``.
    * ``pages-<page_size>.dat`` grows lazily, doubling up to extents (``posix_fallocate``);
      the files together never exceed ``budget_bytes``. Files never shrink, so bytes given to one
      page size stay with it. ``alloc`` returns ``None`` when the budget (or the disk) is full.
      A page size that is not a multiple of ``ALIGN`` (a registered pool's) is padded to one on
      disk (``SlotFile.stride``): each such page is its own system call, through a bounce
      buffer under O_DIRECT.
    * ``write``/``read`` return ``Future[list[bool]]`` (one per page). A batch is cut into parts
      of at most ``part_bytes`` (``kvtier.tiers.disk_parts``) run at once on ``io_threads``
      threads (the disk's queue depth); each part checksums its own pages. O_DIRECT where the
      filesystem takes it (``.direct_io``); unaligned buffers go through a bounce buffer.
    * A page's xxh3-64 checksum is recorded only after ``fdatasync`` (once per batch). Starting a
      write forgets the slot's checksum, so a page is never "good" while its bytes are in flight.
      ``read`` re-hashes what it read: a mismatch (torn write, bit flip) returns ``False`` and
      counts ``counters.checksum_failures``; an unwritten slot returns ``False``.
    * ``set_record``/``clear_record``/``records`` manage the persisted records of written slots;
      ``free`` drops a slot's record. Every change is appended to the index journal
      (``kvtier.tiers.disk_journal``: in the file within 10 ms, group-committed every 50 ms), so
      a record set more than ~100 ms before a kill -9 survives it. ``persist`` syncs the journal
      and compacts it into a new snapshot (``index.json``, written atomically) once it outgrows
      the live records; ``compact`` always does. On open the snapshot and the journal are
      replayed (a torn tail is ignored) and compacted; records whose slot lies past the end of its
      file or whose fields are malformed are dropped and counted in ``counters.dropped_records``;
      surviving records' slots stay allocated.
    * Files are private whatever the umask: the directory 0700 (an existing one loses group
      write and every "other" bit), files 0600; only regular files, never through a link.
    * Opening refuses with a ``ConfigError`` naming the path an entry under the store's file
      names it can't use (``disk_layout.unusable_file``) or a file it can't open or create;
      damaged contents are not refused: their records are dropped and their keys are misses.
    * A full disk fails ``alloc`` (``None``) and writes (``False``); a failed compaction keeps
      the journal files and is logged at most once per ``diskio.LOG_EVERY_S``;
      ``unindexed_records()`` counts record changes a restart would not see.
    * ``close`` waits for queued I/O, compacts, closes files, logs what it could not save.
Thread-safe; a slot must not be written or freed while a read or write of it is in flight.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.errors import ConfigError, FailedPrecondition, InvalidArgument
from kvtier.tiers.base import DiskRecord, DiskSlot, TierCounters
from kvtier.tiers.disk_index import load_index, save_index
from kvtier.tiers.disk_journal import Journal, remove_before, replay
from kvtier.tiers.disk_layout import (
    SlotFile,
    check_page_size,
    foreign_entry,
    page_file,
    page_file_size,
    unusable_file,
)
from kvtier.tiers.disk_parts import PartIO, Parts, read_part, split, write_part
from kvtier.tiers.diskio import (
    ALIGN,
    Throttle,
    coalesce,
    extend,
    open_private,
    private_dir,
    probe_direct,
    transfer,
)

_MIB = 1 << 20
# A batch is cut into parts of this many bytes (at least a page), run at once on the I/O
# threads: the disk sees ``io_threads`` requests in flight, not one batch's runs in turn.
PART_BYTES = 8 * _MIB
COMPACT_RECORDS = 65536  # journal records before a persist compacts (or the live count, if more)
log = logging.getLogger(__name__)


class DiskStore:
    """Fixed-size page slots in per-page-size files under ``path``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        budget_bytes: int,
        direct_io: bool = True,
        io_threads: int = 4,
        *,
        extent_bytes: int = 64 * _MIB,
        part_bytes: int = PART_BYTES,
    ) -> None:
        if budget_bytes < 0:
            raise InvalidArgument("budget_bytes", f"must be >= 0, got {budget_bytes}")
        if io_threads < 1:
            raise InvalidArgument("io_threads", f"must be >= 1, got {io_threads}")
        self.path = os.fspath(path)
        foreign = foreign_entry(self.path) if os.path.isdir(self.path) else None
        if foreign is not None:
            raise InvalidArgument("disk_path", foreign)
        private_dir(self.path)
        self.budget_bytes = budget_bytes
        self.extent_bytes = max(ALIGN, extent_bytes)
        self.part_bytes = max(ALIGN, part_bytes)
        self.direct_io = direct_io and probe_direct(self.path)
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._files: dict[int, SlotFile] = {}
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-disk")
        self._closed = False
        self._persist_lock = threading.Lock()
        self._save_errors = Throttle()
        problem = unusable_file(self.path)
        if problem is not None:
            self._pool.shutdown()
            raise ConfigError(f"disk tier: {problem}")
        try:
            self._journal = self._open_existing()
        except OSError as exc:
            self._pool.shutdown()
            for f in self._files.values():
                os.close(f.fd)
            where = exc.filename or self.path
            raise ConfigError(f"disk tier: {where}: {exc.strerror or exc}") from exc

    # ---- capacity ------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of slot files on disk (<= budget unless the budget shrank since they grew)."""
        return sum(f.nslots * f.stride for f in self._files.values())

    @property
    def used_bytes(self) -> int:
        return sum(len(f.used) * f.stride for f in self._files.values())

    def alloc(self, page_size: int, n: int) -> list[DiskSlot] | None:
        """``n`` lowest free slots, growing the file within budget; ``None`` if they don't fit."""
        check_page_size(page_size)
        if n < 0:
            raise InvalidArgument("n", f"must be >= 0, got {n}")
        with self._lock:
            self._check_open()
            try:
                f = self._file(page_size)
            except OSError as exc:  # a new page size's file the directory refuses: no room
                self._failed("disk tier file not opened", exc)
                return None
            if len(f.free) < n and not self._grow(f, n - len(f.free)):
                return None
            out = [heapq.heappop(f.free) for _ in range(n)]
            f.used.update(out)
            return [DiskSlot(s) for s in out]

    def free(self, page_size: int, slots: Sequence[int]) -> None:
        """Return slots and forget their bytes and records. A free slot is an internal error."""
        with self._lock:
            f = self._files[page_size]
            for s in slots:
                assert s in f.used, f"free of free disk slot {s}"
                f.used.discard(s)
                f.sums.pop(s, None)
                if f.records.pop(s, None) is not None:
                    self._journal.drop(page_size, DiskSlot(s))
                heapq.heappush(f.free, int(s))

    # ---- I/O -----------------------------------------------------------------------------
    def write(
        self, page_size: int, slots: Sequence[int], srcs: Sequence[torch.Tensor]
    ) -> Future[list[bool]]:
        """Write ``srcs[i]`` (1-D uint8 CPU, ``page_size`` bytes) to ``slots[i]``.

        The sources must stay unchanged until the future completes.
        """
        with self._lock:
            self._check_open()
            f = self._checked(page_size, slots, srcs, "srcs")
            for s in slots:
                f.sums.pop(s, None)  # not readable as good until the new bytes are durable
            runs = split(coalesce(page_size, slots, srcs, f.stride), page_size, self.part_bytes)
            if not runs:
                return _done([])
            n = len(slots)
            ok, sums = [False] * n, [0] * n
            t0 = time.perf_counter()
            parts = Parts(len(runs), lambda: self._write_done(f, list(slots), ok, sums, t0))
            for run in runs:
                self._pool.submit(write_part, f.page_size, run, ok, sums, parts, self._write_io(f))
            return parts.future

    def read(
        self, page_size: int, slots: Sequence[int], dsts: Sequence[torch.Tensor]
    ) -> Future[list[bool]]:
        """Read ``slots[i]`` into ``dsts[i]``; ``False`` for a page that fails its checksum."""
        with self._lock:
            self._check_open()
            f = self._checked(page_size, slots, dsts, "dsts")
            expected = [f.sums.get(s) for s in slots]
            runs = split(coalesce(page_size, slots, dsts, f.stride), page_size, self.part_bytes)
            if not runs:
                return _done([])
            ok, bad = [False] * len(slots), list[int]()
            t0 = time.perf_counter()
            parts = Parts(len(runs), lambda: self._read_done(f, ok, bad, t0))
            for run in runs:
                self._pool.submit(read_part, f.page_size, run, expected, ok, bad, parts,
                                  self._read_io(f))
            return parts.future

    def _write_done(
        self, f: SlotFile, slots: list[int], ok: list[bool], sums: list[int], t0: float
    ) -> list[bool]:
        """After the last part: one ``fdatasync``, then the checksums become the durable ones."""
        try:
            os.fdatasync(f.fd)
        except OSError:
            ok = [False] * len(slots)
            self._count(io_errors=1)
        with self._lock:
            for s, good, h in zip(slots, ok, sums, strict=True):
                if good and s in f.used:
                    f.sums[s] = h
                    if s in f.records:
                        f.records[s].checksum = h
            self.counters.bytes_written += sum(ok) * f.page_size
            self.counters.write_seconds += time.perf_counter() - t0
        return ok

    def _read_done(self, f: SlotFile, ok: list[bool], bad: list[int], t0: float) -> list[bool]:
        with self._lock:
            self.counters.checksum_failures += sum(bad)
            self.counters.bytes_read += sum(ok) * f.page_size
            self.counters.read_seconds += time.perf_counter() - t0
        return ok

    def _write_io(self, f: SlotFile) -> PartIO:
        return lambda offset, ptr, nbytes: self._io(f.fd, offset, ptr, nbytes, write=True)

    def _read_io(self, f: SlotFile) -> PartIO:
        return lambda offset, ptr, nbytes: self._io(f.fd, offset, ptr, nbytes, write=False)

    def _io(self, fd: int, offset: int, ptr: int, nbytes: int, *, write: bool) -> bool:
        if transfer(fd, offset, ptr, nbytes, write=write, direct=self.direct_io):
            return True
        self._count(io_errors=1)
        return False

    # ---- records -------------------------------------------------------------------------
    def set_record(self, page_size: int, slot: DiskSlot, record: DiskRecord) -> None:
        """Attach ``record`` to a durably written slot; its checksum is filled in here."""
        with self._lock:
            f = self._files.get(page_size)
            if f is None or slot not in f.sums:
                raise FailedPrecondition(f"disk slot {slot} ({page_size} B) holds no durable page")
            record.checksum = f.sums[slot]
            f.records[slot] = record
            self._journal.put(page_size, slot, record)

    def clear_record(self, page_size: int, slot: DiskSlot) -> None:
        with self._lock:
            f = self._files.get(page_size)
            if f is not None and f.records.pop(slot, None) is not None:
                self._journal.drop(page_size, slot)

    def write_records(self) -> None:
        """The records set so far are in the journal file: a kill -9 can't lose them now."""
        self._journal.write_out()

    def records(self) -> list[tuple[int, DiskSlot, DiskRecord]]:
        """``(page_size, slot, record)`` for every recorded slot."""
        with self._lock:
            return [
                (ps, DiskSlot(s), rec)
                for ps, f in sorted(self._files.items())
                for s, rec in sorted(f.records.items())
            ]

    def persist(self) -> None:
        """Every record set so far is durable (journal synced); compacts a journal that holds
        more records than ``COMPACT_RECORDS`` and than the live records."""
        self._journal.sync()
        with self._lock:
            live = sum(len(f.records) for f in self._files.values())
            grown = self._journal.appended > max(COMPACT_RECORDS, live)
        if grown:
            self.compact()

    def unindexed_records(self) -> int:
        """Record changes (set or cleared) a restart now would not see: the journal file
        refused them (a full disk) and no snapshot has been saved since."""
        return self._journal.unwritten

    def compact(self) -> bool:
        """Write the live records as a new snapshot (temp file + fsync + rename + directory
        fsync) and delete the journal files it contains. False when the disk refused (logged
        at most once per ``LOG_EVERY_S``): the journal files stay, and so do their records."""
        error = self._compact()
        if error is not None:
            with self._lock:
                self._failed("disk index not saved", error)
        return error is None

    def _compact(self) -> OSError | None:
        with self._persist_lock:
            try:
                with self._lock:  # no record changes between the copy and the switch of file
                    entries = [
                        (ps, DiskSlot(s), DiskRecord(r.key, r.tenant, r.checksum, dict(r.meta)))
                        for ps, f in sorted(self._files.items())
                        for s, r in sorted(f.records.items())
                    ]
                    generation = self._journal.rotate()
                save_index(self.path, entries, generation)
            except OSError as exc:
                return exc
            self._journal.snapshot_saved()
            remove_before(self.path, generation)
            with self._lock:
                self._save_errors.succeed()
            return None


    def _failed(self, what: str, exc: OSError) -> None:
        """Lock held: log a failure to write to the directory, at most once per LOG_EVERY_S."""
        held = self._save_errors.fail()
        if held is not None:
            log.error("%s (%d more times since last logged): %s", what, held, exc)

    def close(self) -> None:
        """Finish queued I/O, compact the index, close the files; what could not be saved is
        logged. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        error = self._compact()
        self._journal.close()
        for f in self._files.values():
            os.close(f.fd)
        if error is None:
            return
        lost = self._journal.unwritten
        if lost:
            log.error("disk tier closed without saving its index (%s): %d record changes are "
                      "in no file, so those keyed pages are misses after a restart", error, lost)
        else:
            log.warning("disk tier closed without compacting its index (%s): the journal "
                        "files hold every record", error)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------
    def _open_existing(self) -> Journal:
        """Load the slot files, the snapshot and the journal; compact; the journal to append to."""
        for name in sorted(os.listdir(self.path)):
            size = page_file_size(name)
            if size is not None:
                f = self._file(size)
                f.nslots = os.fstat(f.fd).st_size // f.stride
        snapshot, dropped, generation = load_index(self.path)
        found = replay(self.path, snapshot, generation)
        dropped += found.dropped
        for ps, slot, rec in found.entries:
            sf = self._files.get(ps)
            if sf is None or slot >= sf.nslots:
                dropped += 1  # the file lost its tail (or vanished): these bytes are gone
                continue
            sf.used.add(slot)
            sf.sums[slot] = rec.checksum
            sf.records[slot] = rec
        self.counters.dropped_records += dropped
        if dropped:
            log.warning("disk tier at %s: %d stored pages dropped at open (index or slot files "
                        "damaged, cut short or missing): their keys are misses", self.path, dropped)
        for f in self._files.values():
            f.free = [s for s in range(f.nslots) if s not in f.used]  # ascending: a valid heap
        generation = found.generation + 1
        try:
            save_index(self.path, self.records(), generation)
            remove_before(self.path, generation)
        except OSError as exc:  # a full disk: the snapshot and journal files read stay
            log.error("disk index not compacted at open: %s", exc)
        return Journal(self.path, generation)

    def _file(self, page_size: int) -> SlotFile:
        f = self._files.get(page_size)
        if f is None:
            name = page_file(self.path, page_size)
            flags = os.O_RDWR | (os.O_DIRECT if self.direct_io else 0)
            f = SlotFile(page_size, open_private(name, flags))
            self._files[page_size] = f
        return f

    def _grow(self, f: SlotFile, need: int) -> bool:
        """Add at least ``need`` slots to ``f``, doubling it up to an extent within budget (a
        file's bytes stay with its size: a few blocks of many sizes can't hold the disk)."""
        room = (self.budget_bytes - self.reserved_bytes) // f.stride
        if room < need:
            return False
        step = min(self.extent_bytes // f.stride, max(1, f.nslots))
        for add in dict.fromkeys((min(room, max(need, step)), need)):
            if extend(f.fd, f.nslots * f.stride, add * f.stride):
                for s in range(f.nslots, f.nslots + add):
                    heapq.heappush(f.free, s)
                f.nslots += add
                return True
        return False

    def _checked(
        self, page_size: int, slots: Sequence[int], bufs: Sequence[torch.Tensor], name: str
    ) -> SlotFile:
        if len(slots) != len(bufs):
            raise InvalidArgument(name, f"{len(bufs)} buffers for {len(slots)} slots")
        f = self._files.get(page_size)
        for i, (s, t) in enumerate(zip(slots, bufs, strict=True)):
            if f is None or s not in f.used:
                raise InvalidArgument("slots", f"disk slot {s} ({page_size} B) is not allocated")
            if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
                raise InvalidArgument(f"{name}[{i}]", "expected a contiguous uint8 CPU tensor")
            if t.numel() != page_size:
                raise InvalidArgument(f"{name}[{i}]", f"{t.numel()} bytes, page is {page_size}")
        assert f is not None or not slots
        return f if f is not None else self._file(page_size)

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("disk store is closed")

    def _count(self, io_errors: int) -> None:
        with self._lock:
            self.counters.io_errors += io_errors


def _done(result: list[bool]) -> Future[list[bool]]:
    fut: Future[list[bool]] = Future()
    fut.set_result(result)
    return fut
