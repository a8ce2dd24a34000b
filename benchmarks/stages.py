"""Stage benchmark: where each page's time goes in an engine offload and restore.

Drives the engine as ``benchmarks/transfer.py`` does (one API call for 1 GiB of scattered pages:
every other slot of a pool) and reports, per page, the wall time spent inside each stage:
    * prepare: pages out of their policies, batches built (the calling thread);
    * launch: a lane starting a batch (host runs, slot indices, gather/scatter, DMA calls);
    * sync: a lane waiting for a batch's copies (the device is busy; this is not overhead);
    * finish + frees: completion under the engine lock (page states, policies, slot frees);
and the end-to-end time and GB/s. Stages are timed by wrapping the engine's own methods for the
run; times include waits for the interpreter lock, so they show where the lanes are held up.
``--timeline`` also prints, for the last round, when each chunk was prepared (p), each batch
launched (l), waited for (s) and completed (c, including a refused try while a caller held the
engine lock), as ``stage@start+wall(thread cpu)`` in ms from the API call, and when the call
returned: a stalled pipeline shows as gaps, a stage held up (interpreter lock, device) as cpu
far below wall.

    python benchmarks/stages.py --device cuda:0 --page-kib 64
    python benchmarks/stages.py                  # CPU mode, 16 KiB pages
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bookkeeping import make_engine

import kvtier.moves.batch as bulk
import kvtier.moves.completion as completion
import kvtier.moves.frees as batches
import kvtier.scheduler as scheduler

GIB = 1 << 30
SPENT: dict[str, float] = {}
EVENTS: list[tuple[float, str, str, float, float]] = []  # (start, thread, stage, wall, cpu s)
TRACK = {"prepare", "launch", "sync", "complete"}


def timed_method(owner: Any, name: str, stage: str) -> None:
    """Replace ``owner.name`` with a wrapper that adds its wall time to ``SPENT[stage]``."""
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            SPENT[stage] = SPENT.get(stage, 0.0) + spent
            if stage in TRACK:
                name = threading.current_thread().name
                EVENTS.append((start, name, stage, spent, time.thread_time() - cpu))

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed_method(bulk.BulkMoves, "prepare", "prepare")
    timed_method(scheduler.TransferScheduler, "_launch", "launch")
    timed_method(bulk.BulkMoves, "finish", "finish")
    timed_method(batches.Frees, "apply", "frees")
    timed_method(completion.Completion, "complete", "complete")
    try:
        import torch

        timed_method(torch.cuda.Event, "synchronize", "sync")
    except (ImportError, AttributeError):
        pass


def print_timeline(step: str, start: float, returned: float) -> None:
    """Events of one call as ``stage@start+wall(cpu)`` in ms, a line per thread: a stage whose
    thread CPU time is far below its wall time was blocked (the interpreter lock, a device
    wait), not working."""
    print(f"-- {step}: call returned at {returned * 1e3:.2f} ms")
    for name in sorted({e[1] for e in EVENTS}):
        mine = sorted(e for e in EVENTS if e[1] == name)
        cells = [
            f"{s[0]}@{(t - start) * 1e3:.2f}+{d * 1e3:.2f}({c * 1e3:.2f})" for t, _, s, d, c in mine
        ]
        print(f"   {name}: " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes moved per call")
    ap.add_argument("--batch-mb", type=int, default=64, help="engine batch size (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeline", action="store_true", help="per-batch timeline of the last round")
    ap.add_argument("--profile-call", action="store_true",
                    help="cProfile the calling thread in the last round (top 25 by own time)")
    ap.add_argument("--switch-us", type=float, default=500.0,
                    help="interpreter switch interval (kvtier serve uses 500 µs)")
    ap.add_argument("--ids", choices=("array", "list"), default="array",
                    help="page ids as an int64 array (default) or a Python list")
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_us / 1e6)
    page = args.page_kib << 10
    n = int(args.gib * GIB) // page
    instrument()
    engine = make_engine(2 * n, page, args.batch_mb, args.device)
    rows = []
    try:
        pool = engine.attach("bench", 2 * n, page)
        got = engine.allocate(pool.pool_id, 2 * n)
        assert got is not None
        engine.release(pool.pool_id, [p for p, _ in got])
        ids: Any = [p for p, _ in got][::2]  # scattered: every other slot
        if args.ids == "array":  # the engine's array form, as benchmarks/transfer.py uses
            ids = np.asarray(ids, dtype=np.int64)
        for r in range(args.rounds + 1):  # the first round maps the host chunks: not reported
            for step in ("offload", "restore"):
                SPENT.clear()
                EVENTS.clear()
                prof = cProfile.Profile() if args.profile_call and r == args.rounds else None
                if prof is not None:
                    prof.enable()
                start = time.perf_counter()
                if step == "offload":
                    engine.offload(pool.pool_id, ids)
                else:
                    engine.acquire(pool.pool_id, ids)
                returned = time.perf_counter() - start
                if prof is not None:
                    prof.disable()
                    print(f"-- {step}: the calling thread, by own time")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                if step == "offload":
                    assert engine.wait_idle(120)
                wall = time.perf_counter() - start
                if args.timeline and r == args.rounds:
                    print_timeline(step, start, returned)
                if r:
                    us = {k: round(v / n * 1e6, 3) for k, v in sorted(SPENT.items())}
                    rows.append({"step": step, "us_per_page": round(wall / n * 1e6, 3),
                                 "gbs": round(n * page / wall / 1e9, 2), **us})
            engine.release(pool.pool_id, ids)
    finally:
        engine.close()
    keys = ["us_per_page", "gbs", "prepare", "launch", "sync", "finish", "frees"]
    print(f"{n} pages of {args.page_kib} KiB on {args.device}, batch {args.batch_mb} MiB")
    print("| step | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for row in rows:
        print(f"| {row['step']} | " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
