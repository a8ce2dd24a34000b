"""The hardware baseline every transfer benchmark divides by: one contiguous pinned copy.

``pinned_copy(nbytes, device, repeats)`` -> GB/s of ``nbytes`` device -> pinned host (``d2h``),
host -> device (``h2d``) and, on CUDA, both at once on two streams (``both``, bytes of both
directions): the median of ``repeats`` copies after a warm-up one. ``timed`` times one call
with the device synchronised before and after.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_gbs(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def pinned_copy(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    pin = device.type == "cuda"
    gpu, gpu2 = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    host, host2 = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2))
    d2h = [timed(lambda: host.copy_(gpu, non_blocking=True), device) for _ in range(repeats + 1)]
    h2d = [timed(lambda: gpu.copy_(host, non_blocking=True), device) for _ in range(repeats + 1)]
    out = {"d2h": median_gbs(nbytes, d2h[1:]), "h2d": median_gbs(nbytes, h2d[1:])}
    if device.type == "cuda":
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both() -> None:
            with torch.cuda.stream(s1):
                host.copy_(gpu, non_blocking=True)
            with torch.cuda.stream(s2):
                gpu2.copy_(host2, non_blocking=True)

        runs = [timed(both, device) for _ in range(repeats + 1)]
        out["both"] = median_gbs(2 * nbytes, runs[1:])
    return out
