"""Activation offload: same gradients as without it; what is offloaded follows the rule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from kvtier.errors import InvalidArgument
from kvtier.training import get_cpu_offload_context, mark_not_offload, offload_modules
from kvtier.training.base import OffloadRaceError


def _no_cuda_api(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("a CUDA API was called while every tensor is on the CPU")


@pytest.fixture(autouse=True, params=["plain", "cuda_visible"])
def cuda_visible(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test runs twice: as is, and with CUDA "available" while its tensors stay on the CPU
    (what a GPU machine sees running these tests). The second run fails on any CUDA stream or event
    call: CPU tensors must take the synchronous path, chosen by their device."""
    if request.param == "plain" or request.node.get_closest_marker("cuda") is not None:
        return False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_stream", "Stream", "Event", "stream", "synchronize", "current_device"):
        monkeypatch.setattr(torch.cuda, name, _no_cuda_api)
    return True


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def loss_and_grads(tiny: SimpleNamespace, model: nn.Module, run: Any = None) -> list[torch.Tensor]:
    model.zero_grad()
    model(tiny.batch(0), run).backward()
    return grads_of(model)


def test_context_gives_identical_gradients(tiny: SimpleNamespace, arena: Any) -> None:
    model = tiny.make_model()
    ref = loss_and_grads(tiny, model)
    ctx, sync = get_cpu_offload_context(True, 1, 2, arena=arena, min_numel=1024)

    def run(i: int, blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with ctx:
            x = blk(x)
        return sync(x)

    for _ in range(2):  # the group count wraps: a second iteration works the same way
        got = loss_and_grads(tiny, model, run)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert ctx.stats.offloaded_tensors > 0
    assert ctx.stats.reloaded_bytes == ctx.stats.offloaded_bytes
    assert arena.used_bytes == 0  # every buffer went back once the graph was freed


class Saver(nn.Module):
    """Saves exactly: big (offloadable), small (below the size rule), marked, and a Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))

    def forward(self, big: torch.Tensor, small: torch.Tensor, marked: torch.Tensor
                ) -> torch.Tensor:
        mark_not_offload(marked)
        return (big * big).sum() + (small * small).sum() + (marked * marked).sum() + \
            (self.w * self.w).sum()


def test_size_rule_and_mark_not_offload_are_honoured(arena: Any) -> None:
    m = Saver()
    big = torch.randn(300, 1000, requires_grad=True)  # 300k elements >= 256k
    small = torch.randn(100, 100, requires_grad=True)
    marked = torch.randn(300, 1000, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena)
    with ctx:
        y = m(big, small, marked)
    y = sync(y)
    y.backward()
    assert ctx.stats.offloaded_tensors == 1  # only ``big`` (saved twice, copied once)
    assert ctx.stats.deduplicated == 1
    assert ctx.stats.offloaded_bytes == big.numel() * 4
    for t in (big, small, marked):
        assert torch.equal(t.grad, 2 * t.detach())
    assert torch.equal(m.w.grad, 2 * m.w.detach())


def test_tensor_overwritten_in_place_after_save_keeps_saved_value(arena: Any) -> None:
    w = torch.randn(512, 600, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    with ctx:
        a = w * 2
        y = (a * a).sum()  # saves ``a``
        a.mul_(3)  # overwritten right after the save: the copy must already hold the old value
    sync(y).backward()
    assert torch.allclose(w.grad, 8 * w.detach())


def test_kept_tensor_overwritten_in_place_raises_like_autograd(arena: Any) -> None:
    """A tensor the offloader keeps (below ``min_numel``) gets autograd's version check back."""
    w = torch.randn(8, 8, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1 << 20)
    with ctx:
        a = w * 2
        y = (a * a).sum()
        a.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sync(y).backward()
    assert ctx.stats.offloaded_tensors == 0 and ctx.stats.kept_tensors > 0


def test_cpu_tensors_offload_when_cuda_is_visible(cuda_visible: bool, arena: Any) -> None:
    """The decision follows the tensor's device, not ``torch.cuda.is_available()``."""
    w = torch.randn(256, 256, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 2, arena=arena, min_numel=1)
    with ctx:
        h = sync((w * w).tanh())
    with ctx:
        y = sync((h * h).sum())
    y.backward()
    assert ctx.stats.offloaded_tensors > 0
    assert ctx.stats.reloaded_bytes == ctx.stats.offloaded_bytes
    ref = w.detach().clone().requires_grad_(True)
    h2 = (ref * ref).tanh()
    (h2 * h2).sum().backward()
    assert w.grad is not None and ref.grad is not None
    assert torch.equal(w.grad, ref.grad)
    assert arena.used_bytes == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_identical_gradients(tiny: SimpleNamespace, arena: Any) -> None:
    model = tiny.make_model().cuda()
    ids = tiny.batch(0).cuda()

    def grads(run: Any = None) -> list[torch.Tensor]:
        model.zero_grad()
        model(ids, run).backward()
        torch.cuda.synchronize()
        return grads_of(model)

    ref = grads()
    ctx, sync = get_cpu_offload_context(True, 1, 2, arena=arena, min_numel=1024)

    def run(i: int, blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with ctx:
            x = blk(x)
        return sync(x)

    for _ in range(2):
        got = grads(run)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in zip(ref, got, strict=True))
    assert ctx.stats.offloaded_tensors > 0
    assert ctx.stats.reloaded_bytes <= ctx.stats.offloaded_bytes
    ctx.flush()  # host buffers go back once their copies are seen done
    assert arena.used_bytes == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_overwritten_in_place_is_reported(arena: Any) -> None:
    """On CUDA the copy runs on a side stream: an in-place write issued before the copy is seen
    done races with it, so it is an error, seen through the version counter (256 MiB: the copy
    can't be done by the time the host issues the write)."""
    w = torch.randn(8192, 8192, device="cuda", requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    with ctx:
        a = w * 2
        y = (a * a).sum()
        a.mul_(3)
    with pytest.raises(OffloadRaceError):
        sync(y).backward()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_small_tensor_overwritten_in_place_never_gives_wrong_grads(arena: Any) -> None:
    """A small copy may be seen done before the write is issued (then there is no race): either
    the race is reported or the gradient is exactly the one of the values saved."""
    w = torch.randn(512, 600, device="cuda", requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    with ctx:
        a = w * 2
        y = (a * a).sum()
        a.mul_(3)
    try:
        sync(y).backward()
    except OffloadRaceError:
        return
    assert w.grad is not None
    torch.testing.assert_close(w.grad, 8 * w.detach())  # d/dw sum((2w)^2), pre-write values


def test_offload_modules_by_name(tiny: SimpleNamespace, arena: Any) -> None:
    model = tiny.make_model()
    ref = loss_and_grads(tiny, model)
    handle = offload_modules(model, ["blocks.0.fc1", "blocks.0", "blocks.1.qkv"], arena=arena,
                             min_numel=1024)
    got = loss_and_grads(tiny, model)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert handle.stats.offloaded_tensors > 0
    handle.remove()
    before = handle.stats.offloaded_tensors
    loss_and_grads(tiny, model)
    assert handle.stats.offloaded_tensors == before
    with pytest.raises(InvalidArgument):
        offload_modules(model, ["nope"], arena=arena)


def test_manual_synchronization(tiny: SimpleNamespace, arena: Any) -> None:
    model = tiny.make_model()
    ref = loss_and_grads(tiny, model)
    ctx, sync, manual = get_cpu_offload_context(True, 2, 2, manual_synchronization=True,
                                                arena=arena, min_numel=1024)

    def run(i: int, blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with ctx:
            x = blk(x)
        x = sync(x)
        manual.start_offload(i)
        manual.release(i)
        return x

    got = loss_and_grads(tiny, model, run)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert ctx.stats.offloaded_tensors > 0 and ctx.stats.reloaded_bytes > 0


def test_disabled_and_bad_arguments(arena: Any) -> None:
    ctx, sync = get_cpu_offload_context(False)
    x = torch.ones(3)
    with ctx:
        assert sync(x) is x
    with pytest.raises(InvalidArgument, match="num_layers"):
        get_cpu_offload_context(True, 3, 2, arena=arena)
