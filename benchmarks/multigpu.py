"""Several GPUs, one daemon: per-GPU and aggregate offload/restore, and cross-GPU restore latency.

One in-process engine serves every GPU given (``--devices``, default: every visible GPU), one
pool per GPU, one shared CPU budget. In one run:
    * raw: one pinned ``copy_`` per GPU, all GPUs at once (each on its own stream), D2H then
      H2D: per-GPU GB/s (CUDA events) and the aggregate (bytes of all GPUs / wall time);
    * engine: ``offload`` of ``--gib`` per GPU, all GPUs at once (one thread each; a GPU's time
      ends when its pool has no offload in flight), then ``acquire`` (restore) of it, all at
      once; per GPU and aggregate, every restored page checked against the bytes written;
    * latency: 1 MiB restores (4 x 256 KiB) on the first GPU: idle, while the *last* GPU drains
      a ``--backlog-gib`` offload backlog (the case per-GPU lanes are for) and, as the peers in
      the same run, while a plain torch loop on a thread of this process copies the last GPU
      to pinned memory (what sharing the process with another GPU's copies costs by itself)
      and while the first GPU drains a backlog itself; p50/p99/max over at least
      ``--latency-samples`` each, the cases' rounds taken in turn, restored bytes checked
      after every round.
The interpreter's switch interval is the daemon's (``--switch-us``, 500 as `kvtier serve` sets).
Figures are medians of ``--repeats``. Writes ``multigpu.json`` to ``--out`` and prints a table.
With one GPU (or ``--devices cpu``, a smoke run) it reports what one device can.

    python benchmarks/multigpu.py --out bench-out/   # ~1 min on 2 GPUs with the defaults
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import OffloadConfig, TierEngine

GIB, MIB = 1 << 30, 1 << 20


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def raw_concurrent(devs: list[str], nbytes: int, repeats: int) -> dict[str, Any]:
    """One pinned copy per GPU, every GPU at once, each way (CUDA only)."""
    bufs = []
    for d in devs:
        with torch.cuda.device(d):
            gpu = torch.empty(nbytes, dtype=torch.uint8, device=d)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            bufs.append((gpu, host, torch.cuda.Stream(d)))

    def once(d2h: bool) -> tuple[list[float], float]:
        for d in devs:
            sync(d)
        marks = []
        t0 = time.perf_counter()
        for d, (gpu, host, stream) in zip(devs, bufs, strict=True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(d), torch.cuda.stream(stream):
                start.record(stream)
                if d2h:
                    host.copy_(gpu, non_blocking=True)
                else:
                    gpu.copy_(host, non_blocking=True)
                end.record(stream)
            marks.append((start, end))
        for d in devs:
            sync(d)
        wall = time.perf_counter() - t0
        return [s.elapsed_time(e) / 1e3 for s, e in marks], wall

    out: dict[str, Any] = {}
    for name, d2h in (("d2h", True), ("h2d", False)):
        runs = [once(d2h) for _ in range(1 + repeats)][1:]  # a warm-up first
        out[f"raw_{name}_per_gpu"] = [
            nbytes / statistics.median(r[0][i] for r in runs) / 1e9 for i in range(len(devs))
        ]
        wall = statistics.median(r[1] for r in runs)
        out[f"raw_{name}_aggregate"] = len(devs) * nbytes / wall / 1e9
    return out


def at_once(devs: list[str], work: Callable[[int], None]) -> tuple[list[float], float]:
    """``work(i)`` for every device at once, one thread each: each one's seconds, and the wall
    time from the common start to the last end."""
    barrier = threading.Barrier(len(devs) + 1)
    took = [0.0] * len(devs)

    def run(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        work(i)
        sync(devs[i])
        took[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(devs))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return took, time.perf_counter() - t0


def drained(pool: Any, timeout: float = 120.0) -> None:
    """Wait until the pool has no offload in flight (its pages have all landed on the CPU)."""
    deadline = time.monotonic() + timeout
    while pool.moving_down:
        if time.monotonic() > deadline:
            raise TimeoutError("offloads never drained")
        time.sleep(0.0002)


def engine_concurrent(devs: list[str], nbytes: int, page: int, repeats: int) -> dict[str, Any]:
    """Offload then restore ``nbytes`` per GPU, every GPU at once; restored bytes checked."""
    n = nbytes // page
    engine = TierEngine(OffloadConfig(
        device=",".join(devs), page_size=page, gpu_memory_gb=len(devs) * nbytes / GIB + 0.01,
        cpu_memory_gb=len(devs) * (nbytes + 64 * MIB) / GIB, pinned_chunk_mb=256, batch_mb=64,
        max_inflight_mb=512, threshold=1.0, low_watermark=0.99, metrics_addr="",
    ))
    try:
        pools, ids, expect = [], [], []
        for d in devs:
            pool = engine.attach(f"rank-{d}", n, page, device=d)
            got = engine.allocate(pool.pool_id, n)
            assert got is not None
            seg = pool.segments[0]
            seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8, device=seg.device))
            first = torch.tensor([s for _, s in got], device=seg.device)
            expect.append(seg[first].clone())  # page k's bytes, in page order
            page_ids = np.array([p for p, _ in got], dtype=np.int64)
            sync(d)
            engine.release(pool.pool_id, page_ids)
            pools.append(pool)
            ids.append(page_ids)
        slots: list[Any] = [None] * len(devs)

        def offload(i: int) -> None:
            engine.offload(pools[i].pool_id, ids[i])
            drained(pools[i])

        def restore(i: int) -> None:
            slots[i] = engine.acquire(pools[i].pool_id, ids[i])

        offs, ress = [], []
        for rep in range(1 + repeats):  # a warm-up first (first pinning, first kernels)
            offs.append(at_once(devs, offload))
            assert engine.wait_idle(120)
            for d, pool in zip(devs, pools, strict=True):  # bytes must come from the CPU tier
                pool.segments[0].zero_()
                sync(d)  # done before the restores' copies (on the engine's streams) start
            ress.append(at_once(devs, restore))
            for i, pool in enumerate(pools):
                seg = pool.segments[0]
                assert slots[i] is not None, f"restore refused on {devs[i]}"
                landed = seg[torch.from_numpy(slots[i]).to(seg.device)]
                assert torch.equal(landed, expect[i]), f"restored bytes differ on {devs[i]} ({rep})"
                engine.release(pool.pool_id, ids[i])
        out: dict[str, Any] = {}
        for name, runs in (("offload", offs[1:]), ("restore", ress[1:])):
            out[f"{name}_per_gpu"] = [
                nbytes / statistics.median(r[0][i] for r in runs) / 1e9 for i in range(len(devs))
            ]
            agg = statistics.median(r[1] for r in runs)
            out[f"{name}_aggregate"] = len(devs) * nbytes / agg / 1e9
        return out
    finally:
        engine.close()


class RawLoop:
    """The peer of a backlog on another GPU: a plain torch loop on a thread of this process,
    copying ``device`` to pinned memory 64 MiB at a time (8 copies, then a synchronize) until
    stopped. What an engine's restore pays for sharing the process with another GPU's copies
    and nothing else."""

    def __init__(self, device: str, chunk: int = 64 * MIB) -> None:
        self._chunk = chunk
        self._gpu = torch.empty(8 * chunk, dtype=torch.uint8, device=device)
        self._host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
        self._stream = torch.cuda.Stream(device)
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        c = self._chunk
        with torch.cuda.stream(self._stream):
            while not self._halt.is_set():
                for i in range(8):
                    self._host.copy_(self._gpu[i * c : (i + 1) * c], non_blocking=True)
                self._stream.synchronize()

    def start(self) -> None:
        self._halt.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.005)  # copies under way before the first sample

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join()


def latency(devs: list[str], backlog: int, samples: int) -> dict[str, Any]:
    """1 MiB restores on the first GPU: idle, under the last GPU's backlog, under its own."""
    page, per_req, nreq = 256 << 10, 4, 256
    nb = backlog // page
    first, last = devs[0], devs[-1]
    cases = ["idle", "same_gpu"] + (["other_gpu", "other_gpu_raw"] if len(devs) > 1 else [])
    engine = TierEngine(OffloadConfig(
        device=",".join(devs), page_size=page,
        gpu_memory_gb=(2 * backlog + nreq * page) / GIB + 0.01,
        cpu_memory_gb=(backlog + nreq * page + 256 * MIB) / GIB, pinned_chunk_mb=256,
        batch_mb=64, max_inflight_mb=512, threshold=1.0, low_watermark=0.99, metrics_addr="",
    ))
    try:
        req = engine.attach("lat", nreq, page, device=first)
        backlogs = {"same_gpu": engine.attach("backlog-same", nb, page, device=first)}
        if len(devs) > 1:
            backlogs["other_gpu"] = engine.attach("backlog-other", nb, page, device=last)
        req_got = engine.allocate(req.pool_id, nreq)
        assert req_got is not None
        seg = req.segments[0]
        seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8, device=seg.device))
        expect = seg.clone()
        sync(first)
        req_ids = np.array([p for p, _ in req_got], dtype=np.int64)
        first_slot = {int(p): int(s) for p, s in req_got}
        engine.release(req.pool_id, req_ids)
        bulk: dict[str, np.ndarray] = {}
        for name, pool in backlogs.items():
            got = engine.allocate(pool.pool_id, nb)
            assert got is not None
            bulk[name] = np.array([p for p, _ in got], dtype=np.int64)
            engine.release(pool.pool_id, bulk[name])
        groups = [req_ids[i : i + per_req] for i in range(0, nreq, per_req)]
        raw = RawLoop(last) if len(devs) > 1 else None

        def round_(case: str) -> list[float]:
            engine.offload(req.pool_id, req_ids)
            drained(req)
            seg.zero_()  # restored bytes must come from the CPU tier
            sync(first)
            pool = backlogs.get(case)
            if pool is not None:
                engine.offload(pool.pool_id, bulk[case])
            if case == "other_gpu_raw":
                assert raw is not None
                raw.start()
            lat: list[float] = []
            for ids in groups:
                if pool is not None and not pool.moving_down:
                    break  # the backlog drained: later samples would be idle ones
                t0 = time.perf_counter()
                slots = engine.acquire(req.pool_id, ids)
                sync(first)
                lat.append(time.perf_counter() - t0)
                assert slots is not None
                src = torch.tensor([first_slot[int(p)] for p in ids], device=seg.device)
                assert torch.equal(seg[torch.from_numpy(slots).to(seg.device)], expect[src]), (
                    f"restored bytes differ ({case})"
                )
                engine.release(req.pool_id, ids)
            if case == "other_gpu_raw":
                assert raw is not None
                raw.stop()
            if pool is not None:
                drained(pool)
                assert engine.acquire(pool.pool_id, bulk[case]) is not None
                engine.release(pool.pool_id, bulk[case])
            engine.acquire(req.pool_id, req_ids)  # every request page back, for the next round
            engine.release(req.pool_id, req_ids)
            return lat

        for case in cases:
            round_(case)  # warm-up: first kernels, first pinned chunks
        out: dict[str, Any] = {"samples_ms": {}}
        got: dict[str, list[float]] = {case: [] for case in cases}
        live = list(cases)
        while live:  # a round of each case in turn: drift over the run falls on every case
            for case in list(live):
                taken = round_(case)
                got[case] += taken
                if len(got[case]) >= samples or (not taken and case != "idle"):
                    live.remove(case)  # enough, or the backlog drains before one restore
        for case, xs in got.items():
            q = (statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 2
                 else [float("nan")] * 99)
            out[case] = {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
                         "max_ms": max(xs, default=float("nan")) * 1e3, "samples": len(xs)}
            out["samples_ms"][case] = [x * 1e3 for x in xs]
        return out
    finally:
        engine.close()


