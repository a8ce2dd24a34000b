"""Static KV buffers: ``restore_into``, ``save`` of a buffer, ``StaticPrefill`` vs recompute."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, next_token, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, Tier, TierEngine  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402
from kvtier.integrations.transformers.static import StaticPrefill  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=3, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=0)


@pytest.fixture
def store(model, tmp_path: Path) -> Iterator[ConversationStore]:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=0.25, gpu_memory_gb=0.25, pinned_chunk_mb=1)
    with TierEngine(cfg) as eng, ConversationStore(
            eng, tenant="t", model=model, dtype=torch.float32, device="cpu",
            block_size=BLOCK) as st:
        yield st


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, SHAPE.vocab)


def reference_kv(model, ids: list[int]) -> torch.Tensor:
    """``[layers, 2, kv_heads, len, head_dim]`` from a plain forward with a DynamicCache."""
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    return torch.stack([torch.stack([lay.keys[0], lay.values[0]]) for lay in cache.layers])


MODES = pytest.mark.parametrize("kv_step", [None, 64], ids=["exact", "masked"])


@MODES
def test_prefill_from_empty_equals_recompute(model, kv_step) -> None:
    sp = StaticPrefill(model, 256, step=16, kv_step=kv_step)
    ids = tokens(45, 1)
    assert sp.first_token(ids, 0) == next_token(model, ids)
    torch.testing.assert_close(sp.kv[:, :, :, :45], reference_kv(model, ids),
                               rtol=1e-5, atol=1e-5)


@MODES
def test_extend_then_first_token_equals_recompute(model, kv_step) -> None:
    sp = StaticPrefill(model, 256, step=16, kv_step=kv_step)
    a, b, c = tokens(30, 2), tokens(40, 3), tokens(7, 4)
    sp.extend(a, 0)
    sp.extend(a + b, len(a))  # padding of the first call is overwritten by the second
    assert sp.first_token(a + b + c, len(a) + len(b)) == next_token(model, a + b + c)


@MODES
def test_restore_into_then_prefill_equals_recompute(model, store: ConversationStore,
                                                     kv_step) -> None:
    sp = StaticPrefill(model, 256, step=16, kv_step=kv_step)
    turn1 = tokens(50, 5)
    sp.extend(turn1, 0)
    assert store.save(sp.kv, turn1) == 50 // BLOCK

    other = StaticPrefill(model, 256, step=16, kv_step=kv_step)
    other.kv.normal_()  # stale bytes everywhere: only the restored prefix may be read
    prompt = turn1 + tokens(20, 6)
    n = store.restore_into(other.kv, prompt)
    assert n == 48
    torch.testing.assert_close(other.kv[:, :, :, :n], sp.kv[:, :, :, :n], rtol=0, atol=0)
    assert other.first_token(prompt, n) == next_token(model, prompt)
    assert store.counters.restored_from == {Tier.CPU: 3}


def test_restore_into_and_restore_agree(model, store: ConversationStore) -> None:
    ids = tokens(70, 7)
    cache = store.restore(ids)
    assert cache.restored_tokens == 0
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    store.save(cache, ids)
    kv = torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads, 128, SHAPE.head_dim)
    n = store.restore_into(kv, [*ids, 1])
    restored = store.restore([*ids, 1])
    assert n == restored.restored_tokens == 64
    for i, lay in enumerate(restored.layers):
        assert torch.equal(kv[i, 0, :, :n], lay.keys[0])
        assert torch.equal(kv[i, 1, :, :n], lay.values[0])


def test_restore_into_stops_at_capacity(model, store: ConversationStore) -> None:
    ids = tokens(100, 8)
    store.save(reference_kv(model, ids), ids)
    kv = torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads, 40, SHAPE.head_dim)
    assert store.restore_into(kv, ids) == 32  # two whole blocks fit in 40 positions


def test_restore_into_checks_the_buffer(store: ConversationStore) -> None:
    bad = [torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads + 1, 64, SHAPE.head_dim),
           torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads, 64, SHAPE.head_dim, dtype=torch.float16),
           torch.zeros(2, SHAPE.kv_heads, 64, SHAPE.head_dim)]
    for kv in bad:
        with pytest.raises(ValueError, match="kv: need"):
            store.restore_into(kv, tokens(40, 9))
    assert store.counters.restored_tokens == 0


def test_prefill_rejects_bad_positions(model) -> None:
    sp = StaticPrefill(model, 64, step=16, kv_step=64)
    with pytest.raises(ValueError, match="start"):
        sp.first_token(tokens(10, 1), 10)
    with pytest.raises(ValueError, match="capacity"):
        sp.first_token(tokens(70, 1), 0)
    assert sp.first_token(tokens(60, 1), 0) == next_token(model, tokens(60, 1))  # pads to 64
    for bad in (dict(capacity=0), dict(capacity=64, step=0), dict(capacity=64, kv_step=-1)):
        with pytest.raises(ValueError, match="must be positive"):
            StaticPrefill(model, **bad)


@pytest.mark.cuda
@MODES
def test_graph_replay_equals_eager_on_cuda(kv_step) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = random_llama(SHAPE, seed=0).cuda()
    ids = tokens(200, 10)
    graph = StaticPrefill(model, 512, step=32, kv_step=kv_step, graphs=True)
    eager = StaticPrefill(model, 512, step=32, kv_step=kv_step, graphs=False)
    for sp in (graph, eager):
        sp.extend(ids[:150], 0)
    assert graph.prepare([150, 170], [20]) == 2
    for start, end in ((150, 170), (170, 190), (190, 200)):  # new positions and tokens
        got = graph.first_token(ids[:end], start)
        assert got == eager.first_token(ids[:end], start)
        assert got == next_token(model, ids[:end])
    torch.testing.assert_close(graph.kv[:, :, :, :200], eager.kv[:, :, :, :200])
    captured = [b.graph is not None for b in graph._buckets.values()]
    assert captured.count(True) == (3 if kv_step is None else 2)  # 150+32 and 170+32 share
