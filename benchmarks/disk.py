"""Disk benchmark: the raw disk against kvtier's disk tier, in one run on one directory.

Three measurements of ``--pages`` pages of ``--page-mib`` MiB each, all in ``--dir``:
    * raw: a plain reader/writer of whole pages (``os.pwrite`` / ``os.preadv`` of 4 KiB-aligned
      buffers, O_DIRECT where the filesystem takes it, else the written file's cache is dropped
      with ``posix_fadvise(DONTNEED)`` before reading), ``--qd`` threads at once, sequential and
      random page order; writes end with ``fdatasync``.
    * store: kvtier's ``DiskStore`` alone (the disk tier's I/O layer: checksums, bounce buffers,
      thread pool) writing and reading the same pages from an aligned host buffer, in order (one
      run) and scattered (host rows shuffled: a system call per page).
    * engine: a ``TierEngine`` on ``--device`` stores the pages as keyed blocks (GPU -> CPU) and is
      closed (keyed CPU pages flushed CPU -> disk: the write figure, over the disk lane's busy
      time, which leaves out the rest of ``close``); a second engine opened on the same directory
      finds them on disk and loads them (disk -> CPU -> GPU: the read figure, wall time of the
      ``load`` call).
      Every byte loaded is compared with what was stored.
The three run in turn, ``--rounds`` times (a shared or virtual disk varies from one second to
the next): figures are the best round's GB/s (10^9 bytes/s), and each kvtier figure's ratio to
the raw sequential one of the same round (the engine reads the slots of one file in key order),
the median and the lowest over the rounds. The engine's per-stage
seconds (its own counters: disk lane, CPU -> GPU lane, checksum time) say where the time goes.

    python benchmarks/disk.py --device cpu --dir /var/tmp/kvdisk            # this machine
    python benchmarks/disk.py --device cuda --dir /path/on/local/disk --pages 512 --page-mib 8
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvtier import OffloadConfig, Tier, TierEngine
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.diskio import probe_direct
from kvtier.types import BELOW_CPU, Direction

MIB = 1 << 20
GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dir", default="", help="directory on the disk to measure (default: a temp dir)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:n] (the engine's GPU tier)")
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--page-mib", type=float, default=2.0, help="page size (a multiple of 4 KiB)")
    p.add_argument("--page-bytes", type=int, default=0,
                   help="page size in bytes, any (not a multiple of 4 KiB: a registered pool's, "
                        "padded on disk; the raw peer moves the padded size, no engine part)")
    p.add_argument("--qd", type=int, default=8, help="raw reader/writer: pages in flight")
    p.add_argument("--io-threads", type=int, default=None, help="kvtier disk io threads")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of raw, store and engine in turn (best of)"
    )
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    return p.parse_args(argv)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ---- raw ---------------------------------------------------------------------------------------
class Raw:
    """Whole-page positioned I/O at a queue depth on one preallocated file."""

    def __init__(self, path: str, page: int, pages: int, qd: int) -> None:
        self.page, self.pages, self.qd = page, pages, qd
        self.direct = probe_direct(os.path.dirname(path))
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0), 0o600)
        os.ftruncate(self.fd, page * pages)
        self.bufs = [mmap.mmap(-1, page) for _ in range(qd)]  # page-aligned, as O_DIRECT needs
        for b in self.bufs:
            b.write(os.urandom(min(page, 1 << 16)) * (page // min(page, 1 << 16)))
        self.pool = ThreadPoolExecutor(qd)

    def run(self, order: list[int], write: bool) -> float:
        def one(k: int) -> None:
            buf = self.bufs[k % self.qd]
            for i in order[k :: self.qd]:
                off = i * self.page
                n = os.pwrite(self.fd, buf, off) if write else os.preadv(self.fd, [buf], off)
                assert n == self.page, "short transfer"

        if not write and not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        list(self.pool.map(one, range(self.qd)))
        if write:
            os.fdatasync(self.fd)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)
        for b in self.bufs:
            b.close()


def raw_figures(args: argparse.Namespace, d: str, page: int) -> dict[str, Any]:
    raw = Raw(os.path.join(d, "raw.dat"), page, args.pages, args.qd)
    seq = list(range(args.pages))
    rnd = random.Random(0).sample(seq, len(seq))
    total = page * args.pages
    out: dict[str, Any] = {"direct_io": raw.direct}
    try:
        for name, order in (("seq", seq), ("rand", rnd)):
            for what in ("write", "read"):
                out[f"{what}_{name}"] = gbps(total, raw.run(order, what == "write"))
    finally:
        raw.close()
        os.unlink(os.path.join(d, "raw.dat"))
    return out


# ---- the disk store alone -------------------------------------------------------------------------
def store_figures(args: argparse.Namespace, d: str, page: int) -> dict[str, Any]:
    n = args.pages
    threads = args.io_threads or OffloadConfig().disk_io_threads
    budget = -(-page // 4096) * 4096 * n  # slots padded to 4 KiB
    store = DiskStore(os.path.join(d, "store"), budget, io_threads=threads)
    host = mmap.mmap(-1, page * n)
    src = torch.frombuffer(host, dtype=torch.uint8)
    src.copy_(torch.randint(0, 256, (page * n,), dtype=torch.uint8))
    rows = [src[i * page : (i + 1) * page] for i in range(n)]
    out: dict[str, Any] = {"direct_io": store.direct_io, "io_threads": threads}
    try:
        slots = store.alloc(page, n)
        assert slots is not None
        # In order (host rows and slots adjacent: a batch is one run), then scattered (host rows
        # shuffled: every page is its own system call, as a cascade of LRU victims is).
        mixed = random.Random(1).sample(rows, n)
        for name, bufs in (("", rows), ("_scattered", mixed)):
            want = xxhash.xxh3_64_intdigest(memoryview(host))
            t0 = time.perf_counter()
            assert all(store.write(page, slots, bufs).result())
            write = time.perf_counter() - t0
            src.zero_()
            t0 = time.perf_counter()
            assert all(store.read(page, slots, bufs).result()), "a page failed its checksum"
            read = time.perf_counter() - t0
            assert xxhash.xxh3_64_intdigest(memoryview(host)) == want, "the store read other bytes"
            out[f"write{name}"] = gbps(page * n, write)
            out[f"read{name}"] = gbps(page * n, read)
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(memoryview(host))
        out["xxh3_gbps"] = gbps(page * n, time.perf_counter() - t0)
    finally:
        store.close()
        del src, rows
        host.close()
        shutil.rmtree(os.path.join(d, "store"))
    return out


# ---- the engine ------------------------------------------------------------------------------------
def engine_config(args: argparse.Namespace, d: str, page: int) -> OffloadConfig:
    n = args.pages
    kw: dict[str, Any] = {}
    if args.io_threads:
        kw["disk_io_threads"] = args.io_threads
    chunk_mb = max(1, min(256, page * n // MIB))
    # whole pinned chunks (CUDA hosts pin the CPU tier a chunk at a time) holding every page read
    cpu_bytes = -(-page * (n + 8) // (chunk_mb * MIB)) * chunk_mb * MIB
    return OffloadConfig(
        device=args.device,
        page_size=page,
        gpu_memory_gb=page * (n + 2) / GIB,
        cpu_memory_gb=cpu_bytes / GIB,
        disk_path=d,
        disk_gb=2 * page * n / GIB,
        disk_admission="always",
        pinned_chunk_mb=chunk_mb,
        **kw,
    )


def moved(engine: TierEngine, d: Direction) -> tuple[int, float]:
    c = engine.stats().counters.moved[d]
    return c.bytes, c.seconds


def engine_figures(args: argparse.Namespace, d: str, page: int) -> dict[str, Any]:
    n, sync = args.pages, _sync(args.device)
    keys = [f"disk-bench-{i}".encode() for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    want = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=gen)
    cfg = engine_config(args, os.path.join(d, "engine"), page)
    engine = TierEngine(cfg)
    pool = engine.attach("bench", n)
    slots = [s for _, s in engine.allocate(pool.pool_id, n) or []]
    pool.segments[0][slots] = want.to(pool.segments[0].device)
    sync()
    assert engine.store(pool.pool_id, keys, slots) == n
    t0 = time.perf_counter()
    engine.close(grace=600)  # keyed CPU pages flushed to disk (timed by the lane), index persisted
    write_s = time.perf_counter() - t0
    w_bytes, w_lane = moved(engine, Direction.CPU_TO_DISK)
    assert w_bytes == page * n, f"the flush wrote {w_bytes} of {page * n} bytes"

    engine = TierEngine(cfg)
    try:
        assert set(engine.lookup("bench", keys)) == {Tier.DISK}, "not every page reopened on disk"
        pool = engine.attach("bench", n)
        slots = [s for _, s in engine.allocate(pool.pool_id, n) or []]
        pool.segments[0][slots] = 0
        warm_arena(engine, page, n)
        sync()
        t0 = time.perf_counter()
        assert engine.load(pool.pool_id, keys, slots) == n, "a stored block failed to load"
        sync()
        read_s = time.perf_counter() - t0
        assert torch.equal(pool.segments[0][slots].cpu(), want), "loaded bytes differ"
        r_bytes, r_lane = moved(engine, Direction.DISK_TO_CPU)
        _, up_lane = moved(engine, Direction.CPU_TO_GPU)
        # The store's own I/O clock (read + checksum, per batch): the medium below the CPU.
        disk = engine._core.media[BELOW_CPU]
        stages = dict(
            disk_lane_s=r_lane,
            disk_store_s=disk.counters.read_seconds,
            cpu_to_gpu_lane_s=up_lane,
            flush_lane_s=w_lane,
        )
    finally:
        engine.close(grace=60)
        shutil.rmtree(cfg.disk_path)
    return dict(
        write=gbps(page * n, w_lane),  # the flush's writes, not the rest of close()
        read=gbps(r_bytes, read_s),
        write_s=write_s,
        read_s=read_s,
        stages=stages,
    )


def warm_arena(engine: TierEngine, page: int, n: int) -> None:
    """Map (and pin) the CPU tier's chunks before timing, as a running daemon has them (the
    arena keeps its chunks once made): the first touch of fresh memory, zeroing and faulting
    every 4 KiB page in the kernel, would otherwise be timed as disk reads (half the speed here).
    """
    host = engine._core.host
    slots = host.alloc(page, n)
    assert slots is not None, "the CPU tier is smaller than the pages read"
    for row in host.rows(page, slots):
        row.fill_(0)
    host.free(page, slots)


def _sync(device: str) -> Any:
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


FIGURES = ("write", "read")


def best(rounds: list[dict[str, Any]], part: str, key: str) -> float:
    return max(r[part][key] for r in rounds)


def report(res: dict[str, Any]) -> str:
    rounds = res["rounds"]
    raw, store, eng = rounds[0]["raw"], rounds[0]["store"], rounds[-1]["engine"]
    parts = ("store", "engine") if eng else ("store",)
    lines = [
        f"# Disk tier vs raw disk ({res['device']}, {res['pages']} x {res['page_bytes']} B pages, "
        f"raw qd {res['qd']}, kvtier io threads {store['io_threads']}, O_DIRECT raw="
        f"{raw['direct_io']} kvtier={store['direct_io']}, {len(rounds)} rounds, {res['date']})",
        "",
        "Best of the rounds, GB/s; ratios are kvtier over the raw sequential figure of the same "
        "round (median, lowest).",
        "",
        "| what | raw seq | raw rand | store | store/raw | store scattered | scattered/raw "
        "| engine | engine/raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for what in FIGURES:
        key = f"{what}_seq"
        cells = [best(rounds, "raw", key), best(rounds, "raw", f"{what}_rand")]
        cells = [f"{c:.2f}" for c in cells]
        for part, fig in (("store", what), ("store", f"{what}_scattered"), ("engine", what)):
            if part not in parts:
                cells += ["—", "—"]
                continue
            ratios = sorted(r[part][fig] / r["raw"][key] for r in rounds)
            cells.append(f"{best(rounds, part, fig):.2f}")
            cells.append(f"{statistics.median(ratios):.2f} ({ratios[0]:.2f})")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    if not eng:
        return "\n".join([*lines, "", f"Page {res['page_bytes']} B (padded on disk): no engine "
                           "part (an engine pool's page size is a multiple of 4 KiB).", ""])
    st = eng["stages"]
    lines += [
        "",
        f"Last round: engine load {1000 * eng['read_s']:.1f} ms: disk lane busy "
        f"{1000 * st['disk_lane_s']:.1f} ms (the store's batches, summed though they overlap: "
        f"{1000 * st['disk_store_s']:.1f} ms), CPU->GPU lane busy "
        f"{1000 * st['cpu_to_gpu_lane_s']:.1f} ms. Engine writes: the disk lane's busy time "
        f"flushing ({1000 * st['flush_lane_s']:.1f} ms) of a close() of "
        f"{1000 * eng['write_s']:.1f} ms. xxh3 on one core: "
        f"{store['xxh3_gbps']:.1f} GB/s.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    page = args.page_bytes or int(args.page_mib * MIB) // 4096 * 4096
    padded = -(-page // 4096) * 4096  # what the raw peer moves per page
    if page <= 0 or min(args.pages, args.qd, args.rounds) <= 0:
        raise SystemExit("--pages, --page-mib, --qd and --rounds must be positive")
    sys.setswitchinterval(0.0005)  # as `kvtier serve` does
    base = tempfile.mkdtemp(prefix="kvtier-disk-bench-", dir=args.dir or None)
    try:
        res: dict[str, Any] = dict(
            device=args.device,
            pages=args.pages,
            page_mib=page / MIB,
            page_bytes=page,
            qd=args.qd,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        res["rounds"] = [
            dict(
                raw=raw_figures(args, base, padded),
                store=store_figures(args, base, page),
                engine=engine_figures(args, base, page) if page == padded else {},
            )
            for _ in range(args.rounds)
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = report(res)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
        (args.out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
