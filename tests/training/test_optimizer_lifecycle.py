"""OffloadedOptimizer's step lifecycle: each round of gradients is applied exactly once,
whatever is called between backward() and step() (state_dict, a retried step, a skipped step,
a changed learning rate), and bit for bit as ``torch.optim.AdamW`` in fp32."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvtier.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from kvtier.training import OffloadedOptimizer

SHAPES = [(7, 5), (13,), (4, 6)]
HP: dict[str, Any] = dict(lr=1e-2, weight_decay=0.1)


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def clone(ps: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def backward(ps: list[torch.nn.Parameter], step: int) -> None:
    """loss = sum(p * g): each parameter's gradient is a fixed random tensor."""
    g = torch.Generator().manual_seed(100 + step)
    sum((p * torch.randn(p.shape, generator=g)).sum() for p in ps).backward()  # type: ignore[union-attr]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def offloaded(ps: list[torch.nn.Parameter], arena: Any, **kw: Any) -> OffloadedOptimizer:
    return OffloadedOptimizer(ps, torch.optim.AdamW, arena=arena,
                              **{"bucket_mb": 1e-4, **HP, **kw})


def reference(ps: list[torch.nn.Parameter], steps: range) -> None:
    ref = torch.optim.AdamW(ps, fused=True, **HP)
    for s in steps:
        backward(ps, s)
        ref.step()
        ref.zero_grad()


@pytest.mark.parametrize("call", ["state_dict", "load_state_dict"])
def test_checkpoint_between_backward_and_step_applies_each_step_once(arena: Any,
                                                                      call: str) -> None:
    ref, ours = make_params(), make_params()
    reference(ref, range(3))
    opt = offloaded(ours, arena, mode="cpu")
    assert opt.step_in_backward and len(opt.buckets) > 1
    for s in range(3):
        backward(ours, s)
        sd = opt.state_dict()  # the current state: every bucket stepped in backward
        assert sd["state"][0]["step"].item() == s + 1
        if call == "load_state_dict":
            opt.load_state_dict(sd)
        opt.step()
        opt.zero_grad()
    assert equal(ref, ours)
    assert opt.state_dict()["state"][0]["step"].item() == 3
    opt.close()


def test_retrying_a_step_that_timed_out_applies_it_once(arena: Any) -> None:
    ref, ours = make_params(), make_params()
    reference(ref, range(2))
    opt = offloaded(ours, arena, mode="cpu", step_in_backward=False, timeout_s=0.05)
    release = threading.Event()
    opt.executor.submit(release.wait)  # the worker is busy: the step cannot finish in time
    backward(ours, 0)
    with pytest.raises(DeadlineExceeded):
        opt.step()
    release.set()
    opt.timeout_s = 30.0
    opt.step()  # completes the step that timed out, applying its gradients once
    opt.zero_grad()
    backward(ours, 1)
    opt.step()
    opt.zero_grad()
    assert equal(ref, ours)
    opt.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1"])
