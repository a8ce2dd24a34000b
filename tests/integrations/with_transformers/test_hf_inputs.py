"""What a store takes from its caller: token ids as tensors (never remembered as views of the
caller's buffer), a batch of one as tokenizers return it, and clear refusals of bad layer
bounds and non-tensor buffers on every path (in-process, pool pages, through a daemon)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.client._blocks import KeyChains, chain_keys  # noqa: E402
from tiny_model import TinyShape, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, TierEngine  # noqa: E402
from kvtier.errors import InvalidArgument  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=0)


@pytest.fixture
def engine() -> Iterator[TierEngine]:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=0.25, gpu_memory_gb=0.25, pinned_chunk_mb=1)
    with TierEngine(cfg) as eng:
        yield eng


def kv_of(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids).reshape(1, -1), use_cache=True).past_key_values


def generate(model, ids: list[int], cache=None) -> list[int]:
    out = model.generate(torch.tensor([ids]), past_key_values=cache, max_new_tokens=6,
                         do_sample=False, pad_token_id=3,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0].tolist()


def test_a_reused_token_buffer_is_not_remembered(model, engine) -> None:
    system = random_tokens(BLOCK, 1, SHAPE.vocab)  # a first block both conversations share
    a = system + random_tokens(24, 2, SHAPE.vocab)
    b = system + random_tokens(24, 3, SHAPE.vocab)
    buf = torch.tensor(a)  # the caller's input buffer, reused in place for the next request
    with ConversationStore(engine, tenant="t", model=model, block_size=BLOCK) as store:
        assert store.save(kv_of(model, buf), buf) == 2
        buf.copy_(torch.tensor(b))
        cache = store.restore(buf)
        assert cache.restored_tokens == BLOCK  # b's first block only: its second was never saved
        assert generate(model, b, cache) == generate(model, b)


def test_key_chains_copy_tensor_ids() -> None:
    chains, buf = KeyChains(4), torch.arange(12)
    first = chains.keys(buf)
    buf[4:] += 100  # the caller's buffer, edited in place after the call
    assert chains.keys(buf) == chain_keys(buf.tolist(), 4) != first
    assert chains.keys(torch.arange(12)) == first


def test_a_batch_of_one_is_its_row(model, engine) -> None:
    ids = random_tokens(50, 3, SHAPE.vocab)
    input_ids = torch.tensor([ids])  # [1, 50], as a tokenizer returns
    with ConversationStore(engine, tenant="t", model=model, block_size=BLOCK) as store:
        assert store.save(kv_of(model, ids), input_ids) == 3
        assert store.lookup(input_ids) == store.lookup(ids) == 48
        cache = store.restore(input_ids)
        assert cache.restored_tokens == 48
        assert generate(model, ids, cache) == generate(model, ids)
        with pytest.raises(InvalidArgument) as err:
            store.restore(torch.tensor([ids, ids]))
        assert err.value.field == "token_ids"


@pytest.mark.parametrize("where", ["engine", "pool pages", "daemon"])
def test_bad_arguments_are_refused_on_every_path(model, engine, daemon_factory, where) -> None:
    from kvtier.client import connect

    ids = random_tokens(40, 3, SHAPE.vocab)
    kv = torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads, 128, SHAPE.head_dim)
    if where == "daemon":
        client = connect(daemon_factory(cpu_gb=0.25), tenant="t")
        store = ConversationStore(client, model=model, block_size=BLOCK)
    else:
        client = None
        store = ConversationStore(engine, tenant="t", model=model, block_size=BLOCK,
                                  keep_on_gpu=where == "pool pages", gpu_slots=8)
    try:
        assert store.save(kv_of(model, ids), ids) == 2
        for bounds in ([0, 3], [5, 1], [], [0, 1, 1, 2]):
            with pytest.raises(InvalidArgument) as err:
                store.restore_layered(kv, ids, bounds)
            assert err.value.field == "bounds"
        for bad in (None, [[1.0]]):
            with pytest.raises(InvalidArgument) as err:
                store.restore_into(bad, ids)  # type: ignore[arg-type]
            assert err.value.field == "kv"
        assert store.restore_into(kv, ids) == 32  # and nothing was spoiled by the refusals
        restore = store.restore_layered(kv, ids, [0, 1, 2])
        assert restore.tokens == 32
        restore.release()
    finally:
        store.close()
        if client is not None:
            client.close()
