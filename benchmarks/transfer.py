"""Transfer benchmark: engine offload/restore of scattered pages vs the raw hardware limit.

For each page size, 1 GiB per batch of *scattered* pages (every other slot of a pool):
    * raw: one contiguous pinned copy of the same bytes, each way and both ways at once;
    * loop: one copy call per page (the naive baseline), on a bounded sample of pages;
    * engine: ``offload`` + wait, ``acquire`` (restore), and both at once, end to end through the
      page table, scheduler and handlers; ``data path`` is the handlers' own time (counters);
    * restore latency (p50/p99/max) of a 1 MiB acquire, idle and while a 4 GiB offload backlog
      drains, over at least ``--latency-samples`` (1000) samples each (a p99 of ~200 samples is
      little more than the second-slowest one; the JSON keeps every sample).
All figures from one run, on one device; each GB/s figure is the median of ``--repeats`` (5)
round trips (the JSON also has the engine's slowest and fastest). Writes a markdown table and
JSON to ``--out``.

    python benchmarks/transfer.py --out results/   # needs CUDA; --device cpu for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rawcopy import pinned_copy, timed

from kvtier import OffloadConfig, PageState, TierEngine

GIB = 1 << 30


def raw_copies(nbytes: int, page: int, device: torch.device, repeats: int) -> dict[str, float]:
    out = {f"raw_{k}": v for k, v in pinned_copy(nbytes, device, repeats).items()}
    n = min(nbytes // page, 4096)  # the naive loop: one copy call per page, on a sample
    rows_g = torch.empty((n, page), dtype=torch.uint8, device=device)
    rows_h = torch.empty((n, page), dtype=torch.uint8, pin_memory=device.type == "cuda")
    order = torch.randperm(n).tolist()

    def loop() -> None:
        for i, j in enumerate(order):
            rows_h[i].copy_(rows_g[j], non_blocking=True)

    out["loop_d2h"] = n * page / timed(loop, device) / 1e9
    return out


def wait_state(engine: TierEngine, pool_id, ids, state: PageState) -> None:
    """Wait for the engine to go idle, then check every page landed in ``state``."""
    if not engine.wait_idle(120):
        raise TimeoutError("transfers never drained")
    bad = [p for p in ids if engine.page_info(pool_id, p).state is not state]
    assert not bad, f"{len(bad)} pages not in {state}"


def engine_case(page: int, nbytes: int, device: torch.device, batch_mb: int = 64,
                gc_freeze: bool = False, id_arrays: bool = True,
                repeats: int = 5) -> dict[str, float]:
    n = nbytes // page
    cfg = OffloadConfig(
        device=str(device),
        page_size=page,
        gpu_memory_gb=2 * nbytes / GIB + 0.01,
        cpu_memory_gb=2.2 * nbytes / GIB,
        pinned_chunk_mb=256,
        batch_mb=batch_mb,
        max_inflight_mb=max(512, 4 * batch_mb),
        threshold=1.0,
        low_watermark=0.99,
        metrics_addr="",
    )
    engine = TierEngine(cfg)
    try:
        pool = engine.attach("bench", 2 * n, page)
        got = engine.allocate(pool.pool_id, 2 * n)
        assert got is not None
        ids = [p for p, _ in got]
        seg = pool.segments[0]
        seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8, device=seg.device))
        engine.release(pool.pool_id, ids)
        a, b = ids[0::2], ids[1::2]  # scattered: every other slot
        if id_arrays:  # the engine's array form: int64 ids in, int64 slots out
            a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        # Warm-up: every page once through the CPU tier, so all the host chunks the runs below
        # use are already mapped and pinned (first-time pinning is reported on its own).
        t_pin = time.perf_counter()
        engine.offload(pool.pool_id, ids)
        wait_state(engine, pool.pool_id, ids, PageState.CPU)
        first_offload_s = time.perf_counter() - t_pin
        engine.acquire(pool.pool_id, ids)
        engine.release(pool.pool_id, ids)
        if gc_freeze:  # the page table built above leaves the cyclic collector's working set
            gc.freeze()
        sample = {
            p: seg[engine.page_info(pool.pool_id, p).slot].clone() for p in a[:: max(1, n // 16)]
        }
        moved = engine.stats().counters.moved
        out: dict[str, float] = {"first_offload_gbs": 2 * nbytes / first_offload_s / 1e9}
        from kvtier.types import Direction

        down0, up0 = moved[Direction.GPU_TO_CPU].seconds, moved[Direction.CPU_TO_GPU].seconds
        offs, ress = [], []
        for _ in range(repeats):  # each figure is the median of ``repeats`` round trips
            offs.append(
                timed(lambda: (engine.offload(pool.pool_id, a), engine.wait_idle(120)), device)
            )
            wait_state(engine, pool.pool_id, a, PageState.CPU)  # verified outside the timing
            # Zero the freed slots, so the check below proves the bytes came back from the host.
            seg.index_fill_(0, torch.arange(0, 2 * n, 2, device=seg.device), 0)
            ress.append(timed(lambda: engine.acquire(pool.pool_id, a), device))
            for pid, data in sample.items():
                assert torch.equal(seg[engine.page_info(pool.pool_id, pid).slot], data), (
                    "restored bytes differ"
                )
            engine.release(pool.pool_id, a)
        total = repeats * nbytes
        out["offload"] = nbytes / statistics.median(offs) / 1e9
        out["offload_datapath"] = total / (moved[Direction.GPU_TO_CPU].seconds - down0) / 1e9
        out["restore"] = nbytes / statistics.median(ress) / 1e9
        out["restore_datapath"] = total / (moved[Direction.CPU_TO_GPU].seconds - up0) / 1e9
        out["offload_range"] = [nbytes / max(offs) / 1e9, nbytes / min(offs) / 1e9]
        out["restore_range"] = [nbytes / max(ress) / 1e9, nbytes / min(ress) / 1e9]

        def both() -> None:
            th = threading.Thread(target=lambda: engine.acquire(pool.pool_id, b))
            th.start()
            engine.offload(pool.pool_id, a)
            th.join()
            engine.wait_idle(120)

        boths = []
        for _ in range(repeats):  # a on the GPU, b on the CPU; then b up while a goes down
            engine.offload(pool.pool_id, b)
            wait_state(engine, pool.pool_id, b, PageState.CPU)
            boths.append(timed(both, device))
            wait_state(engine, pool.pool_id, a, PageState.CPU)
            engine.release(pool.pool_id, b)
            engine.acquire(pool.pool_id, a)
            engine.release(pool.pool_id, a)
        out["both"] = 2 * nbytes / statistics.median(boths) / 1e9
        return out
    finally:
        gc.unfreeze()
        engine.close()


def latency_case(
    device: torch.device, backlog: int, gc_freeze: bool = False, samples: int = 1000
) -> dict[str, Any]:
    page = 256 << 10
    per_req = 4  # 1 MiB
    nb = backlog // page
    cfg = OffloadConfig(
        device=str(device),
        page_size=page,
        gpu_memory_gb=(backlog + (64 << 20)) / GIB + 0.01,
        cpu_memory_gb=(backlog + (256 << 20)) / GIB,
        pinned_chunk_mb=256,
        batch_mb=64,
        max_inflight_mb=512,
        threshold=1.0,
        low_watermark=0.99,
        metrics_addr="",
    )
    engine = TierEngine(cfg)
    try:
        pool = engine.attach("lat", nb + 256, page)
        req = [p for p, _ in engine.allocate(pool.pool_id, 256)]
        bulk = [p for p, _ in engine.allocate(pool.pool_id, nb)]
        engine.release(pool.pool_id, req + bulk)
        groups = [req[i : i + per_req] for i in range(0, len(req), per_req)]

        def sample(busy: bool) -> list[float]:
            engine.offload(pool.pool_id, req)
            wait_state(engine, pool.pool_id, req, PageState.CPU)
            if busy:
                engine.offload(pool.pool_id, bulk)  # the backlog, queued behind nothing
            lat = []
            for ids in groups:
                if busy and engine.stats().queued_offloads == 0:
                    break
                t0 = time.perf_counter()
                engine.acquire(pool.pool_id, ids)
                lat.append(time.perf_counter() - t0)
                engine.release(pool.pool_id, ids)
            if busy:
                wait_state(engine, pool.pool_id, bulk, PageState.CPU)
                engine.acquire(pool.pool_id, bulk)
                engine.release(pool.pool_id, bulk)
            return lat

        sample(False)  # warm-up, not recorded: first kernels, first pinned chunks, first
        sample(True)  # events of a fresh process are not steady-state latency
        if gc_freeze:  # everything alive now leaves the cyclic collector's full passes
            gc.freeze()
        idle: list[float] = []
        busy: list[float] = []
        while len(idle) < samples:
            idle += sample(False)
        while len(busy) < samples:  # a round takes as many as the backlog takes to drain
            busy += sample(True)

        def q(xs: list[float], p: int) -> float:
            return statistics.quantiles(xs, n=100)[p - 1] * 1e3 if len(xs) > 2 else float("nan")

        return {
            **{f"{k}_{s}_ms": q(xs, p) for k, xs in (("idle", idle), ("busy", busy))
               for s, p in (("p50", 50), ("p99", 99))},
            "idle_max_ms": max(idle) * 1e3,
            "busy_max_ms": max(busy) * 1e3,
            "idle_samples": float(len(idle)),
            "busy_samples": float(len(busy)),
            "samples_ms": {"idle": [x * 1e3 for x in idle], "busy": [x * 1e3 for x in busy]},
        }
    finally:
        gc.unfreeze()
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-gib", type=float, default=1.0)
    ap.add_argument("--backlog-gib", type=float, default=4.0)
    ap.add_argument("--pages", default="16K,64K,256K,2M")
    ap.add_argument("--batch-mb", type=int, default=64, help="engine batch size (MiB)")
    ap.add_argument("--gc", choices=("default", "freeze"), default="default",
                    help="freeze: gc.freeze() once the page table is built (long-lived pages "
                         "leave the cyclic collector's full passes)")
    ap.add_argument("--switch-us", type=float, default=500.0,
                    help="interpreter switch interval; 500 is what `kvtier serve` sets")
    ap.add_argument("--ids", choices=("array", "list"), default="array",
                    help="page ids passed to offload/acquire as an int64 array (slots come back "
                         "as one) or as Python lists")
    ap.add_argument("--latency-samples", type=int, default=1000,
                    help="at least this many 1 MiB restores idle and as many under the backlog")
    ap.add_argument("--repeats", type=int, default=5,
                    help="round trips per page size; every GB/s figure (raw and engine) is the "
                         "median of that many (a single ~20 ms copy is a noisy sample)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.latency_samples < 3:
        ap.error("--latency-samples must be at least 3")
    # As `kvtier serve` does: restores wait at most this long for the GIL behind lane work.
    sys.setswitchinterval(args.switch_us / 1e6)
    device = torch.device(args.device)
    nbytes = int(args.batch_gib * GIB)
    sizes = {"16K": 16 << 10, "64K": 64 << 10, "256K": 256 << 10, "2M": 2 << 20}
    rows = []
    for name in filter(None, args.pages.split(",")):  # --pages "": the latency case alone
        page = sizes[name]
        raw = raw_copies(nbytes, page, device, args.repeats)
        eng = engine_case(
            page, nbytes, device, args.batch_mb, args.gc == "freeze", args.ids == "array",
            args.repeats,
        )
        rows.append({"page": name, **raw, **eng})
        print(json.dumps(rows[-1]), flush=True)
    lat: dict[str, Any] = (  # --backlog-gib 0: the throughput cases alone
        latency_case(
            device, int(args.backlog_gib * GIB), args.gc == "freeze", args.latency_samples
        )
        if args.backlog_gib > 0
        else dict.fromkeys(
            ("idle_p50_ms", "idle_p99_ms", "idle_max_ms", "busy_p50_ms", "busy_p99_ms",
             "busy_max_ms", "idle_samples", "busy_samples"),
            float("nan"),
        )
    )
    print(json.dumps({k: v for k, v in lat.items() if k != "samples_ms"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (args.out / "transfer.json").write_text(
        json.dumps(
            {"device": name, "gc": args.gc, "ids": args.ids, "repeats": args.repeats,
             "rows": rows, "latency": lat},
            indent=2,
        )
    )
    lines = [
        f"Device: {name}; batch {args.batch_gib} GiB of scattered pages; GB/s = 1e9 B/s, "
        f"median of {args.repeats}; gc: {args.gc}; ids: {args.ids}",
        "",
        "| page | raw D2H | raw H2D | raw both | loop D2H | engine offload (data path) | engine restore (data path) | engine both | offload/raw | restore/raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['page']} | {r['raw_d2h']:.1f} | {r['raw_h2d']:.1f} | {r.get('raw_both', float('nan')):.1f} | "
            f"{r['loop_d2h']:.1f} | {r['offload']:.1f} ({r['offload_datapath']:.1f}) | "
            f"{r['restore']:.1f} ({r['restore_datapath']:.1f}) | {r['both']:.1f} | "
            f"{r['offload'] / r['raw_d2h']:.2f} | {r['restore'] / r['raw_h2d']:.2f} |"
        )
    lines += [
        "",
        f"Restore of 1 MiB (4 x 256 KiB): idle p50 {lat['idle_p50_ms']:.2f} ms, p99 {lat['idle_p99_ms']:.2f} ms, "
        f"max {lat['idle_max_ms']:.2f} ms ({lat['idle_samples']:.0f} samples); "
        f"under a {args.backlog_gib} GiB offload backlog p50 {lat['busy_p50_ms']:.2f} ms, p99 {lat['busy_p99_ms']:.2f} ms, "
        f"max {lat['busy_max_ms']:.2f} ms ({lat['busy_samples']:.0f} samples); "
        f"busy p99 / idle p99 {lat['busy_p99_ms'] / lat['idle_p99_ms']:.2f}",
    ]
    (args.out / "transfer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
