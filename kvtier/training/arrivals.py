"""``gpu_stream`` mode's steps in backward: which parameters of each bucket got their gradient.

``GradArrivals(buckets, stepper, paused)``:
    * Registers a post-accumulate-grad hook on every parameter of ``buckets``. A bucket's first
      gradient starts staging its states (``stepper.stage``); once every parameter of the bucket
      has one, the bucket steps (``stepper.step_bucket``) and its arrivals are forgotten.
    * While ``paused()`` (inside ``no_sync()``) arrivals are counted but nothing is staged or
      stepped. A bucket that completes again after its step in this round raises
      :class:`~kvtier.errors.FailedPrecondition` (its gradients would be dropped).
    * ``clear()`` forgets every arrival (end of an accumulation, end of a step: parameters that
      got no gradient never carry into the next backward); ``remove()`` drops the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.errors import FailedPrecondition
from kvtier.training.stepping import OptBucket
from kvtier.training.streamed import DeviceStepper


class GradArrivals:
    """See the module docstring."""

    def __init__(self, buckets: list[OptBucket], stepper: DeviceStepper,
                 paused: Callable[[], bool]) -> None:
        self.buckets, self.stepper, self.paused = buckets, stepper, paused
        self._where = {id(p): b.index for b in buckets for p in b.params}
        self._arrived: list[set[int]] = [set() for _ in buckets]
        self._hooks: list[Any] = [p.register_post_accumulate_grad_hook(self._hook)
                                  for b in buckets for p in b.params]

    def _hook(self, p: torch.Tensor) -> None:
        k = self._where[id(p)]
        arrived = self._arrived[k]
        arrived.add(id(p))
        complete = len(arrived) == len(self.buckets[k].params)
        if complete:
            arrived.clear()
        if self.paused():
            return
        if len(arrived) == 1:
            self.stepper.stage(k)  # the bucket's first gradient: start loading its states
        if complete:
            if k in self.stepper.done:
                raise FailedPrecondition(
                    f"optimizer bucket {k} got gradients again after its step in "
                    "backward: accumulate inside no_sync() or pass step_in_backward=False")
            self.stepper.step_bucket(k)

    def clear(self) -> None:
        for arrived in self._arrived:
            arrived.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
