"""vLLM connector overlap: engine steps through the connector's worker side vs without it.

vLLM's CUDA build cannot be installed beside this torch, so this drives the connector's worker
side (``kvtier.integrations.vllm.steps.WorkerSteps``, what ``KVTierConnector`` calls) the way
vLLM's model runner does, against a real daemon (a ``kvtier serve`` subprocess):

    start_load_kv -> per layer: the layer's pre-attention work, wait_for_layer_load(layer),
    attention (save_kv_layer is a no-op) -> wait_for_save -> the engine samples (a device
    synchronize) -> get_finished(the previous step's requests)

Per-layer KV tensors are in vLLM's flash-attn layout ``[2, blocks, block_size, kv_heads,
head_dim]`` (registered with the daemon on CUDA, copied through a staging pool on the CPU, as
the connector's ``mode=auto`` does). Each layer's "forward" is a matmul loop calibrated to
``--layer-ms`` of device time, half before the layer's load wait and half after.

How the connector loads: registered (CUDA), the daemon writes into vLLM's tensors one layer
group at a time (``LoadLayers``: one reply per group once its copies landed, the step's
transfers side by side), so ``wait_for_layer_load(i)`` waits for layer ``i``'s group only;
staging (CPU), the daemon fills staging pages and the loader thread copies them into the layers
in forward order.

Workloads (``--blocks`` blocks per step, ``--steps`` steps per run):
    store  each step fills new blocks (fresh keys) that are stored (prefill of new prompts);
    load   each step loads stored blocks into other blocks (a prefix hit); bytes verified
           after every step, outside the timing.
Variants, run in rotating order ``--repeats`` times:
    none   the same steps without the connector (the floor);
    async  this connector: stores on the store thread once an event of the step is done;
           loads on the loader thread, waited for layer by layer; registered loads in
           ``--load-groups`` layer groups (default 4);
    whole  registered mode only (CUDA): as async, but each load is one group of every layer
           (the connector's default ``load_groups=1``), so the first layer's wait waits for
           the whole load;
    sync   the previous behaviour: stores in wait_for_save after a device synchronize; loads
           whole in start_load_kv (``stores=sync``, ``loads=block``).
Reported: median over runs of the mean step time (ms), the overhead over ``none``, and for
async stores the time to drain the store queue after a run's last step. The load workload's
overlap is async against whole (the same loads, layer-wise or not). Layer groups overlap the
forward only where the engine and the daemon are clients of one MPS server (start
``nvidia-cuda-mps-control -d`` before this script: the daemon it starts inherits the
environment); the report says whether MPS was running.

    python benchmarks/connector_overlap.py --out benchmarks/results/   # CUDA: real figures
    python benchmarks/connector_overlap.py --device cpu --layers 4 --kv-heads 2 --head-dim 64 \\
        --blocks 8 --cache-blocks 64 --steps 4 --repeats 2 --layer-ms 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from kvtier.client import connect
from kvtier.client.block_mover import BlockTransfer
from kvtier.client.block_rows import BlockRows, block_segments

from kvtier.integrations.vllm.groups import mps_running
from kvtier.integrations.vllm.identity import Rank
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.steps import WorkerSteps

log = logging.getLogger("bench.connector")
VARIANTS = ("none", "async", "whole", "sync")


def start_daemon(tmp: Path, device: str, cpu_gb: float) -> tuple[subprocess.Popen, str]:
    sock = tmp / "k.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_OFFLOAD_")}
    env["KVCACHED_OFFLOAD_PINNED_CHUNK_MB"] = "256"
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"unix://{sock}",
            "--metrics-addr", "", "--device", device, "--cpu-memory-gb", str(cpu_gb),
            "--gpu-memory-gb", "1", "--log-level", "warning"]
    proc = subprocess.Popen(argv, env=env)
    deadline = time.monotonic() + 120
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not start")
        time.sleep(0.1)
    return proc, f"unix://{sock}"


class Model:
    """Per-layer KV in vLLM's flash-attn layout and a fake forward of known device time."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.dev = torch.device(a.device)
        dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        shape = (2, a.cache_blocks, a.block_size, a.kv_heads, a.head_dim)
        self.kv = [torch.randn(shape, device=self.dev).to(dtype) for _ in range(a.layers)]
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
        segs = [block_segments(t, a.cache_blocks) for t in self.kv]
        self.layers, first = {}, 0
        for name, s in zip(self.names, segs, strict=True):
            self.layers[name], first = range(first, first + len(s)), first + len(s)
        self.rows = BlockRows([x for s in segs for x in s])
        m = 1024 if self.dev.type == "cuda" else 128
        self._a = torch.randn(m, m, device=self.dev)
        self._out = torch.empty_like(self._a)
        self.reps = self._calibrate(a.layer_ms / 2)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def half_layer(self, reps: int | None = None) -> None:
        for _ in range(self.reps if reps is None else reps):
            torch.matmul(self._a, self._a, out=self._out)

    def _calibrate(self, target_ms: float) -> int:
        """Matmuls per half layer: the least time of five trials (others' load only adds)."""
        self.half_layer(20)
        trials = []
        for _ in range(5):
            self.sync()
            t = time.perf_counter()
            self.half_layer(100)
            self.sync()
            trials.append((time.perf_counter() - t) / 100 * 1e3)
        return max(1, round(target_ms / min(trials)))


