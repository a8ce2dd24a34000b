"""The shape rules of settings that need more than a range: addresses, the tenant quotas, the
remote store's URL, settings that contradict each other (``kvtier.config._validate`` and
``from_env`` apply them; each failure a ``ConfigError`` on one line naming the variable), and
the start-up warnings (``start_warnings``: settings that work but are likely not meant).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from kvtier.errors import ConfigError

_HOST_PORT = re.compile(r"\[?[\w.:-]*\]?:(\d{1,5})")


def host_port_ok(addr: str) -> bool:
    """``host:port`` (``[v6]:port``, an empty host: every interface) with a port in 0..65535."""
    m = _HOST_PORT.fullmatch(addr)
    return m is not None and int(m.group(1)) <= 65535


def listen_ok(addr: str) -> bool:
    """``unix:///absolute/path`` or ``host:port``."""
    if addr.startswith("unix://"):
        path = addr[len("unix://"):]
        return path.startswith("/") and not path.endswith("/")
    return host_port_ok(addr)


_ANY_HOST = ("", "0.0.0.0", "::", "[::]")


def _overlap(a: str, b: str) -> bool:
    """Two ``host:port`` listeners that can't both be bound: one fixed port, and the same host
    or either on every interface."""
    host_a, _, port_a = a.rpartition(":")
    host_b, _, port_b = b.rpartition(":")
    return port_a == port_b != "0" and (host_a == host_b or host_a in _ANY_HOST
                                        or host_b in _ANY_HOST)


def check_listeners(c: Any, prefix: str) -> None:
    """No listener given twice (a unix path twice was refused as in use by this very
    daemon), and the metrics port not one of the TCP listeners' (that failed only after the
    engine had started)."""
    seen: set[str] = set()
    for addr in c.listen:
        if addr in seen:
            raise ConfigError(f"{prefix}LISTEN: {addr} is listed twice")
        seen.add(addr)
    tcp = [a for a in c.listen if not a.startswith("unix://")]
    for addr in tcp:
        if c.metrics_addr and _overlap(addr, c.metrics_addr):
            raise ConfigError(f"{prefix}METRICS_ADDR={c.metrics_addr} is the port of "
                              f"{prefix}LISTEN's {addr}")


def check_tenants(c: Any, prefix: str) -> None:
    from kvtier.tenancy.quotas import parse_quotas

    try:
        parse_quotas(c.tenant_quotas)
    except ValueError as exc:
        raise ConfigError(
            f"{prefix}TENANT_QUOTAS={c.tenant_quotas!r} is invalid ({exc}); accepted: "
            "tenant=gpu:SIZE,cpu:SIZE,disk:SIZE;*=cpu:SIZE (SIZE like 512MiB, 2GiB)"
        ) from None


def check_remote(c: Any, prefix: str) -> None:
    """The remote URL's shape (no inline password: it belongs in the password file)."""
    if not c.remote_url:
        return
    m = re.fullmatch(r"(rediss?)://(?:([^:@/]*)(:[^@/]*)?@)?([\w.-]+|\[[\w:.]+\]):(\d{1,5})(/\d+)?"
                     r"(\?.*)?", c.remote_url)
    if m is None:  # shown without any user:password part
        shown = re.sub(r"//[^@/]*@", "//***@", c.remote_url)
        raise ConfigError(
            f"{prefix}REMOTE_URL={shown!r} is invalid; accepted: "
            "redis://[user@]host:port[/db]|rediss://..."
        )
    if m.group(3):
        raise ConfigError(
            f"{prefix}REMOTE_URL must not carry a password; put it in "
            f"{prefix}REMOTE_PASSWORD_FILE"
        )
    if not 1 <= int(m.group(5)) <= 65535:
        raise ConfigError(
            f"{prefix}REMOTE_URL={c.remote_url!r} is invalid (port {int(m.group(5))}); "
            "accepted: redis://[user@]host:port[/db]|rediss://..., a port in 1..65535"
        )
    if not c.remote_secret_file:
        raise ConfigError(
            f"{prefix}REMOTE_URL needs {prefix}REMOTE_SECRET_FILE (the cluster-wide secret)"
        )


def check_cpu_budget(c: Any, prefix: str) -> None:
    """With offload on, the CPU tier holds at least one page: a smaller budget holds none, and
    every allocate on a full pool would wait ``RESTORE_TIMEOUT_S`` for room that never comes."""
    if c.enabled and c.cpu_budget_bytes < c.page_size:
        raise ConfigError(
            f"{prefix}CPU_MEMORY_GB={c.cpu_memory_gb!r} is smaller than one page "
            f"({prefix}PAGE_SIZE={c.page_size}); accepted: >= {c.page_size / (1 << 30):.6g} "
            f"(or {prefix}ENABLED=false)"
        )


def check_chain_disk(c: Any, prefix: str) -> None:
    """A disk tier set on (``DISK_PATH`` and ``DISK_GB``) with a chain that leaves disk out
    would be silently unused: the two settings contradict each other."""
    if c.disk_budget_bytes and "disk" not in c.tier_chain:
        raise ConfigError(
            f"{prefix}TIER_CHAIN={','.join(c.tier_chain)!r} leaves out disk, but "
            f"{prefix}DISK_PATH/{prefix}DISK_GB set a disk tier; add disk to the chain "
            f"or unset {prefix}DISK_GB"
        )


def unknown_variables(environ: Mapping[str, str], known: Iterable[str], prefix: str) -> list[str]:
    """One warning per ``<prefix>*`` variable that is no setting (a typo), with the closest
    setting's name when one is close."""
    names = sorted(k.removeprefix(prefix) for k in known)  # compared without the prefix
    out = []
    for var in sorted(v for v in environ if v.startswith(prefix)):
        if var.removeprefix(prefix) in names:
            continue
        close = difflib.get_close_matches(var.removeprefix(prefix), names, n=1, cutoff=0.6)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        out.append(f"{var} is not a kvtier setting and is ignored{hint}")
    return out


def disk_size_warning(c: Any, prefix: str) -> str | None:
    """The disk tier's file grows as pages arrive (it is never preallocated whole), so a budget
    beyond the filesystem starts fine and fails later with ``disk_full`` drops: said at start."""
    if not c.disk_budget_bytes:
        return None
    path = os.path.abspath(c.disk_path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # the directory is created at start: its filesystem
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    size = st.f_blocks * st.f_frsize
    if c.disk_budget_bytes <= size or not size:  # a filesystem that reports no size: no claim
        return None
    return (f"{prefix}DISK_GB={c.disk_gb!r} is more than the whole filesystem under "
            f"{c.disk_path} ({size / (1 << 30):.1f} GiB): the disk tier will run out of space "
            "before its budget (disk_full drops)")

