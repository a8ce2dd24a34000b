"""Host counters around the engine: what the machine does while the latency case runs.

A diagnostic, not a figure of merit: reads Linux counters (``/proc``) outside every timed call.
    * ``latency``: the transfer benchmark's latency case (1 MiB restores, idle and under a 4 GiB
      offload backlog) with, per sample, the acquiring thread's CPU time, run-queue wait
      (schedstat), page faults and context switches, and the machine's steal ticks, TLB
      shootdowns and function-call IPIs (cross-CPU thread wake-ups) over the sample; prints the
      slowest samples with their counters and the totals per phase.
    * ``drain``: interrupts per second while a 4 GiB offload backlog drains, next to plain
      ``torch`` copy loops (spinning and blocking syncs) and a sleeping process for reference.

    python benchmarks/host_counters.py latency --out results/
    python benchmarks/host_counters.py drain
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier import OffloadConfig, TierEngine

GIB = 1 << 30
PAGE = 256 << 10
IRQS = ("CAL", "TLB", "RES", "LOC")


def machine() -> dict[str, int]:
    """Interrupt totals over all CPUs, and the cpu line of /proc/stat (ticks)."""
    out: dict[str, int] = {}
    with open("/proc/interrupts") as f:
        ncpu = len(f.readline().split())
        for line in f:
            parts = line.split()
            if parts and parts[0].rstrip(":") in IRQS:
                out[parts[0].rstrip(":")] = sum(int(x) for x in parts[1 : 1 + ncpu])
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    out["steal"], out["busy"] = cpu[7], cpu[0] + cpu[2]
    return out


def thread() -> dict[str, float]:
    """The calling thread: CPU seconds, run-queue wait seconds, faults, context switches."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    with open("/proc/thread-self/schedstat") as f:
        _run, wait, _slices = f.read().split()
    return {"cpu": time.thread_time(), "rqwait": int(wait) / 1e9, "minflt": r.ru_minflt,
            "vcs": r.ru_nvcsw, "ivcs": r.ru_nivcsw}


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: b[k] - a[k] for k in a}


def make_engine(device: str, backlog: int) -> TierEngine:
    return TierEngine(OffloadConfig(
        device=device, page_size=PAGE, gpu_memory_gb=(backlog + (64 << 20)) / GIB + 0.01,
        cpu_memory_gb=(backlog + (256 << 20)) / GIB, pinned_chunk_mb=256, batch_mb=64,
        max_inflight_mb=512, threshold=1.0, low_watermark=0.99, metrics_addr=""))


def latency(device: str, backlog: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    engine = make_engine(device, backlog)
    try:
        pool = engine.attach("lat", backlog // PAGE + 256, PAGE)
        req = [p for p, _ in engine.allocate(pool.pool_id, 256) or []]
        bulk = [p for p, _ in engine.allocate(pool.pool_id, backlog // PAGE) or []]
        engine.release(pool.pool_id, req + bulk)
        samples: dict[str, list[dict[str, Any]]] = {"idle": [], "busy": []}

        def one_round(busy: bool, keep: bool) -> None:
            engine.offload(pool.pool_id, req)
            engine.wait_idle(120)
            if busy:
                engine.offload(pool.pool_id, bulk)
            for i in range(0, len(req), 4):
                if busy and engine.stats().queued_offloads == 0:
                    break
                m0, t0 = machine(), thread()
                start = time.perf_counter()
                engine.acquire(pool.pool_id, req[i : i + 4])
                wall = time.perf_counter() - start
                t1, m1 = thread(), machine()
                if keep:
                    samples["busy" if busy else "idle"].append(
                        {"wall": wall, **delta(t0, t1), **delta(m0, m1)})
                engine.release(pool.pool_id, req[i : i + 4])
            if busy:
                engine.wait_idle(120)
                engine.acquire(pool.pool_id, bulk)
                engine.release(pool.pool_id, bulk)

        one_round(False, False)  # warm-up, as the transfer benchmark does
        one_round(True, False)
        for busy in (False, True):
            for _ in range(rounds):
                one_round(busy, True)
        return samples
    finally:
        engine.close()


def show(samples: dict[str, list[dict[str, Any]]], top: int) -> None:
    ms = ("wall", "cpu", "rqwait")
    for phase, xs in samples.items():
        walls = [x["wall"] for x in xs]
        q = statistics.quantiles(walls, n=100)
        totals = {k: sum(x[k] for x in xs) for k in ("steal", "CAL", "TLB", "minflt")}
        print(f"{phase}: {len(xs)} samples, p50 {q[49] * 1e3:.2f} p99 {q[98] * 1e3:.2f} max "
              f"{max(walls) * 1e3:.2f} ms; totals over {sum(walls) * 1e3:.0f} ms: {totals}")
        for x in sorted(xs, key=lambda x: -x["wall"])[:top]:
            print("   " + " ".join(f"{k} {x[k] * 1e3:.2f}" if k in ms else f"{k} {x[k]}"
                                   for k in (*ms, "minflt", "vcs", "ivcs", "steal", "CAL", "TLB")))


def rate(name: str, fn: Callable[[], object], seconds: float = 2.0) -> None:
    a, start, n = machine(), time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    dt = time.perf_counter() - start
    d = delta(a, machine())
    print(f"{name:34s} {n:6d} iterations  " + "  ".join(f"{k}/s {v / dt:.0f}" for k, v in d.items()))


def drain(device: str, backlog: int) -> None:
    dev = torch.device(device)
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def copy(blocking: bool) -> Callable[[], None]:
        event = torch.cuda.Event(blocking=blocking) if stream is not None else None

        def run() -> None:
            if stream is None or event is None:
                pinned.copy_(src)
                return
            with torch.cuda.stream(stream):
                pinned.copy_(src, non_blocking=True)
                event.record(stream)
            event.synchronize()
        return run

    rate("sleeping", lambda: time.sleep(0.01))
    rate("64 MiB D2H copies, spinning sync", copy(False))
    rate("64 MiB D2H copies, blocking sync", copy(True))
    engine = make_engine(device, backlog)
    try:
        pool = engine.attach("drain", backlog // PAGE + 16, PAGE)
        bulk = [p for p, _ in engine.allocate(pool.pool_id, backlog // PAGE) or []]
        engine.release(pool.pool_id, bulk)
        for i in range(4):  # the first is a warm-up
            engine.offload(pool.pool_id, bulk)
            a, start = machine(), time.perf_counter()
            engine.wait_idle(120)
            dt = time.perf_counter() - start
            d = delta(a, machine())
            if i:
                label = f"engine: {backlog / GIB:g} GiB offload drain"
                print(f"{label:34s} {dt * 1e3:6.0f} ms          "
                      + "  ".join(f"{k}/s {v / dt:.0f}" for k, v in d.items()))
            engine.acquire(pool.pool_id, bulk)
            engine.release(pool.pool_id, bulk)
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("latency", "drain"))
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backlog-gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=5, help="latency: recorded rounds per phase")
    ap.add_argument("--top", type=int, default=8, help="latency: slowest samples shown")
    ap.add_argument("--out", type=Path, help="latency: write every sample to OUT/host_counters.json")
    args = ap.parse_args()
    backlog = int(args.backlog_gib * GIB)
    if args.mode == "drain":
        drain(args.device, backlog)
        return
    samples = latency(args.device, backlog, args.rounds)
    show(samples, args.top)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_counters.json").write_text(json.dumps(samples))


if __name__ == "__main__":
    main()
