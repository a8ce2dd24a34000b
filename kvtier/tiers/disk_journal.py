"""The disk tier's index journal: append-only records between two snapshots of the index.

Contract:
    * ``Journal(directory, generation)`` appends to ``journal-<generation>.log`` (mode 0600).
      ``put``/``drop`` only buffer a record (cheap, called under the disk store's lock); a
      background thread writes the buffer into the file every ``write_s`` seconds (10 ms: from
      then on a kill -9 of the process can't lose it, the kernel holds it) and ``fdatasync``s the
      file every ``sync_s`` seconds while it has unsynced records (50 ms: group commit; from then
      on a power loss can't lose it either). ``write_out`` does the first now (the engine calls
      it once per batch of records, before a lookup can see them), ``sync`` both.
    * The caller appends a put only after its page's bytes are durable (the store records a
      checksum only after ``fdatasync`` of the data), so a replayed put never names bytes that
      were not written; replayed pages are still verified by their checksum on every read.
    * While the file refuses writes (a full disk) the records wait in memory (up to
      ``MAX_BUFFER`` bytes; past it they are lost and counted in ``lost``), each kind of failure
      is logged at most once per ``diskio.LOG_EVERY_S`` with a count, and ``unwritten`` says how
      many records are not in the file. A record is never split across two files.
    * ``rotate`` writes the buffer out and switches to the next generation's file (records still
      waiting go to the new one; the one record the old file holds a torn part of is counted
      lost: the snapshot saved next holds it); the old file stays until a snapshot that contains
      it is saved (``remove_before``). It raises ``OSError`` and changes nothing when the new
      file can't be made (a failed new file is removed).
    * Journal files are opened by ``diskio.open_regular``: a symbolic link is never followed.
    * ``replay(directory, entries, generation)`` applies every journal file of generation >=
      ``generation`` (oldest first) to the snapshot's entries. A file or record that fails its
      checks ends that file's replay: a torn or garbage tail is ignored and its bytes counted.

File format (version 1), little-endian:
    header  ``b"KVTJ"``, u16 version (1), u16 zero, u64 generation              (16 bytes)
    record  u32 n, u64 xxh3-64 of the payload, payload (n bytes, 1 <= n <= 64 KiB)
    payload compact JSON: ``{"op": "put", <an index entry, see kvtier.tiers.disk_index>}`` or
            ``{"op": "drop", "page_size": <int>, "slot": <int>}``.
A record is applied in file order: a put (re)binds its slot to a record, a drop forgets the slot.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

import xxhash

from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.disk_index import IndexEntry, decode_entry, encode_entry
from kvtier.tiers.diskio import Throttle, open_private, open_regular

MAGIC = b"KVTJ"
VERSION = 1
HEADER = struct.Struct("<4sHHQ")
FRAME = struct.Struct("<IQ")
MAX_PAYLOAD = 64 * 1024
MAX_BUFFER = 16 << 20  # bytes of records waiting for a file that refuses writes
WRITE_S = 0.01  # buffer -> file: well inside the 100 ms a kill may lose
SYNC_S = 0.05  # file -> disk (group commit): one journal fdatasync per 50 ms at most
_NAME_RE = re.compile(r"^journal-(\d{1,18})\.log$")  # generations stay far below 2**64
log = logging.getLogger(__name__)


def journal_name(generation: int) -> str:
    return f"journal-{generation}.log"


def journal_generation(name: str) -> int | None:
    """The generation of a journal file's name; None for any other name."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def journal_files(directory: str) -> list[tuple[int, str]]:
    """``(generation, path)`` of every journal file in ``directory``, oldest first."""
    found = []
    for name in os.listdir(directory):
        gen = journal_generation(name)
        if gen is not None:
            found.append((gen, os.path.join(directory, name)))
    return sorted(found)


def remove_before(directory: str, generation: int) -> None:
    """Delete journal files older than ``generation`` (a saved snapshot contains them)."""
    for gen, path in journal_files(directory):
        if gen < generation:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # harmless: a snapshot's generation makes replay skip it
                log.warning("old journal file %s not removed: %s", path, exc.strerror)


def frame(doc: dict[str, object]) -> bytes:
    payload = json.dumps(doc, separators=(",", ":")).encode()
    return FRAME.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


