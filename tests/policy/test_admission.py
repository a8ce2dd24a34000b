"""Disk admission policies and their names."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.policy.admission import AlwaysAdmit, NeverAdmit, ReusedAdmit, create_admission

from .helpers import meta


@pytest.mark.parametrize("hits", [0, 1, 5])
def test_always_and_never(hits: int) -> None:
    assert AlwaysAdmit().admit(meta(1), hits) is True
    assert NeverAdmit().admit(meta(1), hits) is False


def test_reused_admits_only_pages_accessed_after_creation() -> None:
    policy = ReusedAdmit()
    assert policy.admit(meta(1), 0) is False
    assert policy.admit(meta(1), 1) is True
    assert policy.admit(meta(1), 7) is True


def test_reused_threshold_is_configurable() -> None:
    policy = ReusedAdmit(min_hits=2)
    assert policy.admit(meta(1), 1) is False
    assert policy.admit(meta(1), 2) is True
    with pytest.raises(ValueError):
        ReusedAdmit(min_hits=-1)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("always", AlwaysAdmit),
        ("reused", ReusedAdmit),
        ("never", NeverAdmit),
        (" Never ", NeverAdmit),
    ],
)
def test_create_admission_by_name(name: str, cls: type) -> None:
    policy = create_admission(name)
    assert type(policy) is cls
    assert policy.name == name.strip().lower()


def test_unknown_admission_names_variable_and_accepted_values() -> None:
    with pytest.raises(ConfigError) as info:
        create_admission("sometimes")
    message = str(info.value)
    assert "KVCACHED_OFFLOAD_DISK_ADMISSION" in message
    assert "always|reused|never" in message
