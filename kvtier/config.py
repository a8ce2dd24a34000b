"""One typed configuration for the engine and the daemon.

Loaded once: ``OffloadConfig.from_env()`` reads ``KVCACHED_OFFLOAD_*`` variables, then callers (the
CLI) override with ``dataclasses.replace``; ``__post_init__`` validates every field in one place.
Nothing reads the environment at import time. A bad value raises :class:`ConfigError` naming the
variable (or field) and the accepted values. The README's configuration table is generated from
:func:`describe` and a test keeps the two equal.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvtier import config_rules as rules
from kvtier.errors import ConfigError

ENV_PREFIX = "KVCACHED_OFFLOAD_"
KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB}
# Settings whose default is on and whose empty value turns them off (documented so); for every
# other setting an empty variable is as if unset (its default, an empty one for paths and URLs).
_EMPTY_TURNS_OFF = frozenset({"metrics_addr"})


def _opt(default: Any, env: str, doc: str, accepted: str = "") -> Any:
    meta = {"env": ENV_PREFIX + env, "doc": doc, "accepted": accepted}
    if isinstance(default, tuple):
        return field(default=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Every setting of kvtier, with its default. Fields map 1:1 to ``KVCACHED_OFFLOAD_<NAME>``."""

    # --- tiers and policy -------------------------------------------------------------------
    enabled: bool = _opt(
        True, "ENABLED", "Offload cold pages below the GPU tier at all.", "true|false"
    )
    cpu_memory_gb: float = _opt(
        4.0, "CPU_MEMORY_GB", "Pinned host memory budget (GiB), grown lazily.", ">= PAGE_SIZE"
    )
    gpu_memory_gb: float = _opt(
        1.0, "GPU_MEMORY_GB", "Budget for daemon-allocated GPU page pools (GiB).", "> 0"
    )
    policy: str = _opt(
        "lru",
        "POLICY",
        "Eviction policy: a registered name or 'module:Class'.",
        "lru|priority|hybrid|arc|s3fifo|...",
    )
    threshold: float = _opt(
        0.9, "THRESHOLD", "GPU use ratio above which pages are offloaded.", "0 < x <= 1"
    )
    low_watermark: float = _opt(
        0.8, "LOW_WATERMARK", "Offload down to this GPU use ratio.", "0 <= x < THRESHOLD"
    )
    prefetch: bool = _opt(
        False, "PREFETCH", "Bring offloaded pages back while the GPU has room.", "true|false"
    )
    page_size: int = _opt(
        256 * KIB,
        "PAGE_SIZE",
        "Default page size in bytes (64KiB, 2MiB, ...).",
        "4KiB..64MiB, multiple of 4KiB",
    )
    device: str = _opt(
        "auto",
        "DEVICE",
        "Where the GPU tier lives: 'cuda' is every visible GPU, a comma list names some "
        "(one pool set, lane pair and copy streams per GPU); 'cpu' uses host shared memory.",
        "auto|cpu|cuda|cuda:N|cuda:N,cuda:M,...",
    )
    # --- disk tier --------------------------------------------------------------------------
    disk_path: str = _opt(
        "", "DISK_PATH", "Directory of the disk tier; empty disables it.", "a directory path"
    )
    disk_gb: float = _opt(0.0, "DISK_GB", "Disk tier budget (GiB); 0 disables it.", ">= 0")
    disk_admission: str = _opt(
        "reused",
        "DISK_ADMISSION",
        "Which pages evicted from CPU go to disk.",
        "always|reused|never",
    )
    disk_direct_io: bool = _opt(
        True, "DISK_DIRECT_IO", "Use O_DIRECT where the filesystem allows it.", "true|false"
    )
    disk_io_threads: int = _opt(
        4,
        "DISK_IO_THREADS",
        "Threads writing and reading disk pages: the disk's queue depth (a batch is cut into "
        "8 MiB parts, one per thread at a time).",
        "1..64",
    )
    # --- the tier chain ---------------------------------------------------------------------
    tier_chain: tuple[str, ...] = _opt(
        ("gpu", "cpu", "disk"),
        "TIER_CHAIN",
        "Media a page walks down, comma-separated: gpu, cpu, then up to six distinct "
        "registered media below the CPU, top down (each one's budget and path are its own "
        "settings); a page pushed out of one goes to the next, and is dropped at the end; "
        "gpu,cpu: none.",
        "gpu,cpu[,disk|<registered medium>,...]",
    )
    # --- transfers --------------------------------------------------------------------------
    pinned_chunk_mb: int = _opt(
        64, "PINNED_CHUNK_MB", "Size of each exact-size pinned host chunk (MiB).", "1..4096"
    )
    batch_mb: int = _opt(
        64, "BATCH_MB", "Most bytes moved by one transfer batch (gather + one DMA).", "1..4096"
    )
    max_inflight_mb: int = _opt(
        512, "MAX_INFLIGHT_MB", "Most bytes in flight across all transfers (MiB).", ">= BATCH_MB"
    )
    restore_timeout_s: float = _opt(
        30.0, "RESTORE_TIMEOUT_S", "Deadline for one restore (seconds).", "(0, 86400]"
    )
    # --- remote tier (a shared Redis / Valkey store) -------------------------------------------
    remote_url: str = _opt(
        "",
        "REMOTE_URL",
        "Shared Redis/Valkey store (standalone or Cluster); empty disables the remote tier.",
        "redis://[user@]host:port[/db]|rediss://...",
    )
    remote_password_file: str = _opt(
        "", "REMOTE_PASSWORD_FILE", "File holding the store's password (mode 0600).", "a file path"
    )
    remote_secret_file: str = _opt(
        "",
        "REMOTE_SECRET_FILE",
        "Cluster-wide secret salting remote keys and keying their MACs (mode 0600).",
        "a file path (required with REMOTE_URL)",
    )
    remote_ttl_s: int = _opt(
        86400, "REMOTE_TTL_S", "Expiry of remote pages (seconds); 0 = none.", ">= 0"
    )
    remote_admission: str = _opt(
        "always",
        "REMOTE_ADMISSION",
        "Which stored blocks are written to the remote tier.",
        "always|reused|never",
    )
    remote_timeout_ms: int = _opt(
        200, "REMOTE_TIMEOUT_MS", "Deadline of one remote call (milliseconds).", "1..60000"
    )
    remote_inflight_mb: int = _opt(
        256, "REMOTE_INFLIGHT_MB", "Most bytes queued for remote writes (MiB).", "1..65536"
    )
    # --- daemon -----------------------------------------------------------------------------
    listen: tuple[str, ...] = _opt(
        (),
        "LISTEN",
        "Listen addresses, comma-separated; default a unix socket in the runtime dir.",
        "unix:///path.sock|host:port",
    )
    metrics_addr: str = _opt(
        "127.0.0.1:9464",
        "METRICS_ADDR",
        "Prometheus /metrics address; empty disables it.",
        "host:port",
    )
    token: str = _opt(
        "",
        "TOKEN",
        "Shared secret required on TCP listeners (metadata 'authorization: Bearer ...').",
        "a string",
    )
    token_file: str = _opt(
        "", "TOKEN_FILE", "File holding the TCP token (preferred over TOKEN).", "a file path"
    )
    grace_s: float = _opt(10.0, "GRACE_S", "Drain period on SIGTERM before exit (seconds).",
                          "(0, 86400]")
    max_message_mb: int = _opt(
        64, "MAX_MESSAGE_MB", "Largest gRPC message accepted or sent (MiB).", "1..1024"
    )
    calls_per_tenant: int = _opt(16, "CALLS_PER_TENANT", "Most calls of one tenant running at "
                                 "once, streams too (of 64 workers; the rest wait).", "4..64")
    keepalive_s: float = _opt(30.0, "KEEPALIVE_S", "Seconds between pings per gRPC connection; "
                              "a peer not answering within a third of it loses its calls.",
                              "1..3600")
    log_level: str = _opt("info", "LOG_LEVEL", "Log verbosity.", "debug|info|warning|error")
    # --- tenants ----------------------------------------------------------------------------
    tenants_file: str = _opt(
        "",
        "TENANTS_FILE",
        "Tenant credentials, one 'tenant token' per line ('@admin token': the global Stats "
        "view); read at start and on SIGHUP; empty: tenants are self-declared.",
        "a file path, not readable by group or others",
    )
    tenant_quotas: str = _opt(
        "",
        "TENANT_QUOTAS",
        "Per-tenant byte quotas per tier; '*' is the entry for tenants not named; empty: none.",
        "tenant=gpu:SIZE,cpu:SIZE,disk:SIZE;*=cpu:SIZE",
    )
    max_pools_per_tenant: int = _opt(64, "MAX_POOLS_PER_TENANT", "Most pools (Attach + Register)"
                                     " one tenant holds at once (RESOURCE_EXHAUSTED beyond).",
                                     "1..4096")
    # --- event streams (server) ---------------------------------------------------------------
    max_watches: int = _opt(
        16, "MAX_WATCHES",
        "Most open WatchEvents streams per tenant (RESOURCE_EXHAUSTED beyond).", "1..1024",
    )
    # --- client sessions (leases) -----------------------------------------------------------
    lease_s: float = _opt(
        30.0,
        "LEASE_S",
        "Grace after a client's session socket closes before its pools are detached "
        "(seconds; keyed pages stay); 0 detaches at once.",
        "0..86400",
    )

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> OffloadConfig:
        """Build from ``KVCACHED_OFFLOAD_*`` variables; ``overrides`` (non-None) win."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            var = f.metadata["env"]
            if var in env and env[var] == "" and f.name in _EMPTY_TURNS_OFF:
                kwargs[f.name] = ""
            elif var in env and env[var] != "":
                kwargs[f.name] = _parse(f.name, var, env[var], f.default)
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**kwargs)
        rules.check_chain_disk(config, ENV_PREFIX)  # set by the operator: a contradiction
        # The daemon's pages are PAGE_SIZE; an engine built in-process may use smaller ones.
        rules.check_cpu_budget(config, ENV_PREFIX)
        return config

    def start_warnings(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """What ``kvtier serve`` warns about at start, one line each, nothing refused: unknown
        ``KVCACHED_OFFLOAD_*`` variables (typos; kvcached shares the prefix). (A disk budget
        beyond its filesystem is warned about once the disk directory passed its checks:
        ``server/preflight.py``.)"""
        env = os.environ if environ is None else environ
        known = [f.metadata["env"] for f in fields(OffloadConfig)]
        return rules.unknown_variables(env, known, ENV_PREFIX)

    @property
    def cpu_budget_bytes(self) -> int:
        return int(self.cpu_memory_gb * GIB)

    @property
    def gpu_budget_bytes(self) -> int:
        return int(self.gpu_memory_gb * GIB)

    @property
    def disk_budget_bytes(self) -> int:
        return int(self.disk_gb * GIB) if self.disk_path else 0

    @property
    def batch_bytes(self) -> int:
        return self.batch_mb * MIB

    def resolved_device(self) -> str:
        """The first (default) device: ``auto`` becomes ``cuda:0`` when torch sees a GPU, else
        ``cpu``; ``cuda`` and lists give their first GPU."""
        return self.resolved_devices()[0]

    def resolved_devices(self) -> tuple[str, ...]:
        """Every device the daemon serves, the default first: ``cuda`` is every GPU torch sees
        (``cuda:0`` when it sees none: the preflight reports that), a list is kept in its
        order; ``cpu`` and ``auto`` are one device."""
        if self.device == "cpu":
            return ("cpu",)
        if self.device not in ("auto", "cuda"):
            return tuple(self.device.split(","))
        import torch

        if self.device == "auto" and not torch.cuda.is_available():
            return ("cpu",)
        if self.device == "auto":
            return ("cuda:0",)
        return tuple(f"cuda:{i}" for i in range(max(1, torch.cuda.device_count())))

    def read_token(self) -> str:
        """The TCP token: the token file's first line if set, else ``token``."""
        if self.token_file:
            try:
                with open(self.token_file, encoding="utf-8") as fh:
                    return fh.readline().strip()
            except OSError as exc:
                raise ConfigError(
                    f"{ENV_PREFIX}TOKEN_FILE: cannot read {self.token_file!r}: {exc}"
                ) from exc
        return self.token


