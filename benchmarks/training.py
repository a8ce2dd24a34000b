"""Training-offload benchmark: peak GPU memory and step time of a bf16 GPT-style model.

Variants (``--variants``, comma separated; default: the preset's list):
    no_offload            the reference (``--optimizer`` below, no activation offload)
    save_on_cpu           ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
    kvtier_act            kvtier activation offload of every layer but the last, memory first: at
                          each boundary the host waits for the copies of all but the latest layer
                          half (``max_inflight_groups=1``, as TransformerEngine's compute waits)
    kvtier_act_third      of the first third of the layers, copies never waited for
    sweep                 ``kvtier_act@n``: the first n layer halves for several n, copies never
                          waited for, and ``kvtier_act@n~1`` / ``~2`` for the top three n (host
                          waits for all but the last 1 / 2 halves' copies: memory first);
                          the best peak reduction within +10% step time is in the checks
    kvtier_act@n[~k]      one sweep point
    kvtier_act@n+         the first n halves, copies never waited for by the host; entering the
                          last half the compute stream waits for them (their memory goes before
                          the peak); reloads two halves ahead of backward
    kvtier_opt_cpu, kvtier_opt_gpu_stream
                          kvtier optimizer offload (against plain GPU AdamW, fp32 master weights)
    search                the most layers that train with and without kvtier (on a GPU capped at
                          ``--search-gpu-gb``)

Each layer is two offload groups (attention, MLP), so backward prefetches half a layer ahead.
Per activation-offload row the table shows the forward time, the bytes the offload moved and the
physics: ``bound`` = B x (T_fwd + 0.1 T_step) / activation bytes of the no-offload row, with B the
device->host bandwidth measured at start: the share of the activations whose copy can hide behind
the forward plus the +10% step-time allowance (memory is freed only once its copy is done and the
peak is at the end of forward).

Presets (``--shape``; explicit flags override): ``gpt2048`` (default): 24 layers x hidden 2048,
seq 4096, batch 1, plain GPU AdamW in the activation rows. ``wide8192``: 4 layers x hidden 8192,
seq 4096, micro-batch 10, vocab 8192 (the logits stay small), so activations dominate the peak;
the Adam states would dominate the GPU at that width, so every activation row, the no-offload
reference included, runs kvtier's ``OffloadedOptimizer(mode="gpu_stream")`` (states and fp32
master weights on the host). Needs ~52 GiB of GPU and ~75 GiB of pinned host memory (arena
budget 96 GiB unless ``--host-gb`` says otherwise). save_on_cpu is left out there by default: its
own pinned cache (sizes rounded up to powers of two, ~50 GB) next to the optimizer's would crowd
a 128 GiB host; name it in ``--variants`` (before the kvtier rows) to measure it anyway.

Rows are printed (flushed) as measured and the JSON (``--out``) and markdown (``.md``) rewritten
after every row; the run is bounded by ``--budget-s``. ``--tiny`` is a CPU smoke test.

    python benchmarks/training.py --out results/training.json --host-gb 100        # ~4 min
    python benchmarks/training.py --shape wide8192 --out results/wide.json --budget-s 200  # ~2-3 min
    python benchmarks/training.py --tiny --out /tmp/training.json      # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

# the benchmark's own modules, beside this file (also when loaded with runpy)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_model import GPT, Runner
from training_report import GIB, HEADER, Result, bound_of, checks_of, markdown, row
from training_variants import (
    ALL_VARIANTS,
    ONE_POINT,
    PRESETS,
    inflight_bound,
    offload_groups,
    optimizer_for,
    runner_for,
    sweep_points,
)

from kvtier.errors import CapacityError
from kvtier.training import OffloadedOptimizer
from kvtier.training.base import default_arena, get_buffer


def _mem() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def _built_on(dev: str, dtype: torch.dtype) -> Iterator[None]:
    """Create (and initialise) modules directly on ``dev`` in ``dtype``: no fp32 CPU copy first
    (initialising billions of parameters on the CPU takes minutes)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            yield
    finally:
        torch.set_default_dtype(old)


