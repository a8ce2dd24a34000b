"""Payloads over the daemon's message limit are refused with a clear message, never cut."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier_daemon_fixture import daemon_env, start

from kvtier.errors import CapacityError


def test_oversized_request_is_rejected_clearly_and_the_daemon_keeps_serving(tmp_path: Path) -> None:
    d = start(tmp_path, env=daemon_env(KVCACHED_OFFLOAD_MAX_MESSAGE_MB="1"))
    try:
        with d.client("big") as c:
            att = c.attach(4)
            got = c.allocate(att, 1)
            assert got is not None
            keys = [i.to_bytes(8, "little") * 8 for i in range(40_000)]  # ~2.6 MB of keys
            with pytest.raises(CapacityError, match="larger than max"):
                c.store(att, keys, [got[0][1]] * len(keys))
            assert c.lookup([keys[0]]) == []  # nothing was stored, and it still answers
            assert c.store(att, keys[:1], [got[0][1]]) == 1
    finally:
        d.stop()
