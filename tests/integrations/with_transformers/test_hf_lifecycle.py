"""A store's pools over its life, against a real daemon: a failed load or store gives up the
staging pool it copied through (a copy may still land there), a restarted daemon neither breaks
the store for good nor its ``close``, and a store dropped without ``close`` detaches anyway."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from integration_daemon import start_daemon, stop_daemon  # noqa: E402
from tiny_model import TinyShape, random_llama, random_tokens  # noqa: E402

from kvtier.errors import FailedPrecondition  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=2, hidden=64, heads=4, kv_heads=2)


def kv_of(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True).past_key_values


def same_kv(cache, ref, n: int) -> bool:
    return all(torch.equal(c.keys[0], r.keys[0, :, :n])
               and torch.equal(c.values[0], r.values[0, :, :n])
               for c, r in zip(cache.layers, ref.layers, strict=True))


def test_failed_calls_replace_staging_across_a_restart(tmp_path: Path) -> None:
    from kvtier.client import connect

    model = random_llama(SHAPE, seed=0)
    sock = tmp_path / "d.sock"
    a, b = random_tokens(50, 1, SHAPE.vocab), random_tokens(50, 2, SHAPE.vocab)
    ka, kb = kv_of(model, a), kv_of(model, b)
    proc = start_daemon(sock, cpu_gb=0.25)
    try:
        with connect(f"unix://{sock}", tenant="t") as client, \
                ConversationStore(client, model=model, block_size=BLOCK) as store:
            assert store.save(ka, a) == 3
            stop_daemon(proc)
            proc = start_daemon(sock, cpu_gb=0.25)  # it knows neither the pool nor the blocks
            with pytest.raises(FailedPrecondition):
                store.save(kb, b)  # the store into the old staging pool fails ...
            assert store.staging_replaced == 1
            assert store.save(kb, b) == 3  # ... and the next one copies through a fresh pool
            cache = store.restore(b)
            assert cache.restored_tokens == 48 and same_kv(cache, kb, 48)
            assert store.restore(a).restored_tokens == 0
        store.close()  # again, after the ``with``: nothing to do
    finally:
        stop_daemon(proc)


def test_failed_load_replaces_staging(tmp_path: Path) -> None:
    from kvtier.client import connect

    model = random_llama(SHAPE, seed=0)
    sock, disk = tmp_path / "d.sock", tmp_path / "disk"
    a = random_tokens(50, 1, SHAPE.vocab)
    ka = kv_of(model, a)
    proc = start_daemon(sock, cpu_gb=0.25, disk=disk)
    try:
        with connect(f"unix://{sock}", tenant="t") as client, \
                ConversationStore(client, model=model, block_size=BLOCK) as store:
            assert store.save(ka, a, wait_s=5) == 3
            stop_daemon(proc)
            proc = start_daemon(sock, cpu_gb=0.25, disk=disk)  # the blocks are on its disk
            assert store.lookup(a) == 48
            with pytest.raises(FailedPrecondition):
                store.restore(a)  # a load into a pool the daemon no longer knows
            assert store.staging_replaced == 1
            cache = store.restore(a)
            assert cache.restored_tokens == 48 and same_kv(cache, ka, 48)
    finally:
        stop_daemon(proc)


def test_dropped_stores_detach(daemon_factory) -> None:
    from kvtier.client import connect

    model = random_llama(SHAPE, seed=0)
    with connect(daemon_factory(cpu_gb=0.25), tenant="t") as client:
        # Two pools a store: more than a tenant may hold at once, each store dropped unclosed.
        with pytest.warns(ResourceWarning, match="without close"):
            for _ in range(40):
                ConversationStore(client, model=model, block_size=BLOCK, keep_on_gpu=True,
                                  gpu_slots=4)
            gc.collect()
        with ConversationStore(client, model=model, block_size=BLOCK) as store:
            ids = random_tokens(40, 3, SHAPE.vocab)
            assert store.save(kv_of(model, ids), ids) == 2
