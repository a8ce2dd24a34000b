"""OffloadedOptimizer on parameters that are not plain contiguous tensors (a transposed weight,
a slice of a wider tensor): the same parameters as ``torch.optim.AdamW``'s for-loop step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.training import OffloadedOptimizer

HP: dict[str, Any] = dict(lr=1e-2, weight_decay=0.1)


def strided(kind: str, dtype: torch.dtype) -> torch.nn.Parameter:
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    # (8, 6) with strides (1, 8) / (6, 5) with strides (8, 1): not dense
    return torch.nn.Parameter(base.t() if kind == "transposed" else base[:, :5])


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
@pytest.mark.parametrize("kind", ["transposed", "slice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_parameter_steps_exactly(arena: Any, mode: str, kind: str,
                                         dtype: torch.dtype) -> None:
    ours, ref = strided(kind, dtype), strided(kind, dtype)
    assert not ours.is_contiguous()
    master = ref.detach().float().clone().requires_grad_() if dtype != torch.float32 else ref
    # the for-loop implementation handles any strides; the fused one matches it on dense inputs
    r = torch.optim.AdamW([master], foreach=False, **HP)
    opt = OffloadedOptimizer([ours], mode=mode, arena=arena, **HP)
    for s in range(3):
        g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(10 + s)).to(dtype)
        (ref * g).sum().backward()
        if master is not ref:
            master.grad, ref.grad = ref.grad.float(), None  # type: ignore[union-attr]
        r.step()
        r.zero_grad()
        with torch.no_grad():
            ref.copy_(master)
        (ours * g).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(ref, ours), (ref.float() - ours.float()).abs().max()
    opt.close()
