"""The flags of ``kvtier serve`` (each the override of one config field) and the version.

One table read by the command line (``kvtier.cli``: the parser and its help) and by the daemon's
start-up checks (``kvtier.server.preflight``: errors name ``--flag/VARIABLE``), so neither imports
the other.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvtier.config import OffloadConfig

# flag -> (config field, argparse type); help text comes from the config field's documentation.
SERVE_FLAGS: dict[str, tuple[str, Any]] = {
    "--listen": ("listen", str),
    "--metrics-addr": ("metrics_addr", str),
    "--device": ("device", str),
    "--disk-path": ("disk_path", str),
    "--disk-gb": ("disk_gb", float),
    "--remote-url": ("remote_url", str),
    "--cpu-memory-gb": ("cpu_memory_gb", float),
    "--gpu-memory-gb": ("gpu_memory_gb", float),
    "--policy": ("policy", str),
    "--token-file": ("token_file", str),
    "--grace": ("grace_s", float),
    "--log-level": ("log_level", str),
}


def setting(name: str) -> str:
    """``--flag/KVCACHED_OFFLOAD_VAR`` of a config field (the variable alone without a flag)."""
    env = next(f.metadata["env"] for f in fields(OffloadConfig) if f.name == name)
    flag = next((fl for fl, (field, _) in SERVE_FLAGS.items() if field == name), None)
    return f"{flag}/{env}" if flag else env


def package_version() -> str:
    """The installed distribution's version (``0.0.0`` when run from a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        return "0.0.0"
