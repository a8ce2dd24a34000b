"""A busy disk the planner did not see coming: bursts of another reader on the disk tier's disk.

``Contender(folder, mib)`` writes a scratch file of ``mib`` MiB in ``folder`` (the disk tier's
own folder, so the same device) once. ``burst(seconds)`` starts ``threads`` readers of random
4 MiB pieces of it (``O_DIRECT`` where the file system allows, so the page cache doesn't answer)
for that long; ``join()`` waits for them. Started right before a timed turn, it makes that
turn's disk reads slower than anything the planner had measured, as a neighbour's job would.
Used by ``benchmarks/multiturn.py --contend-every``.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path

PIECE = 4 << 20


class Contender:
    def __init__(self, folder: str, mib: int = 2048, threads: int = 8) -> None:
        self.path = Path(folder) / "contender.scratch"
        self.pieces = max(1, (mib << 20) // PIECE)
        self.threads = threads
        self._running: list[threading.Thread] = []
        self.read_bytes = 0
        chunk = os.urandom(PIECE)
        with open(self.path, "wb") as f:
            for _ in range(self.pieces):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        self._flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            os.close(os.open(self.path, self._flags))
        except OSError:  # no O_DIRECT here (tmpfs): plain reads
            self._flags = os.O_RDONLY

    def burst(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        self._running = [threading.Thread(target=self._read, args=(until, i), daemon=True)
                         for i in range(self.threads)]
        for t in self._running:
            t.start()

    def join(self) -> None:
        for t in self._running:
            t.join()
        self._running = []

    def _read(self, until: float, seed: int) -> None:
        rng = random.Random(seed)
        buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
        fd = os.open(self.path, self._flags)
        try:
            while time.monotonic() < until:
                got = os.preadv(fd, [buf], rng.randrange(self.pieces) * PIECE)
                self.read_bytes += got
        finally:
            os.close(fd)
            buf.close()

    def close(self) -> None:
        self.join()
        self.path.unlink(missing_ok=True)
