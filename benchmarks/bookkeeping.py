"""Bookkeeping benchmark: the engine's per-page Python cost, with copies made negligible.

CPU mode, small pages (4 KiB by default) and many of them, driven like ``benchmarks/transfer.py``
drives the engine (one API call for all pages): what is left is the page table, policies, slot
allocation, scheduling and completion work per page. Reports microseconds per page for:
    * allocate: ``allocate(n)`` of pinned GPU pages (then ``release``, timed on its own);
    * offload: ``offload(all)`` + ``wait_idle`` (every page GPU -> CPU);
    * restore: ``acquire(all)`` (every page CPU -> GPU, restore-first, pinned on return);
    * release and free.
``copy`` is the handlers' own time (the engine's per-direction seconds), for reference.
Each step is the best of ``--rounds``, as wall time and as CPU time of the whole process (all
threads: the engine's work whatever thread ran it, less sensitive to a noisy machine).
``--profile`` prints a cProfile top-20 of offload+restore.

    python benchmarks/bookkeeping.py                  # 65536 pages of 4 KiB
    python benchmarks/bookkeeping.py --pages 32768 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier import OffloadConfig, PageState, TierEngine
from kvtier.types import Direction

GIB = 1 << 30
MIB = 1 << 20


def make_engine(pages: int, page: int, batch_mb: int, device: str = "cpu") -> TierEngine:
    nbytes = pages * page
    return TierEngine(
        OffloadConfig(
            device=device,
            page_size=page,
            gpu_memory_gb=nbytes / GIB + 0.01,
            cpu_memory_gb=1.2 * nbytes / GIB + 0.01,
            pinned_chunk_mb=256,
            batch_mb=batch_mb,
            max_inflight_mb=max(512, 4 * batch_mb),
            threshold=1.0,
            low_watermark=0.99,
            metrics_addr="",
        )
    )


CPU: dict[str, float] = {}  # step -> process CPU seconds of its latest run


def timed(fn: Callable[[], Any], step: str = "") -> float:
    """Wall seconds of ``fn()``; its process CPU seconds go to ``CPU[step]``."""
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    CPU[step] = time.process_time() - cpu
    return wall


def check_state(engine: TierEngine, pool_id: Any, ids: list[Any], state: PageState) -> None:
    bad = sum(
        1 for p in ids[:: max(1, len(ids) // 64)] if engine.page_info(pool_id, p).state is not state
    )
    assert not bad, f"pages not in {state}"


def one_round(
    engine: TierEngine, pool_id: Any, n: int, prof: cProfile.Profile | None
) -> dict[str, float]:
    """allocate, release, offload, restore, release, free of ``n`` pages; seconds per step."""
    out: dict[str, float] = {}
    got: list[Any] = []
    out["allocate"] = timed(lambda: got.extend(engine.allocate(pool_id, n) or []), "allocate")
    assert len(got) == n
    ids = [p for p, _ in got]
    out["release"] = timed(lambda: engine.release(pool_id, ids), "release")
    moved = engine.stats().counters.moved
    down0, up0 = moved[Direction.GPU_TO_CPU].seconds, moved[Direction.CPU_TO_GPU].seconds
    if prof is not None:
        prof.enable()
    out["offload"] = timed(lambda: (engine.offload(pool_id, ids), engine.wait_idle(120)), "offload")
    if prof is not None:
        prof.disable()
    check_state(engine, pool_id, ids, PageState.CPU)
    if prof is not None:
        prof.enable()
    out["restore"] = timed(lambda: engine.acquire(pool_id, ids), "restore")
    if prof is not None:
        prof.disable()
    check_state(engine, pool_id, ids, PageState.GPU)
    out["copy"] = (
        moved[Direction.GPU_TO_CPU].seconds - down0 + moved[Direction.CPU_TO_GPU].seconds - up0
    )
    out["release2"] = timed(lambda: engine.release(pool_id, ids), "release2")
    out["free"] = timed(lambda: engine.free(pool_id, ids), "free")
    engine.wait_idle(120)
    out.update({f"{k}_cpu": v for k, v in CPU.items() if k})
    return out


class ThreadProfiles:
    """cProfile for the lane threads too (their completions are half the bookkeeping)."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        threading.setprofile(self._start)  # threads started from now on (the engine's lanes)

    def _start(self, *_: Any) -> None:
        prof = cProfile.Profile()
        self.profiles.append(prof)
        prof.enable()  # replaces this hook for the thread

    def clear(self) -> None:
        for prof in self.profiles:
            prof.clear()

    def stats(self, main: cProfile.Profile) -> pstats.Stats:
        stats = pstats.Stats(main)
        for prof in self.profiles:
            prof.disable()
            stats.add(prof)
        return stats


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pages", type=int, default=65536)
    ap.add_argument("--page-kib", type=int, default=4)
    ap.add_argument("--batch-mb", type=int, default=16, help="engine batch size (MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile top-20 of offload+restore")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: the same calls on a GPU")
    args = ap.parse_args()
    sys.setswitchinterval(0.0005)  # as `kvtier serve` and benchmarks/transfer.py do
    page = args.page_kib << 10
    # Python >= 3.12 allows one profiler per process, and it sees every thread: no per-thread ones.
    per_thread = sys.version_info < (3, 12)
    lanes = ThreadProfiles() if args.profile and per_thread else None
    engine = make_engine(args.pages, page, args.batch_mb, args.device)
    prof = cProfile.Profile() if args.profile else None
    try:
        pool = engine.attach("bench", args.pages, page)
        # Warm-up: maps every host chunk, so first-time mapping is not in the figures.
        one_round(engine, pool.pool_id, args.pages, None)
        if lanes is not None:
            lanes.clear()
        rounds = [one_round(engine, pool.pool_id, args.pages, prof) for _ in range(args.rounds)]
    finally:
        engine.close()
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    us = {k: v / args.pages * 1e6 for k, v in best.items()}
    for suffix in ("", "_cpu"):
        us[f"offload+restore{suffix}"] = us[f"offload{suffix}"] + us[f"restore{suffix}"]
    print(
        f"{args.pages} pages of {args.page_kib} KiB, batch {args.batch_mb} MiB, best of {args.rounds}"
    )
    print("| step | wall us/page | CPU us/page |")
    print("|---|---|---|")
    for key in ("allocate", "release", "offload", "restore", "offload+restore", "release2", "free"):
        print(f"| {key} | {us[key]:.2f} | {us[key + '_cpu']:.2f} |")
    print(f"| (copy, handlers' own time) | {us['copy']:.2f} | |")
    print(json.dumps({k: round(v, 3) for k, v in us.items()}))
    if prof is not None:
        who = "caller and lane threads" if lanes is not None else "all threads, one profiler"
        print(f"\ncProfile of offload+restore, {args.rounds} rounds: {who}")
        stats = lanes.stats(prof) if lanes is not None else pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
