"""Readiness events: when the engine's user last released pages on the GPU.

Contract: ``record(device)`` records a CUDA event on ``device``'s current stream (the default
device's when None: a pool's pages are last used on its own GPU) and returns its serial (0 in
CPU mode, where there is nothing to wait for); pages keep the serial of their last release in the
page table. ``events(serials)`` returns the distinct events a batch of those pages must wait for
before its copies read them. Completed events may be forgotten (a serial with no event needs no
wait), so the table of events stays small.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_PRUNE_AT = 256


class ReadyEvents:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._serial = 0
        self._events: dict[int, Any] = {}

    def record(self, device: str | torch.device | None = None) -> int:
        if not self._cuda:
            return 0
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device if device is None else device))
        self._serial += 1
        self._events[self._serial] = event
        if len(self._events) > _PRUNE_AT:
            self._events = {s: e for s, e in self._events.items() if not e.query()}
        return self._serial

    def events(self, serials: np.ndarray) -> list[Any]:
        if not self._cuda or not len(serials):
            return []
        first = serials[0]
        distinct = [int(first)] if (serials == first).all() else np.unique(serials).tolist()
        return [self._events[s] for s in distinct if s in self._events]