def variants(m: Model) -> tuple[str, ...]:
    """``whole`` only where loads are registered (CUDA): it is a registered-mode variant."""
    return VARIANTS if m.dev.type == "cuda" else tuple(v for v in VARIANTS if v != "whole")


def make_steps(m: Model, address: str, variant: str, a: argparse.Namespace) -> WorkerSteps:
    link = DaemonLink(lambda: connect(address, tenant="bench", timeout=30.0), "bench", log)
    threaded = variant in ("async", "whole")
    groups = a.load_groups if variant == "async" else 1
    return WorkerSteps(link, m.rows, log, rank=Rank(), register=m.dev.type == "cuda",
                       staging_slots=a.staging_slots, layers=m.layers,
                       async_stores=threaded, layer_loads=threaded, load_groups=groups)


def one_step(m: Model, w: WorkerSteps | None, loads: list[BlockTransfer],
             stores: list[BlockTransfer], finished: set[str]) -> float:
    t = time.perf_counter()
    if w is not None:
        w.start(loads)
    for name in m.names:
        m.half_layer()  # qkv projection etc.
        if w is not None:
            w.wait_layer(name)
        m.half_layer()  # attention and the rest of the layer
    if w is not None:
        w.end(stores)
        w.join_loads()
    m.sync()  # the engine samples the step's tokens
    if w is not None:
        w.finished(finished)
    return (time.perf_counter() - t) * 1e3


def run(m: Model, w: WorkerSteps | None, workload: str, a: argparse.Namespace, rnd: int,
        src_keys: list[bytes], src_ids: list[int]) -> dict[str, float]:
    times, prev = [], set()
    dst = list(range(a.blocks, 2 * a.blocks))
    dst_idx = torch.tensor(dst, device=m.dev)
    for s in range(a.steps):
        req = f"{workload}-{rnd}-{s}"
        loads, stores = [], []
        if workload == "store":
            keys = [os.urandom(16) for _ in range(a.blocks)]
            stores = [BlockTransfer(req, keys, src_ids)]
        else:
            for t in m.kv:
                t.index_fill_(1, dst_idx, 0)
            m.sync()
            loads = [BlockTransfer(req, src_keys, dst)]
        times.append(one_step(m, w, loads, stores, prev))
        prev = {req}
        if workload == "load" and w is not None:
            assert w.take_invalid() == set(), "a load failed"
            for t in m.kv:
                assert torch.equal(t[:, dst], t[:, src_ids]), "loaded bytes differ"
    out = {"step_ms": statistics.mean(times)}
    if w is not None:
        t = time.perf_counter()
        w.flush_stores()
        out["drain_ms"] = (time.perf_counter() - t) * 1e3
    return out


