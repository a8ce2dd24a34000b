"""One typed config: environment parsing, validation messages, and the README table."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import OffloadConfig, describe, parse_size
from kvtier.errors import ConfigError


def test_defaults_match_the_design():
    c = OffloadConfig.from_env({})
    assert (c.enabled, c.policy, c.threshold, c.prefetch) == (True, "lru", 0.9, False)


def test_env_parsing_and_override():
    env = {
        "KVCACHED_OFFLOAD_ENABLED": "false",
        "KVCACHED_OFFLOAD_CPU_MEMORY_GB": "2.5",
        "KVCACHED_OFFLOAD_PAGE_SIZE": "2MiB",
        "KVCACHED_OFFLOAD_LISTEN": "unix:///tmp/a.sock, 127.0.0.1:7000",
        "KVCACHED_OFFLOAD_PREFETCH": "yes",
    }
    c = OffloadConfig.from_env(env, cpu_memory_gb=3.0)
    assert c.enabled is False and c.cpu_memory_gb == 3.0 and c.page_size == 2 << 20
    assert c.listen == ("unix:///tmp/a.sock", "127.0.0.1:7000") and c.prefetch is True


@pytest.mark.parametrize(
    ("var", "value", "accepted"),
    [
        ("KVCACHED_OFFLOAD_THRESHOLD", "1.5", "0 < x <= 1"),
        ("KVCACHED_OFFLOAD_PREFETCH", "maybe", "true|false"),
        ("KVCACHED_OFFLOAD_PAGE_SIZE", "1000", "multiple of 4KiB"),
        ("KVCACHED_OFFLOAD_DEVICE", "tpu", "auto|cpu|cuda"),
        ("KVCACHED_OFFLOAD_DISK_ADMISSION", "sometimes", "always|reused|never"),
        ("KVCACHED_OFFLOAD_CPU_MEMORY_GB", "lots", ">= PAGE_SIZE"),
        ("KVCACHED_OFFLOAD_LISTEN", "nowhere", "unix:///path.sock"),
    ],
)
def test_bad_values_name_the_variable_and_accepted_values(var, value, accepted):
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_env({var: value})
    assert var in str(err.value) and accepted in str(err.value)


def test_unknown_policy_lists_known_ones():
    from kvtier import TierEngine

    with pytest.raises(ConfigError, match="lru"):
        TierEngine(OffloadConfig(device="cpu", policy="nope", cpu_memory_gb=0.001))


def test_disk_size_needs_a_path():
    with pytest.raises(ConfigError, match="DISK_PATH"):
        OffloadConfig(disk_gb=1.0)


def test_sizes():
    assert (
        parse_size("64KiB") == 65536 and parse_size("4096") == 4096 and parse_size("1g") == 1 << 30
    )


def test_readme_table_lists_exactly_the_config_variables():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    in_readme = {
        line.split("`")[1]
        for line in readme.splitlines()
        if line.startswith("| `KVCACHED_OFFLOAD_")
    }
    assert in_readme == {row[0] for row in describe()}
