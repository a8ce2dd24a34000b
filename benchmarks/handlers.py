"""Handler benchmark: the transfer handlers alone, without the engine, against one raw copy.

What the engine's data path can reach at best: scattered pages (every other pool slot) moved by
the CUDA (or CPU-mode) handlers in batches, two in flight as a scheduler lane keeps them, from
one thread, with no page table, policy or lock. Reports, per page size and direction, GB/s and
the host time per batch spent launching (indices, gather/scatter, DMA calls) and waiting, next
to one contiguous pinned copy of the same bytes measured in the same run. ``--trace`` adds a
torch profiler table of the launches (host-side op times) for the first page size.

    python benchmarks/handlers.py --device cuda:0
    python benchmarks/handlers.py --device cpu --pages 16K --gib 0.25
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from kvtier.tiers.device import DevicePool
from kvtier.tiers.pinned import HostArena
from kvtier.transfer import build_handlers
from kvtier.transfer.base import Moves
from kvtier.types import Direction

GIB, MIB = 1 << 30, 1 << 20
SIZES = {"16K": 16 << 10, "64K": 64 << 10, "256K": 256 << 10, "2M": 2 << 20}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_gbs(nbytes: int, device: torch.device) -> dict[str, float]:
    """One contiguous copy each way (pinned host memory), best of three."""
    pin = device.type == "cuda"
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    out: dict[str, float] = {}
    for name, fn in (("d2h", lambda: host.copy_(gpu, non_blocking=True)),
                     ("h2d", lambda: gpu.copy_(host, non_blocking=True))):
        best = float("inf")
        for _ in range(3):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - start)
        out[name] = nbytes / best / 1e9
    return out


def drive(launch: Callable[[Moves], Callable[[], list[bool]]], batches: list[Moves],
          device: torch.device) -> tuple[float, float, float]:
    """Run ``batches`` as a lane does (launch i+1, then wait for i): wall, launch and wait s."""
    sync(device)
    t_launch = t_wait = 0.0
    start = time.perf_counter()
    pending = None
    for batch in [*batches, None]:
        t0 = time.perf_counter()
        nxt = launch(batch) if batch is not None else None
        t1 = time.perf_counter()
        if pending is not None:
            assert all(pending())
        t_launch += t1 - t0
        t_wait += time.perf_counter() - t1
        pending = nxt
    sync(device)
    return time.perf_counter() - start, t_launch, t_wait


def split(direction: Direction, page: int, srcs: np.ndarray, dsts: np.ndarray, pool: DevicePool,
          per_batch: int) -> list[Moves]:
    return [Moves(direction, page, srcs[i:i + per_batch], dsts[i:i + per_batch], pool=pool)
            for i in range(0, len(srcs), per_batch)]


def one_size(page: int, nbytes: int, batch_bytes: int, device: torch.device, rounds: int,
             trace: bool) -> list[dict[str, float | str]]:
    n = nbytes // page
    pool = DevicePool.allocate(2 * n, page, str(device))
    arena = HostArena(int(nbytes * 1.1) + (256 << 20), 256 * MIB, pin=device.type == "cuda")
    handlers = build_handlers(device, arena, None, batch_bytes)
    try:
        pool.segments[0].copy_(torch.randint(0, 256, pool.segments[0].shape, dtype=torch.uint8,
                                             device=pool.segments[0].device))
        gpu_slots = np.arange(0, 2 * n, 2, dtype=np.int64)  # scattered: every other slot
        host_slots = arena.alloc_array(page, n)
        assert host_slots is not None
        per = max(1, batch_bytes // page)
        cases = {
            "offload": split(Direction.GPU_TO_CPU, page, gpu_slots, host_slots, pool, per),
            "restore": split(Direction.CPU_TO_GPU, page, host_slots, gpu_slots + 1, pool, per),
        }
        rows: list[dict[str, float | str]] = []
        for name, batches in cases.items():
            handler = handlers[batches[0].direction]
            drive(handler.launch, batches, device)  # warm-up (maps and pins the host chunks)
            best = min(drive(handler.launch, batches, device) for _ in range(rounds))
            wall, launch, wait = best
            rows.append({"page": f"{page >> 10}K", "step": name, "gbs": round(nbytes / wall / 1e9, 2),
                         "launch_us_per_batch": round(launch / len(batches) * 1e6, 1),
                         "wait_us_per_batch": round(wait / len(batches) * 1e6, 1),
                         "batches": len(batches)})
            if trace:
                profile(handler.launch, batches, device, name)
        sample = np.arange(0, n, max(1, n // 64))
        seg = pool.segments[0]
        assert torch.equal(seg[torch.from_numpy(gpu_slots[sample]).to(seg.device)],
                           seg[torch.from_numpy(gpu_slots[sample] + 1).to(seg.device)]), \
            "restored bytes differ from the offloaded ones"
        return rows
    finally:
        for h in handlers.values():
            h.close()
        arena.close()
        pool.close()


def profile(launch: Callable[[Moves], Callable[[], list[bool]]], batches: list[Moves],
            device: torch.device, name: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        drive(launch, batches, device)
    print(f"-- torch profiler, {name}, {len(batches)} batches --")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pages", default="16K,64K,256K,2M")
    ap.add_argument("--gib", type=float, default=1.0, help="bytes moved per direction")
    ap.add_argument("--batch-mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    nbytes = int(args.gib * GIB)
    raw = raw_gbs(nbytes, device)
    rows = []
    for i, name in enumerate(args.pages.split(",")):
        rows += one_size(SIZES[name], nbytes, args.batch_mb * MIB, device, args.rounds,
                         args.trace and i == 0)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}),"
          f" {args.gib} GiB per direction, batch {args.batch_mb} MiB; raw d2h {raw['d2h']:.1f}"
          f" GB/s, h2d {raw['h2d']:.1f} GB/s")
    print("| page | step | GB/s | vs raw | launch µs/batch | wait µs/batch | batches |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref = raw["d2h" if r["step"] == "offload" else "h2d"]
        print(f"| {r['page']} | {r['step']} | {r['gbs']} | {float(r['gbs']) / ref:.2f} | "
              f"{r['launch_us_per_batch']} | {r['wait_us_per_batch']} | {r['batches']} |")
    print(json.dumps({"raw": raw, "rows": rows}))


if __name__ == "__main__":
    main()