def test_timeout_must_be_a_positive_number(arena: Any, bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="timeout_s"):
        offloaded(make_params(), arena, timeout_s=bad)


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_accumulation_with_a_parameter_unused_in_an_earlier_micro_batch(arena: Any,
                                                                        mode: str) -> None:
    def micro(ps: list[torch.nn.Parameter], s: int, m: int) -> None:
        used = ps if m == 1 else ps[:1]  # ps[1:] only get gradients in the last micro-batch
        backward(used, 10 * s + m)

    ref, ours = make_params(), make_params()
    r = torch.optim.AdamW(ref, fused=True, **HP)
    opt = offloaded(ours, arena, mode=mode, bucket_mb=1)  # one bucket holds every parameter
    assert len(opt.buckets) == 1
    for s in range(3):
        micro(ref, s, 0)
        micro(ref, s, 1)
        r.step()
        r.zero_grad()
        with opt.no_sync():
            micro(ours, s, 0)
        micro(ours, s, 1)
        opt.step()
        opt.zero_grad()
    assert equal(ref, ours)
    assert all(p.grad is None for p in ours)
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_zero_grad_after_a_step_in_backward_is_refused(arena: Any, mode: str) -> None:
    ref, ours = make_params(), make_params()
    reference(ref, range(2))
    opt = offloaded(ours, arena, mode=mode)
    for s in range(2):
        backward(ours, s)
        if s == 1:
            with pytest.raises(FailedPrecondition, match="already applied during backward"):
                opt.zero_grad()  # a skipped step: the step in backward cannot be undone
        opt.step()  # the refusal changed nothing: the step is finished, applied once
        opt.zero_grad()
    assert equal(ref, ours)
    assert opt.state_dict()["state"][0]["step"].item() == 2
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
def test_skipping_steps_without_step_in_backward_follows_torch(arena: Any, mode: str) -> None:
    ref, ours = make_params(), make_params()
    r = torch.optim.AdamW(ref, fused=True, **HP)
    opt = offloaded(ours, arena, mode=mode, step_in_backward=False)
    for s in range(4):
        skip = s in (0, 2)  # the very first step too: states not created yet
        for ps, o in ((ref, r), (ours, opt)):
            backward(ps, s)
            if not skip:
                o.step()
            o.zero_grad()
        assert equal(ref, ours), s
    assert opt.state_dict()["state"][0]["step"].item() == 2
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu_stream"])
@pytest.mark.parametrize("in_backward", [True, False])
def test_lr_set_between_backward_and_step(arena: Any, mode: str, in_backward: bool) -> None:
    ref, ours = make_params(), make_params()
    r = torch.optim.AdamW(ref, fused=True, **HP)
    opt = offloaded(ours, arena, mode=mode, step_in_backward=in_backward)
    for s in range(3):
        lr = 1e-2 * (s + 1) * 10
        backward(ref, s)
        for g in r.param_groups:
            g["lr"] = lr
        r.step()
        r.zero_grad()
        backward(ours, s)
        old = opt.param_groups[0]["lr"]
        for g in opt.param_groups:
            g["lr"] = lr
        if in_backward and lr != old:  # stepped with the old lr: cannot be redone
            with pytest.raises(FailedPrecondition, match="hyper-parameters"):
                opt.step()
            assert opt.state_dict()["state"][0]["step"].item() == s + 1  # applied once
            opt.close()
            return
        opt.step()  # without steps in backward the new lr is the one used, as in torch
        opt.zero_grad()
        assert equal(ref, ours), s
    opt.close()


@pytest.mark.parametrize("bad", ["groups", "params", "shape"])
def test_load_state_dict_that_does_not_fit_changes_nothing(arena: Any, bad: str) -> None:
    ours = make_params()
    opt = offloaded(ours, arena, mode="cpu")
    backward(ours, 0)
    opt.step()
    opt.zero_grad()
    sd, before = opt.state_dict(), [p.detach().clone() for p in ours]
    wrong = {"state": dict(sd["state"]), "param_groups": [dict(g) for g in sd["param_groups"]]}
    wrong["param_groups"][0]["lr"] = 123.0
    if bad == "groups":
        wrong["param_groups"].append(dict(wrong["param_groups"][0]))
    elif bad == "params":
        wrong["param_groups"][0]["params"] = [0]
    else:  # the last parameter's states would otherwise broadcast silently
        last = len(ours) - 1
        wrong["state"][last] = {**sd["state"][last],
                                "exp_avg": torch.zeros(ours[last].shape[1:])}
        with torch.no_grad():
            for p in ours:
                p.zero_()  # load re-syncs weights first of all: must not happen either
        before = [p.detach().clone() for p in ours]
    with pytest.raises(InvalidArgument, match="state_dict"):
        opt.load_state_dict(wrong)
    assert opt.param_groups[0]["lr"] == HP["lr"]
    assert equal(before, ours)
    opt.close()
