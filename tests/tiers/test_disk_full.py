"""DiskStore on a disk that refuses writes (a file-size limit, ``RLIMIT_FSIZE``, stands in for a
full disk without privileges): journal failures are logged once per ``LOG_EVERY_S``, not per
attempt; ``close`` raises nothing and logs what it could not save; ``unindexed_records`` counts
what a restart would not see; a later open finds only good pages."""

from __future__ import annotations

from pathlib import Path

from .conftest import run_python

CHILD = r"""
import logging, resource, sys, time
import torch
from kvtier.tiers.base import DiskRecord
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk_journal import HEADER

class Count(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())

count = Count()
logging.getLogger("kvtier").addHandler(count)
logging.getLogger("kvtier").setLevel(logging.INFO)
PS, N, disk = 8192, 40, sys.argv[1]
store = DiskStore(disk, 1 << 20, direct_io=False, extent_bytes=N * PS)
slots = store.alloc(PS, N)
data = [torch.full((PS,), i, dtype=torch.uint8) for i in range(N)]
assert store.write(PS, slots, data).result(timeout=10) == [True] * N
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))  # the disk is full
for i, s in enumerate(slots):
    store.set_record(PS, s, DiskRecord(f"k{i}".encode(), "t1"))
time.sleep(0.5)  # ~50 journal write attempts
store.write_records()
failed = [m for m in count.lines if "journal write failed" in m]
assert len(failed) == 1, count.lines
unindexed = store.unindexed_records()
assert 0 < unindexed <= N, unindexed
store.close()  # raises nothing
assert any("closed without saving its index" in m for m in count.lines), count.lines
unindexed = store.unindexed_records()  # the close moved some to a new journal file
assert unindexed > 0
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
with DiskStore(disk, 1 << 20, direct_io=False) as again:
    found = again.records()
    assert len(found) == N - unindexed, (len(found), unindexed)  # no more, no fewer
    for ps, slot, rec in found:
        i = int(rec.key[1:])
        dst = torch.empty(PS, dtype=torch.uint8)
        assert again.read(ps, [slot], [dst]).result(timeout=10) == [True]
        assert torch.equal(dst, data[i])
    assert again.alloc(PS, 1) is not None
print(len(found), unindexed)
"""


def test_a_full_disk_is_logged_rarely_and_close_is_clean(tmp_path: Path) -> None:
    proc = run_python(CHILD, str(tmp_path / "disk"))
    found, unindexed = map(int, proc.stdout.split())
    assert unindexed > 0 and found < 40
    assert "Traceback" not in proc.stderr
