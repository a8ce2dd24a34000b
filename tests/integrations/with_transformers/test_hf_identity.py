"""Whose KV a store reads: pages are shared only by stores of the same model (config and weights,
or a ``model_id`` the caller vouches for), of full attention everywhere, in the model's dtype."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, build_tiny_mistral, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, TierEngine  # noqa: E402
from kvtier.errors import InvalidArgument  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture
def engine() -> Iterator[TierEngine]:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=0.25, gpu_memory_gb=0.25, pinned_chunk_mb=1)
    with TierEngine(cfg) as eng:
        yield eng


def kv_of(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True).past_key_values


def generate(model, ids: list[int], cache=None) -> list[int]:
    out = model.generate(torch.tensor([ids]), past_key_values=cache, max_new_tokens=6,
                         do_sample=False, pad_token_id=3,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0].tolist()


def test_two_models_of_one_shape_do_not_share(daemon_factory) -> None:
    from kvtier.client import connect

    a, b = random_llama(SHAPE, seed=0), random_llama(SHAPE, seed=1)
    ids = random_tokens(40, 7, SHAPE.vocab)
    with connect(daemon_factory(cpu_gb=0.25), tenant="t") as client, \
            ConversationStore(client, model=a, block_size=BLOCK) as sa, \
            ConversationStore(client, model=b, block_size=BLOCK) as sb:
        assert sa.save(kv_of(a, ids), ids) == 2
        assert sa.lookup(ids) == 32
        assert sb.lookup(ids) == 0  # the other seed: nothing of a's is b's
        cache = sb.restore(ids)
        assert cache.restored_tokens == 0
        assert generate(b, ids, cache) == generate(b, ids)
        # The same weights in another instance (another process, a reload) do share.
        again = random_llama(SHAPE, seed=0)
        with ConversationStore(client, model=again, block_size=BLOCK) as sc:
            cache = sc.restore(ids)
            assert cache.restored_tokens == 32
            assert generate(again, ids, cache) == generate(again, ids)


def rope_variant(model, theta: float):
    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters = dict(cfg.rope_parameters, rope_theta=theta)
    other = type(model)(cfg).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("named", [False, True])
def test_same_weights_other_rope_do_not_share(engine, named: bool) -> None:
    a = random_llama(SHAPE, seed=0)
    b = rope_variant(a, 500.0)
    ids = random_tokens(40, 7, SHAPE.vocab)
    # By fingerprint, or by a model_id the caller gives both (the config still counts).
    kw = dict(model_id="my-llama", dtype=a.dtype, device="cpu") if named else {}
    with ConversationStore(engine, tenant="t", block_size=BLOCK,
                           **({"model_config": a.config, **kw} if named else {"model": a})) as sa, \
            ConversationStore(engine, tenant="t", block_size=BLOCK,
                              **({"model_config": b.config, **kw} if named else {"model": b})) \
            as sb:
        assert sa.save(kv_of(a, ids), ids) == 2
        assert sa.lookup(ids) == 32 and sb.lookup(ids) == 0
        assert generate(b, ids, sb.restore(ids)) == generate(b, ids)


def test_a_store_must_name_its_model(engine) -> None:
    model = random_llama(SHAPE, seed=0)
    with pytest.raises(InvalidArgument) as err:
        ConversationStore(engine, tenant="t", model_config=model.config, dtype=torch.float32,
                          device="cpu", block_size=BLOCK)
    assert err.value.field == "model_id"
    assert engine.pools("t") == []  # nothing attached by a refused store
    with ConversationStore(engine, tenant="t", model_config=model.config, dtype=torch.float32,
                           device="cpu", block_size=BLOCK, model_id="tiny-seed-0") as named:
        assert named.lookup(random_tokens(40, 7, SHAPE.vocab)) == 0


def test_sliding_window_models_are_refused(engine, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    mistral = AutoModelForCausalLM.from_pretrained(
        build_tiny_mistral(tmp_path / "mistral", SHAPE, window=24)).eval()
    with pytest.raises(InvalidArgument) as err:
        ConversationStore(engine, tenant="t", model=mistral, block_size=BLOCK)
    assert err.value.field == "model_config" and "sliding_window=24" in str(err.value)
    # Some layers sliding (layer_types) is refused too; full attention everywhere is not.
    mixed = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                        max_window_layers=1)
    assert "sliding_attention" in mixed.layer_types
    with pytest.raises(InvalidArgument) as err:
        ConversationStore(engine, tenant="t", model_config=mixed, dtype=torch.float32,
                          device="cpu", model_id="q", block_size=BLOCK)
    assert err.value.field == "model_config"
    full = copy.deepcopy(mistral.config)
    full.sliding_window = None
    ConversationStore(engine, tenant="t", model_config=full, dtype=torch.float32, device="cpu",
                      model_id="m", block_size=BLOCK).close()
    assert engine.pools("t") == []


def test_store_dtype_must_be_the_models(engine) -> None:
    fp32, bf16 = random_llama(SHAPE, seed=0), random_llama(SHAPE, seed=0, dtype="bfloat16")
    for model, dtype in ((fp32, torch.bfloat16), (bf16, torch.float32)):
        with pytest.raises(InvalidArgument) as err:
            ConversationStore(engine, tenant="t", model=model, dtype=dtype, block_size=BLOCK)
        assert err.value.field == "dtype"
    # Named by model_id, the model is not seen: the cache given to save is checked instead.
    ids = random_tokens(40, 7, SHAPE.vocab)
    with ConversationStore(engine, tenant="t", model_config=fp32.config, dtype=torch.bfloat16,
                           device="cpu", model_id="m", block_size=BLOCK) as store:
        with pytest.raises(InvalidArgument) as err:
            store.save(kv_of(fp32, ids), ids)
        assert err.value.field == "cache"
        assert store.lookup(ids) == 0