class Trainer:
    """One model and optimizer, reused by every variant with the same layers and optimizer."""

    def __init__(self, a: argparse.Namespace, layers: int, opt_kind: str, arena: Any) -> None:
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.layers, self.opt_kind = layers, opt_kind
        with _built_on(self.dev, torch.bfloat16):
            self.model = GPT(layers, a.hidden, a.heads, a.vocab)
        self.opt = optimizer_for(opt_kind, self.model, arena)
        self.ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=self.dev)

    def close(self) -> None:
        if isinstance(self.opt, OffloadedOptimizer):
            self.opt.close()
        del self.model, self.opt

    def step(self, run: Runner | None, ctx: Any) -> tuple[float, float, float, int, int]:
        """(step s, forward s, forward+backward s, peak bytes, activation peak bytes)."""
        _sync()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        before, t0 = _mem(), time.perf_counter()
        stamps = [t0]
        for i in range(3):
            if cuda:
                marks[i].record()
            if i == 0:
                with ctx:
                    loss = self.model(self.ids, run)
            elif i == 1:
                loss.backward()
            stamps.append(time.perf_counter())
        self.opt.step()
        self.opt.zero_grad()
        _sync()
        step = time.perf_counter() - t0
        if cuda:
            fwd = marks[0].elapsed_time(marks[1]) / 1e3
            fb = marks[0].elapsed_time(marks[2]) / 1e3
            peak = torch.cuda.max_memory_allocated()
            return step, fwd, fb, peak, peak - before
        return step, stamps[1] - t0, stamps[2] - t0, 0, 0


def measure(tr: Trainer, variant: str, a: argparse.Namespace, arena: Any, steps: int,
            max_s: float = float("inf")) -> Result:
    """``a.warmup`` then up to ``steps`` measured steps (at least one; stops after ``max_s``)."""
    run, ctx, off = runner_for(variant, tr.layers, arena, a)
    rows: list[tuple[float, float, float, int, int]] = []
    stats: list[dict[str, int]] = []  # offloader counters before the last measured step, after
    start = time.perf_counter()
    try:
        for s in range(a.warmup + steps):
            before = asdict(off.stats) if off is not None else {}
            r = tr.step(run, ctx)
            if s >= a.warmup:
                rows.append(r)
                stats = [before, asdict(off.stats) if off is not None else {}]
            if rows and time.perf_counter() - start > max_s:
                break
    except torch.cuda.OutOfMemoryError:
        return Result(variant, tr.layers, False, note="CUDA OOM")
    except CapacityError:
        return Result(variant, tr.layers, False, note="host arena budget exhausted")
    finally:
        if off is not None:
            off.flush()
        if variant == "save_on_cpu" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # its pinned blocks would crowd the arena out
    k = len(rows)
    note = f"{k} step(s)" + (" (time cap)" if k < steps else "")
    step_stats = {key: v - stats[0][key] for key, v in stats[1].items()} if stats else {}
    moved = step_stats.get("offloaded_bytes", 0)
    if off is not None:
        note += (f"; last step: host waits {step_stats['host_waits']}, copy waits "
                 f"{step_stats['copy_waits']}, saved but kept "
                 f"{step_stats['kept_bytes'] / GIB:.2f} GiB, reloaded "
                 f"{step_stats['reloaded_bytes'] / GIB:.2f} GiB")
    return Result(variant, tr.layers, True, offload_groups(variant, tr.layers),
                  inflight_bound(variant),
                  sum(r[0] for r in rows) / k, sum(r[1] for r in rows) / k,
                  sum(r[2] for r in rows) / k, max(r[3] for r in rows) / GIB,
                  max(r[4] for r in rows) / GIB, moved / GIB, note=note)


class Trainers:
    """At most one live :class:`Trainer`, rebuilt when the layers or the optimizer change."""

    def __init__(self, a: argparse.Namespace, arena: Any) -> None:
        self.a, self.arena = a, arena
        self.live: Trainer | None = None

    def get(self, layers: int, opt_kind: str) -> Trainer:
        t = self.live
        if t is None or (t.layers, t.opt_kind) != (layers, opt_kind):
            self.drop()
            self.live = Trainer(self.a, layers, opt_kind, self.arena)
        return self.live

    def drop(self) -> None:
        if self.live is not None:
            self.live.close()
        self.live = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_variant(trainers: Trainers, variant: str, a: argparse.Namespace, layers: int,
                steps: int, max_s: float = float("inf")) -> Result:
    """Measure ``variant`` on ``layers`` layers; its optimizer follows its name, else
    ``a.optimizer`` (``kvtier_opt_*``: activations not offloaded; ``*_opt_cpu``: cpu step)."""
    opt = "cpu" if variant.endswith("_opt_cpu") else \
        "gpu_stream" if variant.endswith("_opt_gpu_stream") else a.optimizer
    act = variant.removesuffix("_opt_cpu").removesuffix("_opt_gpu_stream")
    try:
        tr = trainers.get(layers, opt)
    except torch.cuda.OutOfMemoryError:
        trainers.drop()
        return Result(variant, layers, False, note="CUDA OOM building the model")
    except CapacityError:
        trainers.drop()
        return Result(variant, layers, False, note="host arena budget exhausted")
    r = measure(tr, act, a, trainers.arena, steps, max_s)
    r.variant = variant
    if not r.ok:
        trainers.drop()
    return r


