"""One optimizer bucket: its flat layout and a private inner ``torch.optim`` instance.

The inner optimizer is rebound to whatever tensors hold the bucket this step (host arena views,
a disk slot buffer, a device staging buffer): ``run(params, grads, views)`` points its
``param_groups[0]["params"]`` at ``params``, its per-parameter state at the ``views`` regions,
steps, and adopts freshly created state tensors into the regions. Scalar state entries (``step``)
stay in the inner optimizer and follow the parameter's position.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import torch

from kvtier.training.buckets import FlatLayout


def hyper_of(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of a param group's hyper-parameters (everything but ``params``)."""
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in group.items() if k != "params"}


def same_hyper(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor)
                    and torch.equal(v.cpu(), w.cpu())):
                return False
        elif v != w:
            return False
    return True


def state_keys(optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any],
               dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """Names and dtypes of the parameter-shaped state tensors ``optimizer_class`` keeps
    (found by stepping it once on a tiny CPU parameter)."""
    probe = torch.zeros(3, 5, dtype=dtype)
    probe.grad = torch.ones_like(probe)
    opt = optimizer_class([probe], **kwargs)
    opt.step()
    st = opt.state[probe]
    return sorted((k, v.dtype) for k, v in st.items()
                  if isinstance(v, torch.Tensor) and v.shape == probe.shape)


def with_fused(optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]
               ) -> dict[str, Any]:
    """``fused=True`` where the class accepts it and the caller chose neither fused nor foreach."""
    params = inspect.signature(optimizer_class).parameters
    if "fused" in params and kwargs.get("fused") is None and kwargs.get("foreach") is None:
        return {**kwargs, "fused": True}
    return dict(kwargs)


class OptBucket:
    """Working parameters of one bucket plus everything needed to step them elsewhere."""

    def __init__(self, index: int, group: int, params: list[torch.Tensor], *,
                 master_dtype: torch.dtype | None, keys: list[tuple[str, torch.dtype]],
                 optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 compute_device: torch.device) -> None:
        self.index = index
        self.group = group
        self.params = params
        self.master_dtype = master_dtype
        self.keys = [k for k, _ in keys]
        regions = ([("master", master_dtype)] if master_dtype is not None else []) + keys
        self.layout = FlatLayout.build([p.shape for p in params], regions)
        self.has_state = [False] * len(params)
        dtype = master_dtype or params[0].dtype
        holders = [torch.empty(0, dtype=dtype, device=compute_device) for _ in params]
        self.inner = optimizer_class(holders, **kwargs)
        self.future: Any = None  # an in-flight CPU step
        self.pending = False  # cpu mode: stepped (or in flight) since the last step() ended
        self.in_backward = False  # cpu mode: stepped in backward, step() not called since
        self.used: dict[str, Any] = {}  # the hyper-parameters of the bucket's latest step

    @property
    def has_master(self) -> bool:
        return self.master_dtype is not None

    def bound(self) -> list[torch.Tensor]:
        return list(self.inner.param_groups[0]["params"])

    def views(self, blob: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        return {name: self.layout.views(blob, name) for name in self.layout.regions}

    def rebind(self, params: list[torch.Tensor], views: dict[str, list[torch.Tensor]]) -> None:
        """Point the inner optimizer at ``params`` and, where they exist, states in ``views``."""
        inner = self.inner
        old = self.bound()
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for j, p in enumerate(params):
            prev = inner.state.get(old[j])
            if prev:
                st = {k: v for k, v in prev.items() if k not in self.keys}
                if self.has_state[j]:
                    st.update({k: views[k][j] for k in self.keys})
                state[p] = st
        inner.state = state
        inner.param_groups[0]["params"] = list(params)

    def run(self, params: list[torch.Tensor], grads: list[torch.Tensor | None],
            views: dict[str, list[torch.Tensor]], hyper: dict[str, Any]) -> None:
        """One step of the inner optimizer on ``params`` with ``grads``; states in ``views``."""
        self.rebind(params, views)
        group = self.inner.param_groups[0]
        group.update({k: v for k, v in hyper.items() if k != "params"})
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        self.inner.step()
        for j, p in enumerate(params):
            p.grad = None
            st = self.inner.state.get(p)
            if not self.has_state[j] and st:
                for k in self.keys:
                    views[k][j].copy_(st[k])
                    st[k] = views[k][j]
                self.has_state[j] = True

    def scalars(self, j: int) -> dict[str, Any]:
        """Non-region state entries of parameter ``j`` (cloned)."""
        st = self.inner.state.get(self.bound()[j]) or {}
        return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in st.items() if k not in self.keys}

    def load_scalars(self, j: int, values: dict[str, Any]) -> None:
        p = self.bound()[j]
        dev = p.device
        self.inner.state[p] = {k: (v.to(dev) if isinstance(v, torch.Tensor)
                                   and self._on_device(k) else
                                   v.clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in values.items()}

    def _on_device(self, key: str) -> bool:
        # fused/capturable optimizers keep ``step`` on the parameter's device
        group = self.inner.param_groups[0]
        return bool(group.get("fused") or group.get("capturable"))

