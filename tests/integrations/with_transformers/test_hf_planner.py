"""``restore_into`` with a cost-aware planner, on a real engine: blocks cheaper to recompute are
left to the prefill (the buffer keeps its bytes there), blocks cheaper to load are loaded exactly,
and the first token equals a full recompute either way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, next_token, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, Tier, TierEngine  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402
from kvtier.integrations.transformers.layout import KVLayout  # noqa: E402
from kvtier.integrations.transformers.static import StaticPrefill  # noqa: E402
from kvtier.planner import LoadPlanner, PrefillModel, TierCost  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=1)


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, SHAPE.vocab)


@pytest.fixture
def stores(model) -> Iterator[tuple[ConversationStore, ConversationStore]]:
    """Two stores (two staging pools) of one tenant on one engine."""
    kw = dict(model=model, dtype=torch.float32, device="cpu", block_size=BLOCK,
              staging_slots=8, tenant="t")
    cfg = OffloadConfig(device="cpu", gpu_memory_gb=0.01, cpu_memory_gb=0.25, pinned_chunk_mb=1)
    with (
        TierEngine(cfg) as eng,
        ConversationStore(eng, **kw) as a,
        ConversationStore(eng, **kw) as b,
    ):
        yield a, b


def planner(store: ConversationStore, tokens_per_s: float) -> LoadPlanner:
    cost = TierCost(1e9, 0.0)
    return LoadPlanner(BLOCK, store.layout.raw_bytes, PrefillModel(tokens_per_s),
                       lambda: {Tier.CPU: cost, Tier.DISK: cost})


def test_the_plan_decides_what_restore_into_loads(model, stores) -> None:
    a, b = stores
    sp = StaticPrefill(model, 256, step=16)
    turn = tokens(70, 3)
    sp.extend(turn, 0)
    assert a.save(sp.kv, turn) == 4
    prompt = turn + tokens(9, 4)

    fresh = StaticPrefill(model, 256, step=16)
    fresh.kv.fill_(7.0)
    # A prefill far faster than the load: nothing loaded, the buffer untouched.
    assert b.restore_into(fresh.kv, prompt, planner=planner(b, 1e15)) == 0
    assert b.last_plan is not None and b.last_plan.choice == "recompute"
    assert b.last_plan.blocks == 4 and bool((fresh.kv == 7.0).all())
    assert fresh.first_token(prompt, 0) == next_token(model, prompt)

    # A prefill far slower: every stored block loaded, byte for byte.
    fresh.kv.fill_(7.0)
    n = b.restore_into(fresh.kv, prompt, planner=planner(b, 1.0))
    assert n == 64 and b.last_plan is not None and b.last_plan.choice == "load"
    torch.testing.assert_close(fresh.kv[:, :, :, :n], sp.kv[:, :, :, :n], rtol=0, atol=0)
    assert bool((fresh.kv[:, :, :, n:] == 7.0).all())
    assert fresh.first_token(prompt, n) == next_token(model, prompt)

    # No planner: as before, the whole stored prefix, and no plan recorded.
    assert b.restore_into(fresh.kv, prompt) == 64 and b.last_plan is None


def test_a_planned_load_from_disk_stops_when_waiting_does_not_pay(model, tmp_path) -> None:
    # A 4-block CPU tier over a disk: of 6 stored blocks the oldest went to disk; the prompt
    # shares the first 4 (2 on disk, then 2 in the CPU tier, which has room). The planner
    # believes the disk instant and the prefill near free, so waiting for a disk read never
    # pays: the load stops at the blocks already in the CPU tier (none: the prefix starts on
    # disk), and the prefill computes the rest exactly.
    page = KVLayout.of(model.config, BLOCK, torch.float32).raw_bytes
    cfg = OffloadConfig(device="cpu", gpu_memory_gb=0.01, pinned_chunk_mb=1,
                        cpu_memory_gb=4 * page / 2**30, disk_path=str(tmp_path / "disk"),
                        disk_gb=0.01, disk_admission="always")
    kw = dict(model=model, dtype=torch.float32, device="cpu", block_size=BLOCK,
              staging_slots=8, tenant="t")
    with (
        TierEngine(cfg) as eng,
        ConversationStore(eng, **kw) as store,
        ConversationStore(eng, patient=False, **kw) as waits,
    ):
        sp = StaticPrefill(model, 256, step=16)
        turn = tokens(6 * BLOCK + 5, 5)
        sp.extend(turn, 0)
        assert store.save(sp.kv, turn) == 6
        prompt = turn[: 4 * BLOCK] + tokens(7, 6)
        tiers = eng.lookup("t", store._restorable_keys(prompt))
        assert tiers == [Tier.DISK, Tier.DISK, Tier.CPU, Tier.CPU]
        instant = TierCost(1e18, 0.0)
        eager = LoadPlanner(BLOCK, page, PrefillModel(1e9),
                            lambda: {Tier.CPU: instant, Tier.DISK: instant})
        fresh = StaticPrefill(model, 256, step=16)
        fresh.kv.fill_(7.0)
        assert store.restore_into(fresh.kv, prompt, planner=eager) == 0
        assert store.last_plan is not None and store.last_plan.choice == "load"
        assert store.last_cut and bool((fresh.kv == 7.0).all())
        assert fresh.first_token(prompt, 0) == next_token(model, prompt)
        # The same plan through a store made ``patient=False`` waits for the disk: every block.
        n = waits.restore_into(fresh.kv, prompt, planner=eager)
        assert n == 4 * BLOCK and not waits.last_cut
        torch.testing.assert_close(fresh.kv[:, :, :, :n], sp.kv[:, :, :, :n], rtol=0, atol=0)
