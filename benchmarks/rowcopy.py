"""Row copy benchmark: the engine side's page copies through ``kvtier.transfer.gather``.

Times, per call, ``DevicePool.gather_rows`` / ``scatter_rows`` of many pages beside the
per-segment loops the pool had before it used the one row copy (kept here as the reference),
for pools of one segment and of 32 (vLLM-like: a segment per layer). ``page`` / ``put_page``
(``TierEngine.read``/``write``) are the engine's former one-page copies, moved unchanged. Each figure is the best of
``--rounds`` rounds of ``--calls`` calls; the transfer handlers' kernels are not involved.

    python benchmarks/rowcopy.py                   # CPU
    python benchmarks/rowcopy.py --device cuda:0   # the same calls on a GPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvtier.tiers.device import DevicePool


def _old_gather(segs: list[torch.Tensor], slots: list[int], device: str) -> torch.Tensor:
    idx = torch.tensor(slots, dtype=torch.long).to(device)
    out = torch.empty((len(slots), sum(s.shape[1] for s in segs)), dtype=torch.uint8,
                      device=device)
    if len(segs) == 1:
        return torch.index_select(segs[0], 0, idx, out=out)
    off = 0
    for s in segs:
        out[:, off : off + s.shape[1]] = s.index_select(0, idx)
        off += s.shape[1]
    return out


def _old_scatter(segs: list[torch.Tensor], slots: list[int], src: torch.Tensor) -> None:
    idx = torch.tensor(slots, dtype=torch.long).to(src.device)
    off = 0
    for s in segs:
        s.index_copy_(0, idx, src[:, off : off + s.shape[1]])
        off += s.shape[1]


def _best_us(fn: Callable[[], object], calls: int, rounds: int, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256, help="pages per gather/scatter call")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    size = args.page_kib * 1024
    slots = list(range(0, 2 * args.batch, 2))[: args.batch]
    print(f"device {args.device}, {args.slots} slots of {args.page_kib} KiB, {args.batch} pages a call")
    print("| segments | call | before (us) | now (us) |\n|---|---|---|---|")
    for nseg in (1, 32):
        for name, before_us, now_us in _measure(nseg, size, slots, args):
            print(f"| {nseg} | {name} | {before_us:.1f} | {now_us:.1f} |")


def _measure(
    nseg: int, size: int, slots: list[int], args: argparse.Namespace
) -> list[tuple[str, float, float]]:
    dev = args.device
    segs = [torch.zeros(args.slots, size // nseg, dtype=torch.uint8, device=dev)
            for _ in range(nseg)]
    pool = DevicePool.from_segments(segs)
    src = torch.ones(len(slots), size, dtype=torch.uint8, device=dev)
    cases = [
        ("gather_rows", lambda: _old_gather(segs, slots, dev), lambda: pool.gather_rows(slots)),
        ("scatter_rows", lambda: _old_scatter(segs, slots, src),
         lambda: pool.scatter_rows(slots, src)),
    ]
    return [
        (name, _best_us(before, args.calls, args.rounds, dev),
         _best_us(now, args.calls, args.rounds, dev))
        for name, before, now in cases
    ]

if __name__ == "__main__":
    main()
