"""What OffloadedOptimizer supports across param groups and refuses clearly (before changing
anything): mixed per-group options, groups or unfrozen parameters added later, use after close."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.errors import FailedPrecondition
from kvtier.training import OffloadedOptimizer
from tests.training.test_optimizer_lifecycle import backward, equal, make_params


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_amsgrad_in_one_group_only_matches_torch(arena: Any, mode: str) -> None:
    ref, ours = make_params(), make_params()

    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": ps[:1], "amsgrad": True}, {"params": ps[1:], "amsgrad": False}]

    r = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    opt = OffloadedOptimizer(groups(ours), mode=mode, arena=arena, lr=1e-2)
    for s in range(3):
        for ps, o in ((ref, r), (ours, opt)):
            backward(ps, s)
            o.step()
            o.zero_grad()
    assert equal(ref, ours)
    opt.close()


def test_add_param_group_after_construction_is_refused(arena: Any) -> None:
    a, b = make_params()[:2]
    opt = OffloadedOptimizer([a], arena=arena, lr=1e-2)
    with pytest.raises(FailedPrecondition, match="add_param_group"):
        opt.add_param_group({"params": [b], "lr": 0.1})
    assert len(opt.param_groups) == 1
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_parameter_unfrozen_after_construction_is_refused_at_step(arena: Any,
                                                                  mode: str) -> None:
    ps = make_params()
    ps[1].requires_grad_(False)
    opt = OffloadedOptimizer(ps, mode=mode, arena=arena, lr=1e-2, step_in_backward=False)
    ps[1].requires_grad_(True)
    before = [p.detach().clone() for p in ps]
    backward(ps, 0)
    with pytest.raises(FailedPrecondition, match="frozen"):
        opt.step()
    assert equal(before, ps)
    opt.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_close_is_idempotent_and_use_after_close_is_refused(arena: Any, tmp_path: Path,
                                                            tier: str) -> None:
    threads = threading.active_count()
    ps = make_params()
    disk = {"disk_path": str(tmp_path / "s")} if tier == "disk" else {}
    opt = OffloadedOptimizer(ps, arena=arena, lr=1e-2, state_tier=tier, **disk)
    backward(ps, 0)
    opt.step()
    opt.zero_grad()
    opt.close()
    opt.close()
    assert threading.active_count() <= threads  # the worker and any disk I/O threads are gone
    for call in (opt.step, opt.state_dict, opt.zero_grad):
        with pytest.raises(FailedPrecondition, match="closed"):
            call()
