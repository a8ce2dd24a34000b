"""OffloadedOptimizer's construction: arguments out of range are refused naming them, a failed
construction gives back everything it took, a disk directory serves one optimizer at a time, and
param groups carry the wrapped class's defaults as torch.optim's do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.errors import CapacityError, InvalidArgument
from kvtier.tiers.pinned import HostArena
from kvtier.training import GradientOffloader, OffloadedOptimizer, get_cpu_offload_context
from tests.training.test_optimizer_lifecycle import backward, equal, make_params

MIB = 1 << 20


def test_a_class_that_creates_its_state_when_constructed_is_refused(arena: Any) -> None:
    with pytest.raises(InvalidArgument, match="creates its state") as err:
        OffloadedOptimizer(make_params(), torch.optim.Adagrad, arena=arena, lr=0.1)
    assert err.value.field == "optimizer_class"
    assert arena.used_bytes == 0


@pytest.mark.parametrize("budget_mib", [8, 11])  # short in the states, in the gradients
def test_a_failed_construction_gives_its_buffers_back(budget_mib: int) -> None:
    with HostArena(budget_mib * MIB, 4 * MIB, pin=False) as arena:
        for _ in range(2):
            ps = [torch.nn.Parameter(torch.zeros(512, 512)) for _ in range(3)]
            with pytest.raises(CapacityError):
                OffloadedOptimizer(ps, arena=arena, lr=1e-2, bucket_mb=1)
            assert arena.used_bytes == 0
        OffloadedOptimizer(ps[:1], arena=arena, lr=1e-2).close()  # the arena is whole again


def disk_opt(ps: list[torch.nn.Parameter], path: Any, arena: Any) -> OffloadedOptimizer:
    return OffloadedOptimizer(ps, state_tier="disk", disk_path=path, arena=arena, lr=1e-2)


def test_a_disk_directory_serves_one_optimizer_at_a_time(arena: Any, tmp_path: Path) -> None:
    d = tmp_path / "states"
    a, b = make_params(1), make_params(2)
    first = disk_opt(a, str(d), arena)
    with pytest.raises(InvalidArgument, match="in use") as err:
        disk_opt(b, str(d), arena)
    assert err.value.field == "disk_path"
    ref = [p.detach().clone().requires_grad_() for p in a]
    r = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for ps, o in ((ref, r), (a, first)):  # the refused one touched none of its files
        backward(ps, 0)
        o.step()
    assert equal(ref, a)
    first.close()
    disk_opt(b, str(d), arena).close()  # closing released the directory


def test_a_failed_construction_releases_its_disk_directory(tmp_path: Path) -> None:
    d = str(tmp_path / "states")
    with HostArena(2 * MIB, MIB, pin=False) as arena:  # the disk is opened, the host is short
        with pytest.raises(CapacityError):
            disk_opt([torch.nn.Parameter(torch.zeros(1024, 1024))], d, arena)
        assert arena.used_bytes == 0
    with HostArena(64 * MIB, 4 * MIB, pin=False) as arena:
        disk_opt([torch.nn.Parameter(torch.zeros(1024, 1024))], d, arena).close()


@pytest.mark.parametrize("bad", ["file", "", "under_a_file"])
def test_a_disk_path_that_cannot_be_used_is_named(arena: Any, tmp_path: Path, bad: str) -> None:
    f = tmp_path / "a_file"
    f.write_text("x")
    path = {"file": str(f), "": "", "under_a_file": str(f / "states")}[bad]
    with pytest.raises(InvalidArgument) as err:
        disk_opt(make_params(), path, arena)
    assert err.value.field == "disk_path"


@pytest.mark.parametrize("field,kw", [
    ("disk_path", {"disk_path": "/nonexistent/states"}),  # state_tier="cpu": never used
    ("bucket_mb", {"bucket_mb": float("nan")}),
    ("bucket_mb", {"bucket_mb": "64"}),
    ("bucket_mb", {"bucket_mb": 0}),
    ("bucket_mb", {"bucket_mb": -1}),
])
def test_arguments_out_of_range_are_named(arena: Any, field: str, kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as err:
        OffloadedOptimizer(make_params(), arena=arena, lr=1e-2, **kw)
    assert err.value.field == field


@pytest.mark.parametrize("bad", [-5, 2, 1.0])
def test_drain_before_group_must_be_a_layer(arena: Any, bad: Any) -> None:
    with pytest.raises(InvalidArgument) as err:
        get_cpu_offload_context(True, 1, 2, drain_before_group=bad, arena=arena)
    assert err.value.field == "drain_before_group"


def test_gradients_accumulate_in_a_floating_point_dtype_only(arena: Any) -> None:
    with pytest.raises(InvalidArgument) as err:
        GradientOffloader(make_params(), arena=arena, accum_dtype=torch.int32)
    assert err.value.field == "accum_dtype"
    assert arena.used_bytes == 0


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_groups_carry_the_class_defaults_for_schedulers(arena: Any, mode: str) -> None:
    ref, ours = make_params(), make_params()
    r = torch.optim.AdamW(ref, fused=True)  # no lr given: the class's default
    opt = OffloadedOptimizer(ours, mode=mode, arena=arena)
    assert opt.param_groups[0]["lr"] == r.param_groups[0]["lr"]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (r, opt)]
    for s in range(3):
        for ps, o, sched in ((ref, r, scheds[0]), (ours, opt, scheds[1])):
            backward(ps, s)
            o.step()
            o.zero_grad()
            sched.step()
    assert equal(ref, ours)
    assert opt.param_groups[0]["lr"] == r.param_groups[0]["lr"]
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_zero_grad_keeping_gradients_zeroes_them_as_torch(arena: Any, mode: str) -> None:
    ref, ours = make_params(), make_params()
    r = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    opt = OffloadedOptimizer(ours, mode=mode, arena=arena, lr=1e-2, step_in_backward=False)
    for ps, o in ((ref, r), (ours, opt)):
        backward(ps, 0)
        o.zero_grad(set_to_none=False)  # a skipped step
    assert all(p.grad is not None and not p.grad.any() for p in ref)
    if mode == "gpu_stream":  # the gradients stay on the device: zeroed as torch's
        assert equal([p.grad for p in ref], [p.grad for p in ours])  # type: ignore[misc]
    for ps, o in ((ref, r), (ours, opt)):
        backward(ps, 1)
        o.step()
    assert equal(ref, ours)
    opt.close()
