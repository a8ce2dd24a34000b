"""Activation offload never waits for a copy on the hot path: a scripted copy stream decides when
copies are done, and the offloader must drop device copies, recycle host buffers and pace the host
exactly as the events say."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.errors import InvalidArgument
from kvtier.training import get_cpu_offload_context
from kvtier.training.activations import ActivationOffloader, OffloadContext
from kvtier.training.base import OffloadRaceError


class FakeDone:
    """A completion the test finishes by hand; ``synchronize`` is a host wait (logged)."""

    def __init__(self, log: list[Any], done: bool = False) -> None:
        self.log, self.done = log, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append("host_wait")
        self.done = True


class FakeStreams:
    """Copies run at once (CPU tensors); their completion is reported when the test says so."""

    def __init__(self, marks_done: bool = True) -> None:
        self.log: list[Any] = []
        self.copies: list[FakeDone] = []
        self.marks_done = marks_done

    def copy_many(self, which: str, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                  after: Any = None, *, record: bool = True) -> FakeDone:
        assert not record  # the offloader keeps its tensors alive itself
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)
        done = FakeDone(self.log)
        self.log.append((which, after))
        self.copies.append(done)
        return done

    def mark(self, device: torch.device) -> FakeDone:
        return FakeDone(self.log, self.marks_done)

    def wait_on_compute(self, done: Any) -> None:
        if done is not None:
            self.log.append("compute_wait")

    def synchronize(self, *dones: Any) -> None:
        for d in dones:
            if d is not None:
                d.synchronize()

    def finish(self) -> None:
        for d in self.copies:
            d.done = True


def copies(fake: FakeStreams) -> list[tuple[str, Any]]:
    return [e for e in fake.log if isinstance(e, tuple)]


def two_layers(streams: FakeStreams, arena: Any) -> tuple[OffloadContext, Any]:
    off = ActivationOffloader(arena=arena, should_offload=lambda g: g == 0, group_count=2,
                              min_numel=1, streams=streams, max_inflight_groups=None)
    ctx = OffloadContext(off)
    w = torch.randn(256, 256, requires_grad=True)

    def step() -> torch.Tensor:
        with ctx:
            h = ctx.sync((w * w).tanh())
        with ctx:
            y: torch.Tensor = ctx.sync((h * h).sum())
        return y

    return ctx, (w, step)


def reference_grad(w: torch.Tensor) -> torch.Tensor:
    ref = w.detach().clone().requires_grad_(True)
    h = (ref * ref).tanh()
    (h * h).sum().backward()
    assert ref.grad is not None
    return ref.grad


def test_device_copies_go_when_seen_done_without_any_wait(arena: Any) -> None:
    fake = FakeStreams()
    ctx, (w, step) = two_layers(fake, arena)
    y = step()
    off = ctx.offloader
    assert off._inflight and all(r.views is not None for r in off._inflight)
    assert "host_wait" not in fake.log and "compute_wait" not in fake.log
    fake.finish()
    off.commit_forward()  # any boundary (or save) reaps what is done
    off.group = 0
    assert not off._inflight and ctx.stats.released_bytes == ctx.stats.offloaded_bytes
    y.backward()
    assert torch.equal(w.grad, reference_grad(w))
    assert ctx.stats.reloaded_bytes == ctx.stats.offloaded_bytes
    # reloads are ordered after their offload copies on the device, not by a host wait
    assert all(after is not None for which, after in copies(fake) if which == "h2d")
    assert "host_wait" not in fake.log


def test_backward_uses_held_device_copy_without_reload(arena: Any) -> None:
    fake = FakeStreams()
    ctx, (w, step) = two_layers(fake, arena)
    step().backward()  # copies never reported done: backward reads the device tensors
    assert torch.equal(w.grad, reference_grad(w))
    assert ctx.stats.reloaded_bytes == 0 and ctx.stats.offloaded_bytes > 0
    assert "host_wait" not in fake.log


def test_host_buffers_recycled_after_their_copies(arena: Any) -> None:
    fake = FakeStreams()
    ctx, (_, step) = two_layers(fake, arena)
    step().backward()
    used = arena.used_bytes
    assert used > 0  # freed by autograd but the copies may still be reading them
    fake.log.clear()
    step().backward()  # same sizes: the cooling buffers are reused, ordered after their copies
    assert arena.used_bytes == used
    assert any(which == "d2h" and after for which, after in copies(fake))
    fake.finish()
    ctx.flush()
    assert arena.used_bytes == 0


@pytest.mark.parametrize("lag", [1, 3])
def test_host_paced_a_few_marks_behind_the_device(arena: Any, lag: int) -> None:
    fake = FakeStreams(marks_done=False)
    off = ActivationOffloader(arena=arena, should_offload=lambda g: True, group_count=4,
                              min_numel=1, streams=fake, pace_lag=lag, max_inflight_groups=None)
    ctx = OffloadContext(off)
    x = torch.randn(128, 128, requires_grad=True)
    for _ in range(4):
        with ctx:
            x = ctx.sync(x * x)
    # a mark at each new saved tensor and each boundary (8); the host waits for the device to
    # pass the mark ``lag`` back, never for a copy
    assert ctx.stats.host_waits == 8 - lag
    assert all(d.done is False for d in fake.copies)
    x.sum().backward()


def test_in_place_write_before_copy_seen_done_raises(arena: Any) -> None:
    fake = FakeStreams()
    off = ActivationOffloader(arena=arena, should_offload=lambda g: True, group_count=1,
                              min_numel=1, streams=fake)
    ctx = OffloadContext(off)
    w = torch.randn(64, 64, requires_grad=True)
    with ctx:
        a = w * 2
        y = (a * a).sum()
        a.mul_(3)
    with pytest.raises(OffloadRaceError):
        ctx.sync(y).backward()


def test_views_of_one_storage_share_one_copy(arena: Any) -> None:
    """q, k, v: three strided views of one qkv output are offloaded as one storage copy."""
    x = torch.randn(256, 3, 512, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    with ctx:
        base = x * 2
        q, k, v = base.unbind(1)  # each non-contiguous, a third of the storage
        y = (q * k * v).sum()
    sync(y).backward()
    ref = x.detach().clone().requires_grad_(True)
    rq, rk, rv = (ref * 2).unbind(1)
    (rq * rk * rv).sum().backward()
    assert torch.equal(x.grad, ref.grad)
    st = ctx.stats
    assert st.kept_tensors == 0
    assert st.offloaded_bytes == base.numel() * 4 + q.numel() * 4  # the storage, q * k
    assert st.deduplicated == 2 and arena.used_bytes == 0


def test_small_view_of_large_storage_is_kept(arena: Any) -> None:
    big = torch.randn(512, 512, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    with ctx:
        col = (big * 1).t()[:8]  # 8 rows of the transpose: non-contiguous, 1/64 of the storage
        y = (col * col).sum()
    sync(y).backward()
    assert ctx.stats.kept_tensors >= 1
    assert torch.equal(big.grad[:, :8], 2 * big.detach()[:, :8])


def test_max_inflight_groups_waits_for_older_copies(arena: Any) -> None:
    """k = 1 (the default): at each boundary the copies of the earlier layers are waited for."""
    fake = FakeStreams()
    off = ActivationOffloader(arena=arena, should_offload=lambda g: True, group_count=3,
                              min_numel=1, streams=fake)
    ctx = OffloadContext(off)
    x = torch.randn(128, 128, requires_grad=True)
    held = []
    for _ in range(3):
        with ctx:
            x = ctx.sync(x * x)
        held.append(sum(r.views is not None for r in off._inflight))
    # after boundary k only group k's copy may still hold its device memory
    assert all(n <= 1 for n in held) and ctx.stats.copy_waits == 2
    assert ctx.stats.host_waits == 0 and "compute_wait" not in fake.log
    x.sum().backward()


def test_saved_again_after_its_graph_was_dropped(arena: Any) -> None:
    """A tensor whose first saving graph is gone is copied afresh when saved again."""
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    w = torch.randn(64, 64, requires_grad=True)
    with ctx:
        a = w * 2
        (a * a).sum()  # saves ``a``; the graph is dropped at once
        y = (a * a).sum()
    sync(y).backward()
    assert torch.equal(w.grad, 8 * w.detach())
    assert ctx.stats.deduplicated == 2  # once within each graph, never across them


def test_views_of_parameters_stay(arena: Any) -> None:
    """A linear layer saves ``weight.t()``: a non-contiguous view of a parameter, never moved."""
    lin = torch.nn.Linear(512, 256)
    x = torch.randn(4, 64, 512, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 1, arena=arena, min_numel=1)
    with ctx:
        y = sync(lin(x).sum())
    y.backward()
    assert ctx.stats.offloaded_bytes == x.numel() * 4  # the input only
    assert ctx.stats.kept_bytes >= lin.weight.numel() * 4


def test_drain_before_group_orders_compute_after_copies_without_host_wait(arena: Any) -> None:
    fake = FakeStreams()
    off = ActivationOffloader(arena=arena, should_offload=lambda g: g < 2, group_count=3,
                              min_numel=1, streams=fake, max_inflight_groups=None,
                              drain_before_group=2, reload_ahead=2)
    ctx = OffloadContext(off)
    w = torch.randn(256, 256, requires_grad=True)
    with ctx:
        h = ctx.sync((w * w).tanh())
    assert off._inflight and "compute_wait" not in fake.log  # copies still running: held
    with ctx:
        h = ctx.sync((h * h).tanh())
    # entering group 2: the compute stream waits, the device copies go, the host never waited
    assert not off._inflight and fake.log.count("compute_wait") == 1
    assert ctx.stats.device_waits == 1
    assert ctx.stats.released_bytes == ctx.stats.offloaded_bytes > 0
    with ctx:
        y = ctx.sync((h * h).sum())
    y.backward()
    ref = w.detach().clone().requires_grad_(True)
    h2 = (ref * ref).tanh()
    ((h2 * h2).tanh() ** 2).sum().backward()
    assert torch.equal(w.grad, ref.grad)
    assert ctx.stats.reloaded_bytes == ctx.stats.offloaded_bytes  # everything came back
    assert "host_wait" not in fake.log


def test_reload_ahead_must_be_positive(arena: Any) -> None:
    with pytest.raises(InvalidArgument, match="reload_ahead"):
        ActivationOffloader(arena=arena, should_offload=lambda g: True, group_count=2,
                            reload_ahead=0)