class Journal:
    """One writer of the journal files of a disk directory (thread-safe)."""

    def __init__(
        self, directory: str, generation: int, write_s: float = WRITE_S, sync_s: float = SYNC_S
    ) -> None:
        self.directory = directory
        self.generation = generation
        self.appended = 0  # records since the last rotate
        self.lost = 0  # records not buffered because the file refused writes
        self._lost_since = 0  # of those, lost since the last snapshot (``snapshot_saved``)
        self._lost_rotated = 0  # of those, lost before the last rotate
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._sizes: deque[int] = deque()  # of the records in ``_buf``, oldest first
        self._head = 0  # bytes of the oldest record in ``_buf`` already in the file
        self._write_errors = Throttle()
        self._sync_errors = Throttle()
        self._fd = self._open(generation)
        self._dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(write_s, sync_s), name="kvtier-journal", daemon=True
        )
        self._thread.start()

    def put(self, page_size: int, slot: DiskSlot, record: DiskRecord) -> None:
        self._append({"op": "put", **encode_entry(page_size, slot, record)})

    def drop(self, page_size: int, slot: DiskSlot) -> None:
        self._append({"op": "drop", "page_size": page_size, "slot": int(slot)})

    def _append(self, doc: dict[str, object]) -> None:
        rec = frame(doc)
        with self._lock:
            if len(self._buf) > MAX_BUFFER:  # the file refuses writes: don't grow without bound
                if not self._lost_since:
                    log.error("journal buffer full: records are lost until writes succeed")
                self.lost += 1  # a lost put is a miss after a restart, a lost drop a checksum miss
                self._lost_since += 1
                return
            self._buf += rec
            self._sizes.append(len(rec))
            self.appended += 1

    @property
    def unwritten(self) -> int:
        """Records appended but in no file: waiting in memory, or lost since the last snapshot."""
        with self._lock:
            return len(self._sizes) + self._lost_since

    def snapshot_saved(self) -> None:
        """The snapshot of the live records taken at the last ``rotate`` is saved: the records
        lost before that rotate are in it."""
        with self._lock:
            self._lost_since -= self._lost_rotated  # later ones are not in it
            self._lost_rotated = 0

    def write_out(self) -> None:
        """Every record appended so far is in the file (a kill -9 can't lose it from now on)."""
        with self._lock:
            self._write_out()

    def sync(self) -> None:
        """Every record appended so far is in the file and on the disk."""
        with self._lock:
            self._write_out()
            if not self._dirty or self._fd < 0:
                return
            fd, self._dirty = os.dup(self._fd), False  # a rotate may close the original
        try:
            os.fdatasync(fd)  # outside the lock: appends never wait for the disk
        except OSError as exc:
            with self._lock:
                held = self._sync_errors.fail()
            if held is not None:
                log.error("journal fdatasync failed (%d more times since last logged): %s",
                          held, exc)
        else:
            with self._lock:
                n = self._sync_errors.succeed()
            if n:
                log.warning("journal fdatasync succeeds again after %d failures", n)
        finally:
            os.close(fd)

    def rotate(self) -> int:
        """Write the buffer out and continue in the next generation's file; the new generation.
        ``OSError`` (nothing changed) when the old file refuses the buffer or the new can't
        be made."""
        with self._lock:
            self._write_out()
            new = self._open(self.generation + 1)
            if self._head:  # a record is never split across two files
                del self._buf[: self._sizes.popleft() - self._head]
                self._head = 0
                self.lost += 1
                self._lost_since += 1
            self._lost_rotated = self._lost_since  # a snapshot of the records now holds them
            old, self._fd = self._fd, new
            self.generation += 1
            self.appended, self._dirty = 0, False
        os.close(old)
        return self.generation

    def close(self) -> None:
        """Stop the sync thread, sync and close. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.sync()
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _write_out(self) -> None:
        """Lock held: move the buffer into the file (records are never split by a short write
        unless the disk fails, and then the replay ignores the torn tail)."""
        view = memoryview(self._buf)
        done = 0
        try:
            while done < len(view) and self._fd >= 0:
                done += os.write(self._fd, view[done:])
        except OSError as exc:
            held = self._write_errors.fail()
            if held is not None:
                log.error("journal write failed (%d more times since last logged; %d records "
                          "kept in memory): %s", held, len(self._sizes), exc)
        else:
            n = self._write_errors.succeed()
            if n:
                log.warning("journal writes succeed again after %d failures", n)
        finally:
            view.release()
        if done:
            del self._buf[:done]
            self._dirty = True
            self._written(done)

    def _written(self, nbytes: int) -> None:
        """Lock held: ``nbytes`` more of the buffered records are in the file."""
        left = self._head + nbytes
        while self._sizes and self._sizes[0] <= left:
            left -= self._sizes.popleft()
        self._head = left

    def _open(self, generation: int) -> int:
        """The generation's file, opened to append (a new one gets its header, or is removed
        again when the header can't be written)."""
        path = os.path.join(self.directory, journal_name(generation))
        fd = open_private(path, os.O_WRONLY | os.O_APPEND)
        try:
            if os.fstat(fd).st_size == 0:
                header = HEADER.pack(MAGIC, VERSION, 0, generation)
                if os.write(fd, header) != len(header):
                    raise OSError(errno.ENOSPC, "short write of the journal header", path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                if os.lstat(path).st_size < HEADER.size:
                    os.unlink(path)  # ours: a file without a whole header holds nothing
            raise
        return fd

    def _loop(self, write_s: float, sync_s: float) -> None:
        synced = time.monotonic()
        while not self._stop.wait(write_s):
            if time.monotonic() - synced >= sync_s:
                self.sync()
                synced = time.monotonic()
            else:
                self.write_out()


@dataclass(slots=True)
class Replay:
    """What replaying the journal files found."""

    entries: list[IndexEntry]
    generation: int  # the newest generation seen (the snapshot's when there are no files)
    records: int = 0  # records applied
    dropped: int = 0  # well-framed records with malformed contents
    torn_bytes: int = 0  # bytes ignored at the ends of files


def replay(directory: str, entries: list[IndexEntry], generation: int) -> Replay:
    """The snapshot's ``entries`` with every journal file of generation >= ``generation``."""
    state = {(ps, int(slot)): (ps, slot, rec) for ps, slot, rec in entries}
    out = Replay([], generation)
    for gen, path in journal_files(directory):
        if gen < generation:
            continue  # a snapshot saved after it already holds its records
        out.generation = max(out.generation, gen)
        with open(open_regular(path, os.O_RDONLY), "rb") as fh:
            data = fh.read()
        _apply_file(data, gen, state, out)
    out.entries = [state[k] for k in sorted(state)]
    if out.records or out.torn_bytes:
        log.info(
            "disk index: %d journal records replayed, %d torn bytes ignored",
            out.records, out.torn_bytes,
        )
    return out


def _apply_file(
    data: bytes, gen: int, state: dict[tuple[int, int], IndexEntry], out: Replay
) -> None:
    if len(data) < HEADER.size or HEADER.unpack_from(data) != (MAGIC, VERSION, 0, gen):
        out.torn_bytes += len(data)
        log.warning("journal generation %d has a bad header: ignored", gen)
        return
    pos = HEADER.size
    while pos < len(data):
        if pos + FRAME.size > len(data):
            break
        n, digest = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size : pos + FRAME.size + n]
        if not 0 < n <= MAX_PAYLOAD or len(payload) != n:
            break
        if xxhash.xxh3_64_intdigest(payload) != digest:
            break
        pos += FRAME.size + n
        if _apply(payload, state):
            out.records += 1
        else:
            out.dropped += 1
    if pos < len(data):
        out.torn_bytes += len(data) - pos
        log.warning("journal generation %d: %d torn bytes at its end ignored", gen, len(data) - pos)


def _apply(payload: bytes, state: dict[tuple[int, int], IndexEntry]) -> bool:
    """Apply one record; False when its contents are malformed (nothing changes)."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    op = doc.pop("op", None)
    if op == "put":
        entry = decode_entry(doc)
        if entry is None:
            return False
        state[(entry[0], int(entry[1]))] = entry
        return True
    ps, slot = doc.get("page_size"), doc.get("slot")
    if op != "drop" or type(ps) is not int or type(slot) is not int or ps <= 0 or slot < 0:
        return False
    state.pop((ps, slot), None)
    return True
