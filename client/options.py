"""Channel settings shared by both clients."""

from __future__ import annotations

import os

from kvtier.config import MIB

MAX_MESSAGE_BYTES = 64 * MIB


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


TENANT_TOKEN_KEY = "kvtier-tenant-token"


def metadata(token: str | None, tenant_token: str | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata: the TCP bearer token and the tenant's credential, each when given."""
    out = (("authorization", f"Bearer {token}"),) if token else ()
    return (*out, (TENANT_TOKEN_KEY, tenant_token)) if tenant_token else out


def tenant_token_of(token: str | None, token_file: str | None) -> str | None:
    """The tenant credential: ``token``, else the first line of ``token_file`` (the daemon's
    tenants file format has one token per tenant; the client's file holds just its own)."""
    if token or not token_file:
        return token or None
    with open(token_file, encoding="utf-8") as fh:
        return fh.readline().strip() or None


def default_address() -> str:
    """The daemon's default unix socket (same rule as the daemon's default listener)."""
    env = os.environ
    if env.get("RUNTIME_DIRECTORY"):
        base = env["RUNTIME_DIRECTORY"].split(":")[0]
    elif env.get("XDG_RUNTIME_DIR"):
        base = os.path.join(env["XDG_RUNTIME_DIR"], "kvtier")
    else:
        base = f"/tmp/kvtier-{os.getuid()}"
    return f"unix://{os.path.join(base, 'kvtier.sock')}"
