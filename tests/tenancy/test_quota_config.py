"""The tenant-quota setting: parsing and validation (a bad value names the variable)."""

from __future__ import annotations

import pytest

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError
from kvtier.tenancy.quotas import Quota, parse_quotas


def test_parse_quotas_entries_units_and_default():
    got = parse_quotas("tenant-a=gpu:2GiB,cpu:4G,disk:20GiB; *=cpu:512MiB ;b=disk:4096")
    assert got == {
        "tenant-a": Quota(gpu=2 << 30, cpu=4 << 30, disk=20 << 30),
        "*": Quota(cpu=512 << 20),
        "b": Quota(disk=4096),
    }
    assert parse_quotas("") == {} and parse_quotas(" ; ") == {}


@pytest.mark.parametrize(
    "text",
    ["a", "a=", "=cpu:1G", "a=ram:1G", "a=cpu:1G,cpu:2G", "a=cpu:1G;a=disk:1G", "a=cpu:-1",
     "a=cpu:1X", "a=cpu", "-a=cpu:1G", "a b=cpu:1G"],
)
def test_bad_quotas_are_a_config_error_naming_the_variable(text):
    with pytest.raises(ValueError):
        parse_quotas(text)
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_TENANT_QUOTAS"):
        OffloadConfig.from_env({"KVCACHED_OFFLOAD_TENANT_QUOTAS": text})
