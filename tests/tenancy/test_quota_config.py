"""The tenant-quota setting: parsing and validation (a bad value names the variable)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError
from kvtier.tenancy.quotas import Quota, TenantLedger, parse_quotas
from kvtier.types import Tier


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


def test_a_ledger_of_many_tenants_copies_its_arrays_only_at_powers_of_two() -> None:
    """Each new tenant name copied every per-tenant array one column wider: a client naming
    20,000 tenants made each new one copy ~5 MB, and every call slower (0.15-0.2 ms more per
    1,000 names). Columns now double; the spare ones hold nothing and have no quota."""
    ledger = TenantLedger({"q": Quota(cpu=4096)})
    widths = set()
    for i in range(1000):
        ledger.owner(f"t{i}")
        widths.add(ledger.limit.shape[1])
    assert widths == {2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}
    q = ledger.owner("q")
    assert int(ledger.limit[Tier.CPU, q]) == 4096 and (ledger.limit[:, q + 1 :] == -1).all()
    counts = ledger.per_owner(np.array([q, q, 3]), 10)
    assert counts.shape == (1024,) and counts[q] == 20 and counts[3] == 10
    ledger.settled[Tier.CPU] += counts
    ledger.drop("replaced", np.array([q]))
    assert int(ledger.drops["replaced"][q]) == 1 and ledger.drops["replaced"].shape == (1024,)
