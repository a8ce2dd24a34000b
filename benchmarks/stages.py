"""Stage benchmark: where each page's time goes in an engine offload and restore.

Drives the engine as ``benchmarks/transfer.py`` does (one API call for 1 GiB of scattered pages:
every other slot of a pool) and reports, per page, the wall time spent inside each stage:
    * prepare: pages out of their policies, batches built (the calling thread);
    * launch: a lane starting a batch (host runs, slot indices, gather/scatter, DMA calls);
    * sync: a lane waiting for a batch's copies (the device is busy; this is not overhead);
    * finish + frees: completion under the engine lock (page states, policies, slot frees);
and the end-to-end time and GB/s. Stages are timed by wrapping the engine's own methods for the
run; times include waits for the interpreter lock, so they show where the lanes are held up.

    python benchmarks/stages.py --device cuda:0 --page-kib 64
    python benchmarks/stages.py                  # CPU mode, 16 KiB pages
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bookkeeping import make_engine

import kvtier.batches as batches
import kvtier.bulk as bulk
import kvtier.scheduler as scheduler

GIB = 1 << 30
SPENT: dict[str, float] = {}


def timed_method(owner: Any, name: str, stage: str) -> None:
    """Replace ``owner.name`` with a wrapper that adds its wall time to ``SPENT[stage]``."""
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[stage] = SPENT.get(stage, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed_method(bulk.BulkMoves, "prepare", "prepare")
    timed_method(scheduler.TransferScheduler, "_launch", "launch")
    timed_method(bulk.BulkMoves, "finish", "finish")
    timed_method(batches.Frees, "apply", "frees")
    try:
        import torch

        timed_method(torch.cuda.Event, "synchronize", "sync")
    except (ImportError, AttributeError):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes moved per call")
    ap.add_argument("--batch-mb", type=int, default=64, help="engine batch size (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
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
        ids = [p for p, _ in got][::2]  # scattered: every other slot
        for r in range(args.rounds + 1):  # the first round maps the host chunks: not reported
            for step in ("offload", "restore"):
                SPENT.clear()
                start = time.perf_counter()
                if step == "offload":
                    engine.offload(pool.pool_id, ids)
                    assert engine.wait_idle(120)
                else:
                    engine.acquire(pool.pool_id, ids)
                wall = time.perf_counter() - start
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
