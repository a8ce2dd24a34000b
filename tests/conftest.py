"""Shared fixtures: small real engines in CPU mode (host shared memory as the GPU tier)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvtier import OffloadConfig, TierEngine

PAGE = 4096


def small_config(tmp_path: Any = None, **overrides: Any) -> OffloadConfig:
    base: dict[str, Any] = dict(
        device="cuda" if torch.cuda.is_available() and overrides.pop("cuda", False) else "cpu",
        cpu_memory_gb=64 * PAGE / 2**30,
        gpu_memory_gb=1 / 1024,
        page_size=PAGE,
        pinned_chunk_mb=1,
        batch_mb=1,
        max_inflight_mb=4,
        restore_timeout_s=10.0,
        metrics_addr="",
    )
    if tmp_path is not None:
        base.update(disk_path=str(tmp_path / "disk"), disk_gb=256 * PAGE / 2**30)
    base.update(overrides)
    return OffloadConfig(**base)


@pytest.fixture
def make_engine(tmp_path: Any) -> Iterator[Callable[..., TierEngine]]:
    engines: list[TierEngine] = []

    def factory(disk: bool = True, **overrides: Any) -> TierEngine:
        engine = TierEngine(small_config(tmp_path if disk else None, **overrides))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close(grace=5)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """GPU-only tests are skipped cleanly (with a reason) where torch sees no CUDA device, and
    multi-GPU ones where it sees fewer than two."""
    if torch.cuda.device_count() < 2:
        few = pytest.mark.skip(reason="needs two or more CUDA GPUs")
        for item in items:
            if item.get_closest_marker("multigpu") is not None:
                item.add_marker(few)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
