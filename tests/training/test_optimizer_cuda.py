"""OffloadedOptimizer on a real GPU: steps that start during backward on side streams give
exactly the parameters of the same steps taken after backward, with nothing racing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from kvtier.training import OffloadedOptimizer

pytestmark = pytest.mark.cuda
HP: dict[str, Any] = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class HostStep:
    """Gradients computed on the GPU, fused AdamW on host fp32 copies, weights copied back."""

    def __init__(self, model: nn.Module) -> None:
        self.work = list(model.parameters())
        self.host = [p.detach().float().cpu() for p in self.work]
        self.opt = torch.optim.AdamW(self.host, fused=True, **HP)

    @torch.no_grad()
    def step(self) -> None:
        for h, p in zip(self.host, self.work, strict=True):
            h.grad = p.grad.float().cpu()
            p.grad = None
        self.opt.step()
        for h, p in zip(self.host, self.work, strict=True):
            p.copy_(h)


class DeviceStep:
    """Plain fused AdamW on the GPU (fp32 master copies when the model is not fp32)."""

    def __init__(self, model: nn.Module) -> None:
        self.work = list(model.parameters())
        self.master = [p.detach().float().clone() for p in self.work]
        self.opt = torch.optim.AdamW(self.master, fused=True, **HP)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.master, self.work, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        for m, p in zip(self.master, self.work, strict=True):
            p.copy_(m)


def train(tiny: SimpleNamespace, model: nn.Module, opt: Any, steps: int) -> list[float]:
    losses = []
    for s in range(steps):
        loss = model(tiny.batch(s, bsz=8).cuda())
        loss.backward()
        opt.step()
        if hasattr(opt, "zero_grad"):
            opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_steps_in_backward_match_steps_after_backward(tiny: SimpleNamespace, arena: Any,
                                                      mode: str, dtype: torch.dtype) -> None:
    ref, ours = tiny.make_model(dtype).cuda(), tiny.make_model(dtype).cuda()
    want = train(tiny, ref, HostStep(ref) if mode == "cpu" else DeviceStep(ref), 4)
    opt = OffloadedOptimizer(ours.parameters(), torch.optim.AdamW, mode=mode, arena=arena,
                             bucket_mb=0.05, **HP)
    assert opt.step_in_backward and len(opt.buckets) > 2
    got = train(tiny, ours, opt, 4)
    assert got == want
    assert tiny.params_equal(ref, ours)
    opt.close()
