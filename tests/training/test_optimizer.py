"""OffloadedOptimizer gives the same parameters as the same steps without offload."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from kvtier.errors import FailedPrecondition, InvalidArgument
from kvtier.training import OffloadedOptimizer

HP: dict[str, Any] = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class RefPlain:
    """Plain fused AdamW on the model's own parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(self.params, fused=True, **HP)

    def after_backward(self) -> None:
        pass

    def clip_grad_norm_(self, n: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, n)

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


class RefMixed(RefPlain):
    """bf16 working weights, fp32 master weights, fp32 gradient accumulation."""

    def __init__(self, model: nn.Module) -> None:
        self.work = list(model.parameters())
        self.params = [p.detach().float().clone() for p in self.work]
        self.opt = torch.optim.AdamW(self.params, fused=True, **HP)

    def after_backward(self) -> None:
        for m, p in zip(self.params, self.work, strict=True):
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.opt.step()
        for m, p in zip(self.params, self.work, strict=True):
            p.copy_(m)


def train(tiny: SimpleNamespace, model: nn.Module, opt: Any, steps: range, accum: int = 1,
          clip: float | None = None, no_sync: bool = False) -> None:
    for s in steps:
        for m in range(accum):
            last = m == accum - 1
            ctx = opt.no_sync() if no_sync and not last else _null()
            with ctx:
                (model(tiny.batch(s, m)) / accum).backward()
            getattr(opt, "after_backward", lambda: None)()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def offloaded(model: nn.Module, arena: Any, tmp_path: Path, mode: str, tier: str,
              **kw: Any) -> OffloadedOptimizer:
    disk = {"disk_path": str(tmp_path / "states")} if tier == "disk" else {}
    return OffloadedOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, state_tier=tier,
                              arena=arena, bucket_mb=0.05, **disk, **kw, **HP)


MODES = [("cpu", "cpu"), ("cpu", "disk"), ("gpu_stream", "cpu"), ("gpu_stream", "disk")]


@pytest.mark.parametrize(("mode", "tier"), MODES)
def test_fp32_accumulation_and_clipping_bit_exact(tiny: SimpleNamespace, arena: Any,
                                                  tmp_path: Path, mode: str, tier: str) -> None:
    ref, ours = tiny.make_model(), tiny.make_model()
    train(tiny, ref, RefPlain(ref), range(3), accum=2, clip=0.5)
    opt = offloaded(ours, arena, tmp_path, mode, tier, step_in_backward=False)
    assert len(opt.buckets) > 1
    train(tiny, ours, opt, range(3), accum=2, clip=0.5)
    assert tiny.params_equal(ref, ours)
    opt.close()


def test_mixed_precision_cpu_master_bit_exact(tiny: SimpleNamespace, arena: Any,
                                              tmp_path: Path) -> None:
    ref, ours = tiny.make_model(torch.bfloat16), tiny.make_model(torch.bfloat16)
    train(tiny, ref, RefMixed(ref), range(3), accum=2, clip=0.5)
    opt = offloaded(ours, arena, tmp_path, "cpu", "cpu", step_in_backward=False)
    train(tiny, ours, opt, range(3), accum=2, clip=0.5)
    assert tiny.params_equal(ref, ours)
    opt.close()


def test_mixed_precision_gpu_stream_master_bit_exact(tiny: SimpleNamespace, arena: Any,
                                                     tmp_path: Path) -> None:
    ref, ours = tiny.make_model(torch.bfloat16), tiny.make_model(torch.bfloat16)
    train(tiny, ref, RefMixed(ref), range(3))
    opt = offloaded(ours, arena, tmp_path, "gpu_stream", "cpu")
    train(tiny, ours, opt, range(3))
    assert tiny.params_equal(ref, ours)
    opt.close()


@pytest.mark.parametrize(("mode", "tier", "dtype"),
                         [("cpu", "cpu", torch.bfloat16), ("cpu", "disk", torch.float32),
                          ("gpu_stream", "cpu", torch.bfloat16),
                          ("gpu_stream", "disk", torch.float32)])
def test_checkpoint_resume_continues_exactly(tiny: SimpleNamespace, arena: Any, tmp_path: Path,
                                             mode: str, tier: str, dtype: torch.dtype) -> None:
    whole = tiny.make_model(dtype)
    opt = offloaded(whole, arena, tmp_path / "a", mode, tier,
                    step_in_backward=False)
    train(tiny, whole, opt, range(4), accum=2, clip=0.5 if mode == "cpu" else None)
    opt.close()

    first = tiny.make_model(dtype)
    opt1 = offloaded(first, arena, tmp_path / "b", mode, tier, step_in_backward=False)
    train(tiny, first, opt1, range(2), accum=2, clip=0.5 if mode == "cpu" else None)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    opt1.close()

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = tiny.make_model(dtype, seed=123)  # different weights: everything must come back
    opt2 = offloaded(resumed, arena, tmp_path / "c", mode, tier, step_in_backward=False)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    train(tiny, resumed, opt2, range(2, 4), accum=2, clip=0.5 if mode == "cpu" else None)
    assert tiny.params_equal(whole, resumed)
    opt2.close()


