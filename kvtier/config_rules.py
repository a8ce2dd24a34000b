"""The shape rules of settings that need more than a range: addresses, the tenant quotas and
the remote store's URL (``kvtier.config._validate`` applies them; each failure a
``ConfigError`` on one line naming the variable)."""

from __future__ import annotations

import re
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
    if not c.remote_secret_file:
        raise ConfigError(
            f"{prefix}REMOTE_URL needs {prefix}REMOTE_SECRET_FILE (the cluster-wide secret)"
        )