def parse_size(text: str) -> int:
    """``"64KiB"`` → 65536. Accepts plain bytes and K/M/G with optional ``i``/``B``."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _UNITS[unit]


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse(name: str, var: str, text: str, default: Any) -> Any:
    parser: Callable[[str], Any]
    if name == "page_size":
        parser = parse_size
    elif isinstance(default, bool):
        parser = _parse_bool
    elif isinstance(default, tuple):
        return tuple(p.strip() for p in text.split(",") if p.strip())
    else:
        parser = type(default)
    try:
        return parser(text.strip())
    except ValueError:
        accepted = next(f.metadata["accepted"] for f in fields(OffloadConfig) if f.name == name)
        raise ConfigError(f"{var}={text!r} is invalid; accepted: {accepted}") from None


def _fail(name: str, value: Any) -> None:
    f = next(f for f in fields(OffloadConfig) if f.name == name)
    raise ConfigError(
        f"{f.metadata['env']}={value!r} is invalid; accepted: {f.metadata['accepted']}"
    )


def _devices_ok(device: str) -> bool:
    """``auto``, ``cpu``, ``cuda``, or distinct ``cuda:N`` (comma-separated, at most 64)."""
    if device in ("auto", "cpu", "cuda"):
        return True
    names = device.split(",")
    return (
        len(names) <= 64
        and len(set(names)) == len(names)
        and all(re.fullmatch(r"cuda:\d{1,3}", n) is not None for n in names)
    )


MAX_CHAIN = 8  # levels of the tier chain, GPU and CPU included


def _chain_ok(chain: tuple[str, ...]) -> bool:
    """``gpu``, ``cpu``, then up to ``MAX_CHAIN - 2`` distinct medium names, top down (registered
    ones are checked when the engine opens them: ``kvtier.tiers.registry``)."""
    return (
        2 <= len(chain) <= MAX_CHAIN
        and chain[:2] == ("gpu", "cpu")
        and len(set(chain)) == len(chain)
        and all(re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name) is not None for name in chain)
    )


def _validate(c: OffloadConfig) -> None:
    for f in fields(c):
        value = getattr(c, f.name)
        expected = type(f.default) if f.default is not MISSING else object
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(c, f.name, float(value))
        elif expected is tuple and isinstance(value, list):
            object.__setattr__(c, f.name, tuple(value))
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            _fail(f.name, value)
        if expected is float and not math.isfinite(getattr(c, f.name)):
            _fail(f.name, value)  # inf or nan: no budget, wait or timeout is endless
    checks: list[tuple[str, bool]] = [
        ("cpu_memory_gb", c.cpu_memory_gb >= 0),
        ("gpu_memory_gb", c.gpu_memory_gb > 0),
        ("threshold", 0 < c.threshold <= 1),
        ("low_watermark", 0 <= c.low_watermark < c.threshold),
        ("page_size", 4 * KIB <= c.page_size <= 64 * MIB and c.page_size % (4 * KIB) == 0),
        ("device", _devices_ok(c.device)),
        ("disk_gb", c.disk_gb >= 0),
        ("disk_admission", c.disk_admission in ("always", "reused", "never")),
        ("disk_io_threads", 1 <= c.disk_io_threads <= 64),
        ("pinned_chunk_mb", 1 <= c.pinned_chunk_mb <= 4096),
        ("batch_mb", 1 <= c.batch_mb <= 4096),
        ("max_inflight_mb", c.max_inflight_mb >= c.batch_mb),
        ("restore_timeout_s", 0 < c.restore_timeout_s <= 86400),
        ("grace_s", 0 < c.grace_s <= 86400),
        ("lease_s", 0 <= c.lease_s <= 86400),
        ("max_message_mb", 1 <= c.max_message_mb <= 1024),
        ("keepalive_s", 1 <= c.keepalive_s <= 3600),
        ("calls_per_tenant", 4 <= c.calls_per_tenant <= 64),
        ("log_level", c.log_level in ("debug", "info", "warning", "error")),
        ("policy", bool(c.policy.strip())),
        ("max_pools_per_tenant", 1 <= c.max_pools_per_tenant <= 4096),
        ("max_watches", 1 <= c.max_watches <= 1024),
        ("remote_ttl_s", c.remote_ttl_s >= 0),
        ("remote_admission", c.remote_admission in ("always", "reused", "never")),
        ("remote_timeout_ms", 1 <= c.remote_timeout_ms <= 60000),
        ("remote_inflight_mb", 1 <= c.remote_inflight_mb <= 65536),
        ("tier_chain", _chain_ok(c.tier_chain)),
    ]
    for name, ok in checks:
        if not ok:
            _fail(name, getattr(c, name))
    rules.check_tenants(c, ENV_PREFIX)
    if c.disk_gb > 0 and not c.disk_path:
        raise ConfigError(f"{ENV_PREFIX}DISK_GB={c.disk_gb} needs {ENV_PREFIX}DISK_PATH to be set")
    rules.check_remote(c, ENV_PREFIX)
    for addr in c.listen:
        if not rules.listen_ok(addr):
            _fail("listen", addr)
    if c.metrics_addr and not rules.host_port_ok(c.metrics_addr):
        _fail("metrics_addr", c.metrics_addr)
    rules.check_listeners(c, ENV_PREFIX)


def describe() -> list[tuple[str, str, str, str]]:
    """(variable, default, accepted, meaning) for every setting: the README table's source."""
    rows = []
    for f in fields(OffloadConfig):
        default = f.default
        shown = (
            ",".join(default)
            if isinstance(default, tuple)
            else str(default).lower()
            if isinstance(default, bool)
            else str(default)
        )
        rows.append((f.metadata["env"], shown, f.metadata["accepted"], f.metadata["doc"]))
    return rows
