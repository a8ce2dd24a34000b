"""Gradient offload: host gradients equal device accumulation; clipping matches torch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kvtier.training import GradientOffloader


def test_accumulation_and_clipping_match_device_grads(tiny: SimpleNamespace, arena: Any) -> None:
    ref, ours = tiny.make_model(), tiny.make_model()
    off = GradientOffloader(ours.parameters(), arena=arena, bucket_mb=0.05)
    assert len(off.buckets) > 1
    for m in range(3):
        ref(tiny.batch(0, m)).backward()
        ours(tiny.batch(0, m)).backward()
        assert all(p.grad is None for p in ours.parameters())  # freed on the device
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = off.clip_grad_norm_(0.1)
    assert torch.equal(want, got)
    for p, q in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p.grad, off.host_grad(q))
    off.zero()
    assert all(off.host_grad(p) is None for p in ours.parameters())
    off.close()
    assert arena.used_bytes == 0


def test_fp32_accumulation_of_bf16_grads(tiny: SimpleNamespace, arena: Any) -> None:
    model = tiny.make_model(torch.bfloat16)
    expected = [torch.zeros(p.shape) for p in model.parameters()]

    def adder(e: torch.Tensor) -> Any:
        def hook(p: torch.Tensor) -> None:
            e.add_(p.grad.float())

        return hook

    # registered first, so each sees the gradient before the offloader frees it
    hooks = [p.register_post_accumulate_grad_hook(adder(e))
             for p, e in zip(model.parameters(), expected, strict=True)]
    off = GradientOffloader(model.parameters(), arena=arena, accum_dtype=torch.float32)
    for m in range(2):
        model(tiny.batch(0, m)).backward()
    off.wait()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(off.host_grad(p), e)
    for h in hooks:
        h.remove()
    off.close()


class CountingArena:
    """The real arena, counting the buffers it hands out."""

    def __init__(self, arena: Any) -> None:
        self.arena, self.handed = arena, 0

    def get_buffer(self, nbytes: int) -> torch.Tensor | None:
        self.handed += 1
        return self.arena.get_buffer(nbytes)

    def put_buffer(self, buf: torch.Tensor) -> None:
        self.arena.put_buffer(buf)


def test_first_gradient_lands_in_place_later_ones_are_staged(tiny: SimpleNamespace,
                                                             arena: Any) -> None:
    ref, ours = tiny.make_model(), tiny.make_model()
    counting = CountingArena(arena)
    off = GradientOffloader(ours.parameters(), arena=counting, bucket_mb=0.05)
    built = counting.handed  # one host gradient buffer per bucket
    assert built == len(off.buckets) > 1
    ref(tiny.batch(0)).backward()
    ours(tiny.batch(0)).backward()
    off.wait()
    assert counting.handed == built  # no staging buffer for a first gradient
    for p, q in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p.grad, off.host_grad(q))
    ref(tiny.batch(0, 1)).backward()
    ours(tiny.batch(0, 1)).backward()
    off.wait()
    assert counting.handed == 2 * built  # accumulation stages once per bucket
    for p, q in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p.grad, off.host_grad(q))
    off.close()
    assert arena.used_bytes == 0
