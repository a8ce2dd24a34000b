"""One disk batch as parts run at once on the store's I/O threads (the disk's queue depth).

Contract:
    * ``split(runs, page_size, part_bytes)`` cuts ``diskio.coalesce`` runs into parts of at most
      ``part_bytes`` (never less than one page, always whole pages), each still one system call.
    * ``Parts(n, finish)``: ``n >= 1`` parts of one batch. Each part calls ``done(error)``
      exactly once, from whichever thread ran it; the last one runs ``finish()`` on that thread
      and completes ``future`` with its result (or with the first part's error, or
      ``finish``'s). No thread ever waits for another part, so parts of many batches share one
      pool without deadlock.
    * Work per page that does not need the other parts (checksums) runs inside its part, beside
      the other parts' I/O, not after the batch: ``write_part`` checksums a part's pages and
      writes it, ``read_part`` reads it and checks each page against its durable checksum
      (``io(offset, ptr, nbytes) -> bool``: the part's one system call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import xxhash

from kvtier.tiers.diskio import cbuf

Run = tuple[int, int, int, list[int]]  # (file offset, buffer address, nbytes, positions)
PartIO = Callable[[int, int, int], bool]  # (file offset, buffer address, nbytes) -> done


def split(runs: Iterable[Run], page_size: int, part_bytes: int) -> list[Run]:
    """``runs`` cut into parts of at most ``part_bytes`` (at least one page) each."""
    step = max(1, part_bytes // page_size)
    out: list[Run] = []
    for offset, ptr, _, positions in runs:
        for i in range(0, len(positions), step):
            pos = positions[i : i + step]
            at = i * page_size
            out.append((offset + at, ptr + at, len(pos) * page_size, pos))
    return out


class Parts:
    """Completion of a batch cut into parts: see the module docstring."""

    __slots__ = ("_error", "_finish", "_left", "_lock", "future")

    def __init__(self, n: int, finish: Callable[[], list[bool]]) -> None:
        self.future: Future[list[bool]] = Future()
        self._left = n
        self._finish = finish
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        assert n >= 1, "a batch of no parts never completes"

    def done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        if self._error is not None:
            self.future.set_exception(self._error)
            return
        try:
            result = self._finish()
        except BaseException as exc:  # the batch's waiter gets it: nothing is lost
            self.future.set_exception(exc)
            return
        self.future.set_result(result)


def write_part(page: int, run: Run, ok: list[bool], sums: list[int], parts: Parts,
               io: PartIO) -> None:
    """Checksum and write one part (its pages' bytes are contiguous at ``ptr``)."""
    try:
        offset, ptr, nbytes, positions = run
        for k, p in enumerate(positions):
            sums[p] = xxhash.xxh3_64_intdigest(cbuf(ptr + k * page, page))
        if io(offset, ptr, nbytes):
            for p in positions:
                ok[p] = True
    except BaseException as exc:
        parts.done(exc)
        return
    parts.done()


def read_part(page: int, run: Run, expected: list[int | None], ok: list[bool], bad: list[int],
              parts: Parts, io: PartIO) -> None:
    """Read one part and check each of its pages against its durable checksum (each part
    appends its count of mismatches to ``bad``; only this part writes its positions)."""
    try:
        offset, ptr, nbytes, positions = run
        if io(offset, ptr, nbytes):
            for k, p in enumerate(positions):
                got = xxhash.xxh3_64_intdigest(cbuf(ptr + k * page, page))
                ok[p] = expected[p] is not None and got == expected[p]
            bad.append(sum(expected[p] is not None and not ok[p] for p in positions))
    except BaseException as exc:
        parts.done(exc)
        return
    parts.done()