@contextmanager
def _gpu_capped(gb: float | None) -> Iterator[str]:
    """Cap this process's CUDA allocations at ``gb`` GiB (a smaller GPU); yields a note."""
    if not gb or not torch.cuda.is_available():
        yield ""
        return
    total = torch.cuda.get_device_properties(0).total_memory
    frac = min(1.0, gb * 2**30 / total)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(frac)
    try:
        yield f"GPU capped at {gb:g} GiB; "
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def search(trainers: Trainers, variant: str, a: argparse.Namespace, deadline: float) -> Result:
    """Most layers (<= --search-max) for which one training step fits: doubling, then bisect;
    stops before a probe that would likely end past ``deadline`` (``time.monotonic()``)."""
    best = Result(variant, 0, False, note="nothing fits")
    lo, hi, n = 0, None, max(1, a.search_start)
    b = argparse.Namespace(**{**vars(a), "seq": a.search_seq, "warmup": 0, "optimizer": "gpu"})
    last_probe_s, stopped = 0.0, ""
    with _gpu_capped(a.search_gpu_gb) as cap:
        while hi is None or hi - lo > max(1, lo // 8):  # 12% resolution keeps the search short
            # a probe of more layers takes longer: budget 1.5x the last one, scaled by size
            guess = 1.5 * last_probe_s * (n / max(lo, 1) if lo else 1.0)
            if time.monotonic() + guess > deadline:
                stopped = ", stopped by the time budget"
                break
            t0 = time.monotonic()
            search_trainers = Trainers(b, trainers.arena)
            r = run_variant(search_trainers, variant, b, n, steps=1)
            search_trainers.drop()
            last_probe_s = time.monotonic() - t0
            print(f"  search {variant}: {n} layers -> {'ok' if r.ok else r.note} "
                  f"({last_probe_s:.1f} s)", flush=True)
            if r.ok:
                lo, best = n, r
            else:
                hi = n
            if hi is None and n >= a.search_max:
                break
            n = min(a.search_max, n * 2) if hi is None else (lo + hi) // 2
    best.note = f"{cap}search: largest ok={lo}, smallest failing={hi}{stopped}"
    return best


def link_gbs(arena: Any, nbytes: int = 1 << 30) -> float | None:
    """Device->host bandwidth into an arena buffer (GB/s), best of 3; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = get_buffer(arena, nbytes)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    arena.put_buffer(dst)
    return nbytes / best / 1e9


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--shape", choices=sorted(PRESETS), default="gpt2048",
                   help="preset of the flags below (explicit flags override)")
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--optimizer", choices=["gpu", "gpu_stream", "cpu"], default=None,
                   help="optimizer of the activation rows (gpu: plain GPU AdamW)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join(ALL_VARIANTS)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sweep-steps", type=int, default=2, help="measured steps per sweep point")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--search-start", type=int, default=8)
    p.add_argument("--search-max", type=int, default=96, help="bound of the layer search")
    p.add_argument("--search-seq", type=int, default=2048, help="sequence length in the search")
    p.add_argument("--no-search", action="store_true", help="same as leaving out 'search'")
    p.add_argument("--search-gpu-gb", type=float, default=16,
                   help="GPU memory cap during the layer search (0: the whole GPU)")
    p.add_argument("--host-gb", type=float, default=None,
                   help="pinned arena budget (GiB; default: the preset's, else half of RAM)")
    p.add_argument("--budget-s", type=float, default=240, help="bound of the whole run (s)")
    p.add_argument("--variant-max-s", type=float, default=20,
                   help="a variant stops measuring steps after this many seconds")
    p.add_argument("--min-numel", type=int, default=256 * 1024,
                   help="smallest saved tensor (elements) the activation offload moves")
    p.add_argument("--pace-lag", type=int, default=3,
                   help="saves/boundaries the host may run ahead while offload copies run")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    for k, v in PRESETS[a.shape].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.variants = [v for v in a.variants.split(",") if v and not (v == "search" and a.no_search)]
    bad = [v for v in a.variants if v not in ALL_VARIANTS and not ONE_POINT.fullmatch(v)]
    if bad:
        p.error(f"--variants: unknown {bad}; accepted: {','.join(ALL_VARIANTS)} or one sweep "
                "point kvtier_act@N, kvtier_act@N~K or kvtier_act@N+")
    if a.tiny:
        a.layers, a.hidden, a.heads, a.seq, a.vocab, a.batch = 2, 64, 4, 128, 257, 2
        a.steps, a.sweep_steps, a.warmup, a.min_numel = 1, 1, 0, 1024
        a.search_start, a.search_max, a.search_seq = 1, 4, 64
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t_start = time.monotonic()
    deadline = t_start + a.budget_s
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    arena = default_arena(None if a.host_gb is None else int(a.host_gb * 2**30))
    gbs = None if a.tiny else link_gbs(arena)  # the smoke test stays off the GPU
    print(f"# Training offload on {device}, {a.shape}: {a.layers} layers x {a.hidden}, seq "
          f"{a.seq}, batch {a.batch}, vocab {a.vocab}, activation rows with optimizer "
          f"{a.optimizer}; D2H {gbs or 0:.1f} GB/s (budget {a.budget_s:g} s)", flush=True)
    print("\n".join(HEADER), flush=True)
    trainers = Trainers(a, arena)
    res: dict[str, Result] = {}
    searched: dict[str, Result] = {}

    def save(r: Result) -> None:
        print(row(r), flush=True)
        checks = checks_of(res, searched, a, gbs)
        results = list(res.values()) + [Result(**{**asdict(x), "variant": x.variant + " (search)"})
                                        for x in searched.values()]
        a.out.write_text(json.dumps({"device": device, "config": config, "checks": checks,
                                     "elapsed_s": time.monotonic() - t_start,
                                     "results": [asdict(x) for x in results]}, indent=2))
        a.out.with_suffix(".md").write_text(
            f"# Training offload on {device} ({a.shape})\n\n{markdown(results, checks)}")

    search_variants = ["no_offload", "kvtier_act_opt_cpu"] if "search" in a.variants else []
    # keep about 40% of the budget for the search
    main_deadline = t_start + a.budget_s * (0.6 if search_variants else 1.0)
    plan: list[tuple[str, int]] = []
    for v in a.variants:
        if v == "sweep":
            plan += [(v, a.sweep_steps) for v in sweep_points(a.layers)]
        elif v != "search":
            plan.append((v, a.steps))
    for v, steps in plan:
        n, k = offload_groups(v, a.layers), inflight_bound(v)
        if v.startswith("kvtier_act@") and any((r.groups, r.inflight) == (n, k) and r.ok
                                               for r in res.values()):
            continue  # this many halves is measured already
        if time.monotonic() > main_deadline:
            res[v] = Result(v, a.layers, False, note="skipped: time budget")
        else:
            res[v] = run_variant(trainers, v, a, a.layers, steps, a.variant_max_s)
        if res[v].ok and (res[v].groups or v == "save_on_cpu"):
            res[v].bound = bound_of(res.get("no_offload"), gbs)
        save(res[v])
    trainers.drop()
    for i, v in enumerate(search_variants):
        # split what is left between the searches still to run
        left = deadline - time.monotonic()
        searched[v] = search(trainers, v, a, time.monotonic() + left / (len(search_variants) - i))
        save(Result(**{**asdict(searched[v]), "variant": v + " (search)"}))
    checks = checks_of(res, searched, a, gbs)
    print("\n".join(["", "| check | value |", "|---|---|"]
                    + [f"| {k} | {c} |" for k, c in checks.items()]), flush=True)
    print(f"wrote {a.out} and {a.out.with_suffix('.md')} in {time.monotonic() - t_start:.0f} s",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
