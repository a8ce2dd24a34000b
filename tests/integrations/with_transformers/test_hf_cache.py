"""Restored KV equals recompute: greedy tokens equal, logits within float tolerance."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, random_llama  # noqa: E402

from kvtier import OffloadConfig, Tier, TierEngine  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore, KVLayout  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=3, hidden=64, heads=4, kv_heads=2)


def generate(model, ids: list[int], cache=None, n: int = 8) -> tuple[list[int], torch.Tensor]:
    """Greedy ``n`` new tokens and their logits."""
    out = model.generate(
        torch.tensor([ids]), past_key_values=cache, max_new_tokens=n, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=3,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    return out.sequences[0].tolist(), torch.stack(out.logits)


def conversation(model, store: ConversationStore, turns: list[list[int]],
                 after_save: Callable[[], None] | None = None) -> list[int]:
    """Run the turns with kvtier; each turn checks tokens and logits against full recompute."""
    history: list[int] = []
    restored = []
    for user in turns:
        prompt = history + user
        cache = store.restore(prompt)
        restored.append(cache.restored_tokens)
        seq, logits = generate(model, prompt, cache)
        ref_seq, ref_logits = generate(model, prompt)
        assert seq == ref_seq
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        store.save(cache, seq)
        if after_save is not None:
            after_save()
        history = seq
    return restored


def turns() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, SHAPE.vocab, (n,), generator=g).tolist() for n in (37, 21, 50)]


@pytest.fixture
def model():
    return random_llama(SHAPE, seed=0)


def engine(tmp_path: Path, *, cpu_gb: float, disk: bool) -> TierEngine:
    kw: dict = {}
    if disk:
        kw = dict(disk_path=str(tmp_path / "disk"), disk_gb=0.5, disk_admission="always")
    return TierEngine(OffloadConfig(device="cpu", cpu_memory_gb=cpu_gb, gpu_memory_gb=0.25,
                                    pinned_chunk_mb=1, **kw))


@pytest.fixture
def cpu_engine(tmp_path: Path) -> Iterator[TierEngine]:
    with engine(tmp_path, cpu_gb=0.25, disk=False) as eng:
        yield eng


def test_pack_round_trip() -> None:
    lay = KVLayout(layers=2, kv_heads=3, head_dim=8, block_size=4, dtype=torch.bfloat16)
    kv = torch.randn(2, 2, 3, 12, 8).to(torch.bfloat16)
    rows = lay.pack(kv)
    assert rows.shape == (3, lay.raw_bytes)
    assert torch.equal(lay.unpack(rows), kv)
    # block 1 of layer 1's values lives in row 1
    assert torch.equal(lay.unpack(rows[1:2])[1, 1], kv[1, 1, :, 4:8])


def test_restore_from_cpu_equals_recompute(model, cpu_engine: TierEngine) -> None:
    with ConversationStore(cpu_engine, tenant="t", model=model,
                           dtype=torch.float32, device="cpu", block_size=BLOCK) as store:
        restored = conversation(model, store, turns())
        assert restored[0] == 0
        # turn 2 restores turn 1's prompt+answer (45 tokens) -> 2 blocks; turn 3 more
        assert restored[1] == 32 and restored[2] == 64
        assert set(store.counters.restored_from) == {Tier.CPU}


def test_restore_from_disk_equals_recompute(model, tmp_path: Path) -> None:
    # 1 MiB of CPU pages: the stored blocks (24 KiB each) are pushed down to disk by later turns.
    with engine(tmp_path, cpu_gb=1 / 1024, disk=True) as eng, ConversationStore(
            eng, tenant="t", model=model, dtype=torch.float32, device="cpu",
            block_size=BLOCK) as store:
        filler = ConversationStore(eng, tenant="t", model=model,
                                   dtype=torch.float32, device="cpu", block_size=BLOCK,
                                   model_id="filler")
        history: list[int] = []
        for user in turns():
            prompt = history + user
            cache = store.restore(prompt)
            seq, logits = generate(model, prompt, cache)
            ref_seq, ref_logits = generate(model, prompt)
            assert seq == ref_seq
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            store.save(cache, seq)
            _push_down(model, filler)
            history = seq
        filler.close()
        assert store.counters.restored_from[Tier.DISK] > 0


def _push_down(model, filler: ConversationStore) -> None:
    """Store unrelated blocks until the CPU tier has demoted older pages to disk.

    A store into a full CPU tier stores what fits (the engine demotes in the background), so
    keep saving the same filler conversation until all of it is stored.
    """
    g = torch.Generator().manual_seed(filler.counters.stored_blocks)
    ids = torch.randint(4, SHAPE.vocab, (BLOCK * 120 + 1,), generator=g).tolist()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    deadline = time.monotonic() + 30
    while filler.lookup([*ids, 0]) < BLOCK * 120 and time.monotonic() < deadline:
        filler.save(out.past_key_values, ids)
        time.sleep(0.02)


def test_restore_through_daemon(model, daemon_factory) -> None:
    from kvtier.client import connect

    address = daemon_factory(cpu_gb=0.25)
    with connect(address, tenant="t") as client, ConversationStore(
            client, model=model, dtype=torch.float32, device="cpu",
            block_size=BLOCK) as store:
        restored = conversation(model, store, turns())
        assert restored == [0, 32, 64]
        assert set(store.counters.restored_from) == {Tier.CPU}


def test_tenants_do_not_share(model, cpu_engine: TierEngine) -> None:
    kw = dict(model=model, dtype=torch.float32, device="cpu", block_size=BLOCK)
    with ConversationStore(cpu_engine, tenant="a", **kw) as a, \
            ConversationStore(cpu_engine, tenant="b", **kw) as b:
        ids = turns()[2]
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
        assert a.save(out.past_key_values, ids) == 3
        assert a.lookup(ids) == 48 and b.lookup(ids) == 0


# --- keep_on_gpu: blocks as pool pages, restored from whichever tier the engine put them on -----

def pool_store(eng: TierEngine, model, **kw) -> ConversationStore:
    return ConversationStore(eng, tenant="t", model=model, dtype=torch.float32,
                             device="cpu", block_size=BLOCK, keep_on_gpu=True, gpu_slots=16,
                             **kw)


def tiers_of(eng: TierEngine, store: ConversationStore) -> list[Tier | None]:
    return [eng.page_info(store.pool_id, p).tier for p in store.page_ids()]


def offload_all(eng: TierEngine, store: ConversationStore) -> None:
    eng.offload(store.pool_id, store.page_ids())
    assert eng.wait_idle(30)


def test_pool_pages_restore_from_gpu(model, cpu_engine: TierEngine) -> None:
    with pool_store(cpu_engine, model) as store:
        seen: list[list[Tier | None]] = []
        restored = conversation(model, store, turns(),
                                after_save=lambda: seen.append(tiers_of(cpu_engine, store)))
        assert restored == [0, 32, 64]
        assert seen == [[Tier.GPU] * 2, [Tier.GPU] * 4, [Tier.GPU] * 8]
        assert store.counters.restored_from == Counter({Tier.GPU: 6})
        assert cpu_engine.stats().keyed_pages == 0  # pool pages only, no keyed copies


def test_pool_pages_restore_from_cpu(model, cpu_engine: TierEngine) -> None:
    with pool_store(cpu_engine, model) as store:
        def after_save() -> None:
            offload_all(cpu_engine, store)
            assert set(tiers_of(cpu_engine, store)) == {Tier.CPU}

        restored = conversation(model, store, turns(), after_save=after_save)
        assert restored == [0, 32, 64]
        assert store.counters.restored_from == Counter({Tier.CPU: 6})


def push_down(eng: TierEngine, store: ConversationStore) -> Callable[[], None]:
    """After each save: offload the store's pages, then 128 filler pages of the same size, so
    the CPU tier (1 MiB, 12 KiB pages) demotes the conversation's older pages."""
    filler = eng.attach("t", 32, eng.pool(store.pool_id).page_size)

    def after_save() -> None:
        offload_all(eng, store)
        for _ in range(4):
            got = eng.allocate(filler.pool_id, 32)
            assert got is not None
            ids = [p for p, _ in got]
            eng.release(filler.pool_id, ids)
            eng.offload(filler.pool_id, ids)
            assert eng.wait_idle(30)

    return after_save