def table(devs: list[str], args: argparse.Namespace, res: dict[str, Any]) -> str:
    names = [torch.cuda.get_device_name(d) if d.startswith("cuda") else d for d in devs]
    lines = [f"Devices: {', '.join(f'{d} ({n})' for d, n in zip(devs, names, strict=True))}; "
             f"{args.gib} GiB per GPU per direction, all GPUs at once; GB/s = 1e9 B/s, "
             f"median of {args.repeats}; page {args.page_kib} KiB",
             "", "| what | " + " | ".join(devs) + " | aggregate |",
             "|---" * (len(devs) + 2) + "|"]
    for key in ("raw_d2h", "raw_h2d", "offload", "restore"):
        if f"{key}_per_gpu" in res:
            per = " | ".join(f"{x:.1f}" for x in res[f"{key}_per_gpu"])
            lines.append(f"| {key} | {per} | {res[f'{key}_aggregate']:.1f} |")
    lat = res.get("latency", {})
    for case in ("idle", "other_gpu_raw", "other_gpu", "same_gpu"):
        if case in lat:
            c = lat[case]
            lines.append(f"\n1 MiB restore on {devs[0]}, {case}: p50 {c['p50_ms']:.2f} ms, "
                         f"p99 {c['p99_ms']:.2f} ms, max {c['max_ms']:.2f} ms "
                         f"({c['samples']} samples)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--devices", default="",
                    help="comma list (cuda:0,cuda:1 or cpu); default: every visible GPU")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per GPU per direction")
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--backlog-gib", type=float, default=4.0, help="0: skip the latency case")
    ap.add_argument("--latency-samples", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--switch-us", type=float, default=500.0,
                    help="interpreter switch interval; 500 is what `kvtier serve` sets")
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_us / 1e6)
    devs = args.devices.split(",") if args.devices else [
        f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    if "cpu" in devs and devs != ["cpu"]:
        ap.error("--devices: cpu is one device on its own")
    nbytes = int(args.gib * GIB) // (args.page_kib << 10) * (args.page_kib << 10)
    res: dict[str, Any] = {"devices": devs, "gib": args.gib, "page_kib": args.page_kib,
                           "repeats": args.repeats, "backlog_gib": args.backlog_gib,
                           "switch_us": args.switch_us}
    t0 = time.perf_counter()
    if devs[0].startswith("cuda"):
        res.update(raw_concurrent(devs, nbytes, args.repeats))
        print(json.dumps({k: v for k, v in res.items() if k.startswith("raw")}), flush=True)
    res.update(engine_concurrent(devs, nbytes, args.page_kib << 10, args.repeats))
    if args.backlog_gib > 0:
        res["latency"] = latency(devs, int(args.backlog_gib * GIB), args.latency_samples)
    res["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multigpu.json").write_text(json.dumps(res, indent=2))
    print(table(devs, args, res))
    print(f"({res['seconds']:.1f} s; JSON: {args.out / 'multigpu.json'})")


if __name__ == "__main__":
    main()
