"""Registered-KV benchmark: keyed store/load of engine-owned multi-segment pages vs the hardware.

vLLM hands kvtier its own per-layer KV tensors (register mode); one block across all layers is
one page of several segments, stored and loaded by content key. For each engine layout below,
``--blocks`` (1,024) scattered blocks of a ``--cache-blocks`` (8,192) block cache, in one run:
    * raw: one contiguous pinned copy of the same bytes, each way and both ways at once;
    * naive: per segment one ``index_select`` (or ``index_copy_``) and one copy to (from) pinned
      host memory, on one stream; both: a store and a load on two streams;
    * kvtier: ``TierEngine.register`` + ``store`` (fresh keys each round) / ``load`` (into other
      blocks, zeroed first) / both at once (two threads), end to end through keys, page table,
      scheduler and handlers. ``--paths segments`` runs the handlers' per-segment copies (the
      path before the segment table), ``table`` the one-launch segment-table kernel.
Bytes are verified outside the timings: every loaded block equals its source (kvtier and naive).
Each GB/s figure is the median of ``--repeats`` (5). Between rounds the stored keys are dropped,
so every round stores into the same (already pinned) CPU slots, as a steady-state cache does.
``--stages`` also reports where a store's and a load's time goes (see ``stage_report``).

Layouts (bf16, block 16, per layer):
    flash-8x128  vLLM flash-attn ``[2, blocks, 16, 8, 128]``: 64 segments of 32 KiB, 2 MiB/block
    flash-2x64   vLLM flash-attn ``[2, blocks, 16, 2, 64]``: 64 segments of 4 KiB, 256 KiB/block
    mla          MLA latent ``[blocks, 16, 576]`` (DeepSeek-V3, 61 layers): 18 KiB segments
    cpu-8x128    vLLM CPU attention ``[2, blocks, 8, 16, 128]``: 64 segments of 32 KiB

    python benchmarks/registered.py --out results/          # needs CUDA for real figures
    python benchmarks/registered.py --device cpu --cache-blocks 64 --blocks 16 --layouts flash-2x64
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from kvtier.client.block_rows import block_segments
from rawcopy import median_gbs, pinned_copy, timed

import kvtier.transfer.segtable as segtable
from kvtier import OffloadConfig, TierEngine
from kvtier.prefix import salt_key

GIB = 1 << 30
LAYOUTS: dict[str, tuple[int, tuple[int, ...], int]] = {  # layers, shape (B = blocks), block dim
    "flash-8x128": (32, (2, -1, 16, 8, 128), 1),
    "flash-2x64": (32, (2, -1, 16, 2, 64), 1),
    "mla": (61, (-1, 16, 576), 0),
    "cpu-8x128": (32, (2, -1, 8, 16, 128), 1),
}


def make_layers(name: str, blocks: int, device: torch.device) -> list[torch.Tensor]:
    layers, shape, _ = LAYOUTS[name]
    shape = tuple(blocks if d == -1 else d for d in shape)
    out = []
    for _ in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(-(1 << 15), 1 << 15)
        out.append(t)
    return out


def page_rows(segments: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """The pages ``idx`` as ``[len(idx), page]`` (for verification: plain torch, no kvtier)."""
    return torch.cat([s.index_select(0, idx) for s in segments], dim=1)


def zero_blocks(segments: list[torch.Tensor], idx: torch.Tensor) -> None:
    for s in segments:
        s.index_fill_(0, idx, 0)


def pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def raw_case(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    rates = pinned_copy(nbytes, device, repeats)
    names = {"d2h": "raw_store", "h2d": "raw_load", "both": "raw_both"}
    return {names[k]: v for k, v in rates.items()}


def naive_case(
    segments: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, device: torch.device,
    repeats: int,
) -> dict[str, float]:
    """Per segment one index_select + one copy (store), one copy + one index_copy_ (load)."""
    n = len(src)
    host = [pinned(n * s.shape[1], device).view(n, s.shape[1]) for s in segments]
    nbytes = sum(h.numel() for h in host)
    expected = page_rows(segments, src)

    def store(idx: torch.Tensor = src) -> None:
        for seg, h in zip(segments, host, strict=True):
            h.copy_(seg.index_select(0, idx), non_blocking=True)

    def load(idx: torch.Tensor = dst) -> None:
        for seg, h in zip(segments, host, strict=True):
            seg.index_copy_(0, idx, h.to(device, non_blocking=True))

    stores = [timed(store, device) for _ in range(repeats + 1)]
    loads = []
    for _ in range(repeats + 1):
        zero_blocks(segments, dst)
        loads.append(timed(load, device))
        assert torch.equal(page_rows(segments, dst), expected), "naive load: bytes differ"
    out = {"naive_store": median_gbs(nbytes, stores[1:]), "naive_load": median_gbs(nbytes, loads[1:])}
    if device.type == "cuda":
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
        other = torch.roll(dst, 1)  # the load reads what the last store wrote: other blocks

        def both() -> None:
            with torch.cuda.stream(s1):
                store(src)
            with torch.cuda.stream(s2):
                load(other)

        runs = [timed(both, device) for _ in range(repeats + 1)]
        out["naive_both"] = median_gbs(2 * nbytes, runs[1:])
    return out


class KeyedRounds:
    """A registered pool, fresh keys per round, and the drop that frees them between rounds."""

    def __init__(self, engine: TierEngine, segments: list[torch.Tensor], tenant: str) -> None:
        self.engine, self.segments, self.tenant = engine, segments, tenant
        self.pool = engine.register(tenant, segments)
        self._round = 0

    def keys(self, n: int) -> list[bytes]:
        self._round += 1
        return [os.urandom(32) for _ in range(n)]  # vLLM's block hashes: 32-byte digests

    def drop(self, keys: list[bytes]) -> None:
        core = self.engine._core  # benchmark only: forget the round's keys, free their slots
        with core.cond:
            rows = [core.table.keyed(salt_key(self.tenant, k)) for k in keys]
            live = np.array([r for r in rows if r is not None], dtype=np.int64)
            if len(live):
                core.drop(live, "bench")


def kvtier_case(
    segments: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, device: torch.device,
    repeats: int, batch_mb: int,
) -> dict[str, float]:
    n, page = len(src), sum(s.shape[1] for s in segments)
    cfg = OffloadConfig(
        device=str(device), cpu_memory_gb=2.2 * n * page / GIB, gpu_memory_gb=0.01,
        pinned_chunk_mb=256, batch_mb=batch_mb, max_inflight_mb=max(512, 4 * batch_mb),
        metrics_addr="",
    )
    engine = TierEngine(cfg)
    try:
        k = KeyedRounds(engine, segments, "bench")
        pid = k.pool.pool_id
        src_l, dst_l, other_l = src.tolist(), dst.tolist(), torch.roll(dst, 1).tolist()
        expected = page_rows(segments, src)
        stores, loads, boths = [], [], []
        for r in range(repeats + 1):  # round 0 pins the CPU chunks and builds the kernels
            keys = k.keys(n)
            stores.append(timed(functools.partial(engine.store, pid, keys, src_l), device))
            zero_blocks(segments, dst)
            got: list[int] = []
            load = functools.partial(engine.load, pid, keys, dst_l)
            loads.append(timed(lambda load=load, got=got: got.append(load()), device))
            assert got == [n] and torch.equal(page_rows(segments, dst), expected), (
                f"round {r}: kvtier load: bytes differ"
            )
            zero_blocks(segments, torch.roll(dst, 1))
            fresh = k.keys(n)
            both_got: list[int] = []

            def both(keys: list[bytes] = keys, fresh: list[bytes] = fresh,
                     got: list[int] = both_got) -> None:
                th = threading.Thread(target=lambda: got.append(engine.load(pid, keys, other_l)))
                th.start()
                got.append(engine.store(pid, fresh, src_l))
                th.join()

            boths.append(timed(both, device))
            assert both_got == [n, n] and torch.equal(
                page_rows(segments, torch.roll(dst, 1)), expected
            ), f"round {r}: kvtier both: bytes differ"
            k.drop(keys + fresh)
        nbytes = n * page
        return {
            "kvtier_store": median_gbs(nbytes, stores[1:]),
            "kvtier_load": median_gbs(nbytes, loads[1:]),
            "kvtier_both": median_gbs(2 * nbytes, boths[1:]),
            "kvtier_store_range": [nbytes / max(stores[1:]) / 1e9, nbytes / min(stores[1:]) / 1e9],
            "kvtier_load_range": [nbytes / max(loads[1:]) / 1e9, nbytes / min(loads[1:]) / 1e9],
        }
    finally:
        engine.close()


def layout_case(name: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    layers = make_layers(name, args.cache_blocks, device)
    segments = [s for t in layers for s in block_segments(t, args.cache_blocks)]
    page = sum(s.shape[1] for s in segments)
    gen = torch.Generator().manual_seed(0)
    picked = torch.randperm(args.cache_blocks, generator=gen)[: 2 * args.blocks]
    src, dst = picked[: args.blocks].to(device), picked[args.blocks :].to(device)
    base = {"layout": name, "segments": len(segments), "piece_bytes": segments[0].shape[1],
            "page_bytes": page, "blocks": args.blocks, "bytes": args.blocks * page}
    base.update(raw_case(args.blocks * page, device, args.repeats))
    base.update(naive_case(segments, src, dst, device, args.repeats))
    rows = []
    for path in args.paths.split(","):
        segtable.HAVE_TRITON = path == "table" and TRITON  # segments: the per-segment copies
        row = {**base, "path": path}
        row.update(kvtier_case(segments, src, dst, device, args.repeats, args.batch_mb))
        if args.stages:
            from registered_stages import stage_report

            row["stages"] = stage_report(segments, src, dst, device, args.batch_mb)
        rows.append(row)
        print(json.dumps(row), flush=True)
    segtable.HAVE_TRITON = TRITON
    return rows


TRITON = segtable.HAVE_TRITON


def table_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| layout | piece | block | path | raw GB/s store / load / both | naive GB/s | kvtier GB/s "
        "| naive of raw | kvtier of raw | kvtier / naive |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ways = [d for d in ("store", "load", "both") if f"raw_{d}" in r]

        def cells(fmt: str, fn: Callable[[str], float], ways: list[str] = ways) -> str:
            return " / ".join(format(fn(d), fmt) for d in ways)

        lines.append(
            f"| {r['layout']} | {r['piece_bytes'] / 1024:g} KiB | {r['page_bytes'] / 1024:g} KiB "
            f"| {r['path']} | {cells('.1f', lambda d, r=r: r[f'raw_{d}'])} "
            f"| {cells('.1f', lambda d, r=r: r[f'naive_{d}'])} "
            f"| {cells('.1f', lambda d, r=r: r[f'kvtier_{d}'])} "
            f"| {cells('.2f', lambda d, r=r: r[f'naive_{d}'] / r[f'raw_{d}'])} "
            f"| {cells('.2f', lambda d, r=r: r[f'kvtier_{d}'] / r[f'raw_{d}'])} "
            f"| {cells('.2f', lambda d, r=r: r[f'kvtier_{d}'] / r[f'naive_{d}'])} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--cache-blocks", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=1024, help="scattered blocks per call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-mb", type=int, default=64, help="engine batch size (MiB)")
    ap.add_argument("--paths", default="table", help="comma list of: table, segments")
    ap.add_argument("--stages", action="store_true", help="stage breakdown of a store and a load")
    ap.add_argument("--switch-us", type=float, default=500.0,
                    help="interpreter switch interval; 500 is what `kvtier serve` sets")
    args = ap.parse_args()
    if args.repeats < 1 or 2 * args.blocks > args.cache_blocks:
        ap.error("need --repeats >= 1 and 2 * --blocks <= --cache-blocks")
    sys.setswitchinterval(args.switch_us / 1e6)
    device = torch.device(args.device)
    rows = []
    for name in args.layouts.split(","):
        rows += layout_case(name, args, device)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev_name, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "repeats": args.repeats, "batch_mb": args.batch_mb, "triton": TRITON,
            "torch": torch.__version__}
    (args.out / "registered.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [f"Device: {dev_name}; {args.blocks} scattered blocks of {args.cache_blocks}; "
             f"GB/s = 1e9 B/s, median of {args.repeats}; batch {args.batch_mb} MiB", "",
             *table_md(rows)]
    (args.out / "registered.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
