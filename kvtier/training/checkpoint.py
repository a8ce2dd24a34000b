"""``OffloadedOptimizer``'s checkpoints: its state in ``torch.optim``'s ``state_dict`` form.

    * ``saved_state(opt)``: master weights, states (cloned) and hyper-parameters keyed by
      parameter position: the current state, steps already taken in backward included (as a
      ``torch.optim`` optimizer stepped in post-accumulate-grad hooks).
    * ``check_state_dict(opt, sd)``: raises :class:`~kvtier.errors.InvalidArgument` naming
      ``state_dict`` unless ``sd`` fits ``opt`` (same number of groups and of parameters per
      group, every saved tensor of its parameter's shape); nothing is changed.
    * ``load_state(opt, sd)``: writes a checked ``sd`` into the buckets (states flushed) and
      re-syncs the working weights from the master weights.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import InvalidArgument
from kvtier.training.stepping import OptBucket


def _param_ids(opt: Any) -> dict[int, int]:
    ids: dict[int, int] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            ids.setdefault(id(p), len(ids))
    return ids


def saved_state(opt: Any) -> dict[str, Any]:
    pid, state = _param_ids(opt), {}
    for b in opt.buckets:
        views = b.views(opt.states.acquire(b.index))
        for j, p in enumerate(b.params):
            st = b.scalars(j)
            names = (["master"] if b.has_master else []) + (b.keys if b.has_state[j] else [])
            st.update({k: views[k][j].clone() for k in names})
            state[pid[id(p)]] = st
        opt.states.release(b.index, dirty=False)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [pid[id(p)] for p in g["params"]]} for g in opt.param_groups]
    return {"state": state, "param_groups": groups}


def check_state_dict(opt: Any, sd: Any) -> None:
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list) \
            or not isinstance(sd.get("state"), dict):
        raise InvalidArgument("state_dict", "needs 'state' (a dict) and 'param_groups' (a list)")
    saved = sd["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise InvalidArgument("state_dict", f"{len(saved)} param groups, this optimizer has "
                                            f"{len(opt.param_groups)}")
    for i, (g, s) in enumerate(zip(opt.param_groups, saved, strict=True)):
        if not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"]):
            raise InvalidArgument("state_dict", f"param group {i} does not have "
                                                f"{len(g['params'])} parameters")
    pid = _param_ids(opt)
    for b in opt.buckets:
        for p in b.params:
            st = sd["state"].get(pid[id(p)], {})
            for k in (["master"] if b.has_master else []) + b.keys:
                v = st.get(k)
                if v is not None and (not isinstance(v, torch.Tensor) or v.shape != p.shape):
                    raise InvalidArgument(
                        "state_dict", f"state {k!r} of parameter {pid[id(p)]} is "
                        f"{getattr(v, 'shape', type(v).__name__)}, the parameter {p.shape}")


@torch.no_grad()
def load_state(opt: Any, sd: dict[str, Any]) -> None:
    for g, saved in zip(opt.param_groups, sd["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
    pid, state = _param_ids(opt), sd["state"]
    for b in opt.buckets:
        views = b.views(opt.states.acquire(b.index))
        for j, p in enumerate(b.params):
            _load_param(b, j, state.get(pid[id(p)], {}), views)
            if b.has_master:
                p.copy_(views["master"][j])
        opt.states.release(b.index, dirty=True)
    opt.states.flush()


def _load_param(b: OptBucket, j: int, st: dict[str, Any],
                views: dict[str, list[torch.Tensor]]) -> None:
    if b.has_master and "master" in st:
        views["master"][j].copy_(st["master"])
    b.has_state[j] = all(k in st for k in b.keys) and bool(b.keys)
    if b.has_state[j]:
        for k in b.keys:
            views[k][j].copy_(st[k])
    b.load_scalars(j, {k: v for k, v in st.items() if k not in b.keys and k != "master"})
