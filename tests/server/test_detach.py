"""Detach while the pool's keyed copies are under way, on a real daemon (sealed memfds, a real
CPU tier full of another tenant's blocks): a stored key holds the pool's bytes or is a miss."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier.client import KVTierClient
from kvtier.client.ipc import SharedMemory
from kvtier_daemon_fixture import PAGE, Daemon, daemon_env

from kvtier.errors import NotFound

BLOCK = 1 << 20
N = 128  # blocks: the whole CPU tier


def registered(c: KVTierClient, fill: int) -> tuple[SharedMemory, object]:
    mem = SharedMemory(N * BLOCK)
    mem.tensor.fill_(fill)
    return mem, c.register([mem.tensor.view(N, BLOCK)], fds=[mem.fd])


def test_a_detach_during_a_store_never_stores_stale_bytes(
        spawn: Callable[..., Daemon]) -> None:
    """A Store's copies out of a registered pool ran after a Detach had closed the pool: they
    copied nothing and counted as done, so its keys held whatever their recycled CPU slots held
    before: here the victim's whole blocks, which the attacker then loaded as hits."""
    env = daemon_env()
    env.update(KVCACHED_OFFLOAD_BATCH_MB="64", KVCACHED_OFFLOAD_PINNED_CHUNK_MB="64",
               KVCACHED_OFFLOAD_MAX_INFLIGHT_MB="512")
    d = spawn(cpu_pages=N * BLOCK // PAGE, disk_pages=4 * N * BLOCK // PAGE, env=env)
    with d.client("victim") as v, d.client("attacker") as a:
        _, pool = registered(v, 0xBB)
        assert v.store(pool, [b"secret%d" % i for i in range(N)], list(range(N))) == N
        for trial in range(3):
            fill = 0x11 + trial
            _, mine = registered(a, fill)
            keys = [b"mine%d-%d" % (trial, i) for i in range(N)]
            stored: list[object] = []

            def store(mine: object = mine, keys: list[bytes] = keys,
                      out: list[object] = stored) -> None:
                try:
                    out.append(a.store(mine, keys, list(range(N))))
                except NotFound as exc:  # the Detach came first
                    out.append(exc)

            th = threading.Thread(target=store)
            th.start()
            a.detach(mine)
            th.join()
            mem, fresh = registered(a, 0)
            got = a.load(fresh, keys, list(range(N)))
            blocks = mem.tensor.view(N, BLOCK)[:got]
            assert bool((blocks == fill).all()), (
                f"trial {trial}: {got} blocks loaded, "
                f"{int((blocks == 0xBB).all(dim=1).sum())} of them the victim's")
            a.detach(fresh)
    assert "Traceback" not in d.output()
