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


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


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
