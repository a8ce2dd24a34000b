"""The daemon's device preflight checks every GPU of a list, naming the setting."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError
from server.preflight import check_device


def test_a_list_naming_a_gpu_torch_does_not_see_is_refused() -> None:
    beyond = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 without any)
    config = OffloadConfig(device=f"cuda:0,{beyond}" if beyond != "cuda:0" else "cuda:0,cuda:1")
    with pytest.raises(ConfigError, match="DEVICE") as err:
        check_device(config)
    assert "cuda" in str(err.value)


def test_cpu_needs_no_gpu() -> None:
    check_device(OffloadConfig(device="cpu"))
