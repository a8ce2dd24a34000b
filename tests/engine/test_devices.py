"""Pools name their device: attach takes one of the engine's devices and refuses others."""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidArgument


def test_attach_defaults_to_the_first_device_and_accepts_it_by_name(make_engine) -> None:
    engine = make_engine(disk=False)
    assert engine.devices == ("cpu",)
    assert engine.attach("t", 4).dev.device == "cpu"
    assert engine.attach("t", 4, device="cpu").dev.device == "cpu"


def test_attach_on_a_device_the_engine_does_not_serve_changes_nothing(make_engine) -> None:
    engine = make_engine(disk=False)
    with pytest.raises(InvalidArgument, match="device") as err:
        engine.attach("t", 4, device="cuda:1")
    assert err.value.field == "device"
    assert "cpu" in str(err.value)  # names what it serves
    assert engine.pools() == []
    assert engine.stats().tiers[0].capacity_bytes == 0
