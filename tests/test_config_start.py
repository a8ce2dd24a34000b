"""Settings ``kvtier serve`` used to take silently: an empty METRICS_ADDR, contradictions refused
at start (one line naming the setting, exit 2), and start-up warnings (typos, a disk budget
beyond its filesystem). Run through the real command line (``python -m kvtier``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError

P = "KVCACHED_OFFLOAD_"


def serve(tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvtier serve`` in CPU mode with ``env``, stopped by start-up checks: its
    socket's directory is a file, so a run that passes the settings exits 2 naming LISTEN."""
    (tmp / "afile").write_text("x")
    base = {k: v for k, v in os.environ.items() if not k.startswith(P) and k != "NOTIFY_SOCKET"}
    base.update({f"{P}DEVICE": "cpu", f"{P}LISTEN": f"unix://{tmp}/afile/k.sock",
                 f"{P}METRICS_ADDR": "", f"{P}PAGE_SIZE": "65536"})
    base.update({P + k: v for k, v in env.items()})
    return subprocess.run([sys.executable, "-m", "kvtier", "serve"], env=base, cwd=tmp,
                          capture_output=True, text=True, timeout=120)


def test_an_empty_metrics_addr_variable_turns_metrics_off() -> None:
    """Documented "empty disables it"; an empty variable was taken as unset (127.0.0.1:9464)."""
    assert OffloadConfig.from_env({f"{P}METRICS_ADDR": ""}).metrics_addr == ""
    assert OffloadConfig.from_env({}).metrics_addr == "127.0.0.1:9464"
    # The other "empty disables it" settings default to empty: an empty variable is the same.
    off = OffloadConfig.from_env({f"{P}{v}": "" for v in ("DISK_PATH", "REMOTE_URL",
                                                          "TENANTS_FILE", "TENANT_QUOTAS")})
    assert (off.disk_path, off.remote_url, off.tenants_file, off.tenant_quotas) == ("",) * 4


@pytest.mark.parametrize(("env", "says"), [
    ({"REMOTE_URL": "redis://127.0.0.1:99999", "REMOTE_SECRET_FILE": "/s"},
     f"{P}REMOTE_URL='redis://127.0.0.1:99999' is invalid (port 99999)"),
    ({"REMOTE_URL": "redis://127.0.0.1:0", "REMOTE_SECRET_FILE": "/s"}, "(port 0)"),
    ({"TIER_CHAIN": "gpu,cpu", "DISK_PATH": "{tmp}/disk", "DISK_GB": "0.01"},
     f"{P}TIER_CHAIN='gpu,cpu' leaves out disk"),
    ({"PAGE_SIZE": "4MiB", "CPU_MEMORY_GB": "0.001"},
     f"{P}CPU_MEMORY_GB=0.001 is smaller than one page"),
    ({"PAGE_SIZE": "4MiB", "CPU_MEMORY_GB": "0"}, f"{P}CPU_MEMORY_GB=0.0 is smaller"),
    ({"LISTEN": "unix:///tmp/x/k.sock,unix:///tmp/x/k.sock"},
     f"{P}LISTEN: unix:///tmp/x/k.sock is listed twice"),
    ({"LISTEN": "unix:///tmp/x/k.sock,127.0.0.1:47123", "METRICS_ADDR": "0.0.0.0:47123",
      "TOKEN_FILE": "/t"}, f"{P}METRICS_ADDR=0.0.0.0:47123 is the port of"),
])
def test_contradicting_settings_are_refused_in_one_line(tmp_path: Path, env: dict[str, str],
                                                        says: str) -> None:
    """Each was accepted: a remote that never connects, a disk tier never used, a CPU tier
    holding no page (every allocate on a full pool waited RESTORE_TIMEOUT_S, then None)."""
    done = serve(tmp_path, **{k: v.format(tmp=tmp_path) for k, v in env.items()})
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert err[0].startswith("kvtier serve: ") and says in err[0], err


def test_a_disabled_tier_chain_without_disk_is_fine_and_engine_configs_keep_working() -> None:
    OffloadConfig.from_env({f"{P}TIER_CHAIN": "gpu,cpu", f"{P}DISK_PATH": "/d"})  # DISK_GB 0
    OffloadConfig.from_env({f"{P}ENABLED": "false", f"{P}CPU_MEMORY_GB": "0"})
    # built in code (an engine's own config), not set by an operator: no contradiction
    OffloadConfig(tier_chain=("gpu", "cpu"), disk_path="/d", disk_gb=1.0)
    OffloadConfig(cpu_memory_gb=4 * 8192 / 2**30)  # an engine of 8 KiB pages: 4 of them
    with pytest.raises(ConfigError, match="CPU_MEMORY_GB"):
        OffloadConfig.from_env({f"{P}CPU_MEMORY_GB": "0"})


def test_unknown_variables_and_a_disk_beyond_its_filesystem_are_warned(tmp_path: Path) -> None:
    """A typo (CPU_MEMORY for CPU_MEMORY_GB) was silently ignored; so was DISK_GB=1e9 (the disk
    tier's file grows as pages come, so it fails only once the filesystem is full)."""
    done = serve(tmp_path, CPU_MEMORY="2", XYZZY="1", DISK_PATH=str(tmp_path / "d"),
                 DISK_GB="1e9")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and f"{P}LISTEN" in err[-1], done.stderr  # passed the settings
    warnings = [line for line in err if line.startswith("kvtier serve: warning: ")]
    assert len(warnings) == 3 and len(err) == 4, err
    assert f"{P}CPU_MEMORY is not a kvtier setting" in warnings[0]
    assert f"did you mean {P}CPU_MEMORY_GB?" in warnings[0]
    assert f"{P}XYZZY is not a kvtier setting and is ignored" == warnings[1].split(": ", 2)[2]
    assert f"{P}DISK_GB=1000000000.0 is more than the whole filesystem" in warnings[2]


def test_python_dash_m_kvtier_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("kvtier "), done.stderr
