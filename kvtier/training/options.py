"""``OffloadedOptimizer``'s constructor arguments, checked in one place before anything is built.

    * ``check_options(...)``: raises :class:`~kvtier.errors.InvalidArgument` naming the first
      argument that is out of range, with the accepted values; nothing is allocated before.
    * ``class_defaults(optimizer_class, kwargs)``: the wrapped class's defaults with ``kwargs``
      applied (every hyper-parameter it has, as ``torch.optim`` puts in each param group);
      refuses a class that is not a ``torch.optim.Optimizer`` or that creates its state when
      constructed (``Adagrad``: the state would be made for placeholder tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import InvalidArgument
from kvtier.training.base import positive

MODES = ("cpu", "gpu_stream")
TIERS = ("cpu", "disk")


def check_options(*, mode: str, state_tier: str, disk_path: str | None, disk_store: Any,
                  timeout_s: float, bucket_mb: float) -> None:
    if mode not in MODES:
        raise InvalidArgument("mode", f"{mode!r}; accepted: {'|'.join(MODES)}")
    if state_tier not in TIERS:
        raise InvalidArgument("state_tier", f"{state_tier!r}; accepted: {'|'.join(TIERS)}")
    if state_tier == "disk" and disk_path is None and disk_store is None:
        raise InvalidArgument("disk_path", "state_tier='disk' needs disk_path or disk_store")
    if state_tier == "cpu" and disk_path is not None:
        raise InvalidArgument("disk_path", f"{disk_path!r} given with state_tier='cpu', where "
                                           "states stay in host memory: pass state_tier='disk'")
    if not positive(timeout_s):
        raise InvalidArgument("timeout_s", f"{timeout_s!r}; accepted: a finite number > 0")
    if not positive(bucket_mb):
        raise InvalidArgument("bucket_mb", f"{bucket_mb!r}; accepted: a finite number > 0")


def class_defaults(optimizer_class: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise InvalidArgument("optimizer_class", f"{optimizer_class!r}; accepted: a "
                                                 "torch.optim.Optimizer subclass")
    probe = optimizer_class([torch.zeros(1, requires_grad=True)], **kwargs)
    if probe.state:
        raise InvalidArgument("optimizer_class", f"{optimizer_class.__name__} creates its "
                              "state when constructed, not at its first step: not supported")
    return dict(probe.defaults)
