"""The training benchmark's variants: presets, which layer halves each activation variant
offloads and how many of their copies the host may leave in flight, the sweep's points, and the
runner/optimizer each variant trains with (see ``training.py`` for what the variants are)."""

from __future__ import annotations

import argparse
import re
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from training_model import Block, GpuMixedAdamW, Runner

from kvtier.training import OffloadedOptimizer, get_cpu_offload_context

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2048": dict(layers=24, hidden=2048, heads=16, seq=4096, batch=1, vocab=32768,
                    optimizer="gpu", host_gb=None, variants="no_offload,save_on_cpu,kvtier_act,"
                    "kvtier_act_third,sweep,kvtier_opt_cpu,kvtier_opt_gpu_stream,search"),
    "wide8192": dict(layers=4, hidden=8192, heads=64, seq=4096, batch=10, vocab=8192,
                     optimizer="gpu_stream", host_gb=96.0,
                     variants="no_offload,kvtier_act,sweep"),
}
# one sweep point, e.g. kvtier_act@5~2; kvtier_act@5+: copies never waited for by the host, the
# compute stream waits for them entering the last layer half (before the peak), reloads 2 ahead
ONE_POINT = re.compile(r"kvtier_act@\d+(~\d+|\+)?")
ALL_VARIANTS = ("no_offload", "save_on_cpu", "kvtier_act", "kvtier_act_third", "sweep",
                "kvtier_opt_cpu", "kvtier_opt_gpu_stream", "search")


def offload_groups(variant: str, layers: int) -> int:
    """Layer halves offloaded by an activation variant (``kvtier_act@n``: the first ``n``)."""
    if variant.startswith("kvtier_act@"):
        return int(variant.split("@")[1].split("~")[0].rstrip("+"))
    if variant.startswith("kvtier_act_third"):
        return 2 * max(1, layers // 3)
    return 2 * layers - 2 if variant.startswith("kvtier_act") else 0


def inflight_bound(variant: str) -> int | None:
    """``max_inflight_groups`` of a variant: 1 for ``kvtier_act`` (memory first, as
    TransformerEngine), ``k`` for ``kvtier_act@n~k``, else None (never wait for copies)."""
    if variant == "kvtier_act" or variant.startswith("kvtier_act_opt"):
        return 1
    if variant.startswith("kvtier_act@") and "~" in variant:
        return int(variant.split("~")[1])
    return None


def sweep_points(layers: int) -> list[str]:
    """Activation variants of the sweep: the first n layer halves for n from a few to all but
    the last layer, copies never waited for; and the top three n with the host waiting for
    all but the latest one or two layer halves' copies (less memory for some forward time)."""
    top = 2 * layers - 2
    ns = sorted({max(1, round(top * f)) for f in (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65,
                                                  0.8, 1.0)})
    return ([f"kvtier_act@{n}" for n in ns] + [f"kvtier_act@{n}~1" for n in ns[-3:]]
            + [f"kvtier_act@{n}~2" for n in ns[-3:]])


def runner_for(variant: str, layers: int, arena: Any, a: argparse.Namespace
            ) -> tuple[Runner | None, Any, Any]:
    """(runner, context around the forward, offload context or None)."""
    if variant == "save_on_cpu":
        return None, torch.autograd.graph.save_on_cpu(pin_memory=True), None
    n = offload_groups(variant, layers)
    if not n:
        return None, nullcontext(), None
    drained = variant.endswith("+")
    ctx, sync = get_cpu_offload_context(True, n, 2 * layers, arena=arena, min_numel=a.min_numel,
                                        pace_lag=a.pace_lag,
                                        max_inflight_groups=inflight_bound(variant),
                                        drain_before_group=2 * layers - 1 if drained else None,
                                        reload_ahead=2 if drained else 1)

    def run(i: int, blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(blk, Block)
        for part in (blk.attn, blk.mlp):
            with ctx:
                x = part(x)
            x = sync(x)
        return x

    return run, nullcontext(), ctx


def optimizer_for(kind: str, model: nn.Module, arena: Any) -> Any:
    if kind == "cpu":
        return OffloadedOptimizer(model.parameters(), mode="cpu", arena=arena, lr=1e-4)
    if kind == "gpu_stream":
        # stepped after backward, so that the rows' forward+backward times are the activation
        # offload's own (in backward the states' copies would share the link with reloads)
        return OffloadedOptimizer(model.parameters(), mode="gpu_stream", arena=arena, lr=1e-4,
                                  bucket_mb=256, step_in_backward=False)
    return GpuMixedAdamW(model)