def bench(a: argparse.Namespace, address: str) -> dict[str, Any]:
    m = Model(a)
    src_ids = list(range(a.blocks))
    src_keys = [os.urandom(16) for _ in range(a.blocks)]
    names = variants(m)
    workers = {v: make_steps(m, address, v, a) for v in names[1:]}
    results: dict[str, Any] = {}
    for workload in a.workloads:
        if workload == "load":  # its prefix, stored now: the store runs evict older blocks
            seed(workers["sync"], src_keys, src_ids)
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in names}
        for r in range(a.repeats + 1):  # round 0 warms up (attach, first copies)
            k = r % len(names)
            order = names[k:] + names[:k]
            for v in order:
                res = run(m, workers.get(v), workload, a, r, src_keys, src_ids)
                if r:
                    runs[v].append(res)
        results[workload] = {v: _summary(rs) for v, rs in runs.items()}
    for w in workers.values():
        w.close()  # waits for the last stores: the counters are final
    results["counters"] = {v: w.counters.as_dict() for v, w in workers.items()}
    return results


def seed(w: WorkerSteps, keys: list[bytes], ids: list[int]) -> None:
    """Store the load workload's blocks (each key new to the daemon) and wait for them."""
    before = w.counters.stored_blocks
    w.end([BlockTransfer("seed", keys, ids)])
    w.flush_stores()
    if w.counters.stored_blocks - before < len(keys):
        raise RuntimeError(f"only {w.counters.stored_blocks - before} of {len(keys)} seed blocks "
                           "stored")


def _summary(rs: list[dict[str, float]]) -> dict[str, float]:
    out = {"step_ms": statistics.median(r["step_ms"] for r in rs)}
    if "drain_ms" in rs[0]:
        out["drain_ms"] = statistics.median(r["drain_ms"] for r in rs)
    return out


def report(a: argparse.Namespace, res: dict[str, Any], device: str) -> str:
    page = 2 * a.layers * a.block_size * a.kv_heads * a.head_dim * (2 if a.device == "cuda" else 4)
    shown = [v for v in VARIANTS[1:] if v in res[a.workloads[0]]]
    mode = (f"registered: async loads in {a.load_groups} layer groups through LoadLayers "
            "(whole: one group)"
            if a.device == "cuda" else "staging pool: loads copied into the layers in order")
    lines = [f"Device: {device}; {a.layers} layers, flash-attn layout {a.kv_heads}x{a.head_dim}, "
             f"block {a.block_size} ({page >> 10} KiB per block), {a.blocks} blocks per step, "
             f"{a.steps} steps per run, median of {a.repeats} runs; forward "
             f"{a.layer_ms} ms per layer; {mode}; MPS "
             f"{'running' if mps_running() else 'not running'} (`groups.mps_running`).", "",
             "| workload | none ms/step | "
             + " | ".join(f"{v} ms/step (overhead)" for v in shown) + " | async drain ms |",
             "|---|---|" + "---|" * len(shown) + "---|"]
    for wl in a.workloads:
        r = res[wl]
        base = r["none"]["step_ms"]
        cells = [f"{r[v]['step_ms']:.2f} (+{r[v]['step_ms'] - base:.2f})" for v in shown]
        lines.append(f"| {wl} | {base:.2f} | " + " | ".join(cells)
                     + f" | {r['async'].get('drain_ms', 0.0):.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=128, help="blocks stored or loaded per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layer-ms", type=float, default=0.5, help="fake forward per layer")
    p.add_argument("--staging-slots", type=int, default=64)
    p.add_argument("--cpu-gb", type=float, default=8.0,
                   help="the daemon's CPU tier: small, so the store runs reach a steady state "
                        "(the tier full, older blocks evicted) after the warm-up round")
    p.add_argument("--load-groups", type=int, default=4,
                   help="registered loads of the async variant: layer groups (whole: 1)")
    p.add_argument("--workloads", nargs="+", default=["store", "load"],
                   choices=["store", "load"])
    p.add_argument("--out", type=Path, help="folder for connector_overlap.{json,md}")
    a = p.parse_args()
    if a.blocks < 1 or 2 * a.blocks > a.cache_blocks or a.steps < 1 or a.repeats < 1:
        p.error("need --blocks >= 1, 2 * --blocks <= --cache-blocks, --steps/--repeats >= 1")
    logging.basicConfig(level=logging.WARNING)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (daemon --device cpu)"
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_daemon(Path(tmp), a.device, a.cpu_gb)
        try:
            res = bench(a, address)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    text = report(a, res, device)
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "connector_overlap.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(a).items()}, "device": device,
             "mps": mps_running(),
             "date": time.strftime("%Y-%m-%d"), "results": res}, indent=1))
        (a.out / "connector_overlap.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