def test_pool_pages_restore_from_disk(model, tmp_path: Path) -> None:
    with engine(tmp_path, cpu_gb=1 / 1024, disk=True) as eng, pool_store(eng, model) as store:
        restored = conversation(model, store, turns(), after_save=push_down(eng, store))
        assert restored == [0, 32, 64]
        assert store.counters.restored_from[Tier.DISK] > 0
        assert sum(store.counters.restored_from.values()) == 6


def test_pool_pages_dropped_are_recomputed(model, tmp_path: Path) -> None:
    # No disk: the pushed-down pages are dropped; restore stops there and forgets them.
    with engine(tmp_path, cpu_gb=1 / 1024, disk=False) as eng, pool_store(eng, model) as store:
        restored = conversation(model, store, turns(), after_save=push_down(eng, store))
        assert restored == [0, 0, 0]
        assert store.counters.restored_from == Counter()
        assert len(store.page_ids()) == 8  # lost pages forgotten; each turn saved them again


def test_pool_pages_through_daemon(model, daemon_factory) -> None:
    from kvtier.client import connect

    address = daemon_factory(cpu_gb=0.25)
    with connect(address, tenant="t") as client, ConversationStore(
            client, model=model, dtype=torch.float32, device="cpu",
            block_size=BLOCK, keep_on_gpu=True, gpu_slots=16) as store:
        restored = conversation(model, store, turns())
        assert restored == [0, 32, 64]
        assert len(store.page_ids()) == 8
        assert store.counters.restored_from == Counter({Tier.GPU: 6})  # through PageTiers