def test_load_resyncs_working_weights_from_master(tiny: SimpleNamespace, arena: Any,
                                                  tmp_path: Path) -> None:
    model = tiny.make_model(torch.bfloat16)
    opt = offloaded(model, arena, tmp_path, "cpu", "cpu")
    train(tiny, model, opt, range(1))
    sd = opt.state_dict()
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(expected, model.parameters(), strict=True))
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_step_in_backward_with_no_sync_accumulation(tiny: SimpleNamespace, arena: Any,
                                                    tmp_path: Path, mode: str) -> None:
    ref, ours = tiny.make_model(), tiny.make_model()
    train(tiny, ref, RefPlain(ref), range(3), accum=3)
    opt = offloaded(ours, arena, tmp_path, mode, "cpu", step_in_backward=True)
    train(tiny, ours, opt, range(3), accum=3, no_sync=True)
    assert tiny.params_equal(ref, ours)
    (ours(tiny.batch(9))).backward()
    with pytest.raises(FailedPrecondition):
        opt.clip_grad_norm_(1.0)  # bucket steps already started
    opt.close()


def test_cpu_mode_frees_device_grads(tiny: SimpleNamespace, arena: Any, tmp_path: Path) -> None:
    model = tiny.make_model()
    opt = offloaded(model, arena, tmp_path, "cpu", "cpu")
    model(tiny.batch(0)).backward()
    assert all(p.grad is None for p in model.parameters())
    opt.close()


def test_disk_tier_files_exist_and_bytes_are_read_back(tiny: SimpleNamespace, arena: Any,
                                                      tmp_path: Path) -> None:
    model = tiny.make_model()
    opt = offloaded(model, arena, tmp_path, "cpu", "disk")
    train(tiny, model, opt, range(3))
    files = list((tmp_path / "states").glob("pages-*.dat"))
    assert files and all(f.stat().st_size > 0 for f in files)
    blobs = sum(b.layout.nbytes for b in opt.buckets)
    assert opt.states.bytes_read >= 2 * blobs  # steps 2 and 3 read every bucket back
    assert opt.states.bytes_written >= 3 * blobs
    assert opt._disk.counters.bytes_read >= 2 * blobs
    opt.close()


def test_lr_scheduler_drives_the_offloaded_step(tiny: SimpleNamespace, arena: Any,
                                                tmp_path: Path) -> None:
    ref, ours = tiny.make_model(), tiny.make_model()
    r = RefPlain(ref)
    rs = torch.optim.lr_scheduler.LambdaLR(r.opt, lambda s: 1.0 / (s + 1))
    opt = offloaded(ours, arena, tmp_path, "cpu", "cpu")
    os_ = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for s in range(3):
        train(tiny, ref, r, range(s, s + 1))
        train(tiny, ours, opt, range(s, s + 1))
        rs.step()
        os_.step()
    assert tiny.params_equal(ref, ours)
    opt.close()


def test_bad_arguments_name_the_field(tiny: SimpleNamespace, arena: Any) -> None:
    model = tiny.make_model()
    with pytest.raises(InvalidArgument, match="mode"):
        OffloadedOptimizer(model.parameters(), mode="gpu", arena=arena)
    with pytest.raises(InvalidArgument, match="disk_path"):
        OffloadedOptimizer(model.parameters(), state_tier="disk", arena=arena)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_steps_buckets_during_backward_bit_exact(tiny: SimpleNamespace, arena: Any,
                                                         tmp_path: Path,
                                                         dtype: torch.dtype) -> None:
    ref, ours = tiny.make_model(dtype), tiny.make_model(dtype)
    r = RefPlain(ref) if dtype == torch.float32 else RefMixed(ref)
    train(tiny, ref, r, range(3))
    opt = offloaded(ours, arena, tmp_path, "cpu", "cpu")
    assert opt.step_in_backward and len(opt.buckets) > 1
    for s in range(3):
        ours(tiny.batch(s)).backward()
        assert all(b.future is not None for b in opt.buckets)  # started before step()
        opt.step()
        opt.zero_grad()
    assert tiny.params_equal(ref, ours)
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_accumulating_without_no_sync_after_early_steps_is_refused(
        tiny: SimpleNamespace, arena: Any, tmp_path: Path, mode: str) -> None:
    model = tiny.make_model()
    opt = offloaded(model, arena, tmp_path, mode, "cpu")
    model(tiny.batch(0)).backward()
    # Refused by the bucket's gradient hook, or — when the first step's weights were written
    # back while this forward held the old ones (a race with the worker) — by autograd's own
    # in-place check, which runs first; never a second step on accumulated gradients.
    with pytest.raises((FailedPrecondition, RuntimeError),
                       match=r"no_sync|modified by an inplace operation"):
        model(tiny.batch(0, 1)).backward()
    opt.close()
