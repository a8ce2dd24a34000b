"""KVCACHED_OFFLOAD_DEVICE: one device, every visible GPU, or a list of GPUs."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError


@pytest.mark.parametrize(
    ("device", "devices"),
    [
        ("cpu", ("cpu",)),
        ("cuda:3", ("cuda:3",)),
        ("cuda:1,cuda:0", ("cuda:1", "cuda:0")),  # listed order: the first is the default
    ],
)
def test_devices_resolve_in_order_with_the_first_as_default(device: str, devices: tuple) -> None:
    config = OffloadConfig(device=device)
    assert config.resolved_devices() == devices
    assert config.resolved_device() == devices[0]


def test_cuda_is_every_visible_gpu() -> None:
    n = max(1, torch.cuda.device_count())
    assert OffloadConfig(device="cuda").resolved_devices() == tuple(f"cuda:{i}" for i in range(n))


@pytest.mark.parametrize(
    "bad", ["cuda:0,cuda:0", "cuda:0,", ",cuda:1", "cpu,cuda:0", "cuda,cuda:1", "cuda:x", "gpu:0"]
)
def test_a_bad_device_list_names_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_DEVICE"):
        OffloadConfig(device=bad)


def test_a_device_list_from_the_environment() -> None:
    config = OffloadConfig.from_env({"KVCACHED_OFFLOAD_DEVICE": "cuda:0,cuda:1"})
    assert config.resolved_devices() == ("cuda:0", "cuda:1")
