"""``ConversationStore.restore_layered``: a borrowed prefix copied layer group by layer group into
a static buffer, each group waited for just before its layers run (``StagedPrefill``), on a real
engine (CPU mode; a CUDA test with streams and graphs) and through a real daemon."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, next_token, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, Tier, TierEngine  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402
from kvtier.integrations.transformers.staged import StagedPrefill  # noqa: E402
from kvtier.integrations.transformers.static import StaticPrefill  # noqa: E402
from kvtier.planner import LoadPlanner, PrefillModel, TierCost  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=4, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=5)


@pytest.fixture
def engine() -> Iterator[TierEngine]:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=0.25, gpu_memory_gb=0.25, pinned_chunk_mb=1)
    with TierEngine(cfg) as eng:
        yield eng


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, SHAPE.vocab)


def conversation(target, model, **kw) -> ConversationStore:
    return ConversationStore(target, model=model, dtype=model.dtype,
                             device=model.device, block_size=BLOCK, **kw)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_layered_restore_then_staged_prefill_equals_recompute(model, engine, groups) -> None:
    turn1, tail = tokens(75, 1), tokens(20, 2)
    src = StaticPrefill(model, 256, step=16)
    src.extend(turn1, 0)
    with conversation(engine, model, tenant="t") as store:
        assert store.save(src.kv, turn1) == 75 // BLOCK
        over = StagedPrefill(model, 256, step=16, groups=groups)
        over.kv.normal_()  # stale bytes everywhere: only the restored prefix may be read
        prompt = turn1 + tail
        waited: list[int] = []
        restore = store.restore_layered(over.kv, prompt, over.bounds)

        def before(g: int) -> None:
            waited.append(g)
            restore.wait(g)

        assert restore.tokens == 64
        got = over.first_token_staged(prompt, restore.tokens, before)
        restore.release()
        restore.release()  # idempotent
        assert waited == list(range(groups))
        assert got == next_token(model, prompt)
        assert torch.equal(over.kv[:, :, :, :64], src.kv[:, :, :, :64])
        assert store.counters.restored_from == {Tier.CPU: 4}


def test_restore_into_borrows_from_an_in_process_engine(model, engine) -> None:
    """``restore_into`` takes the borrowed path too: same bytes as the daemon-style load."""
    ids = tokens(70, 3)
    src = StaticPrefill(model, 128, step=16)
    src.extend(ids, 0)
    with conversation(engine, model, tenant="t") as store:
        store.save(src.kv, ids)
        assert store._lends()
        kv = torch.full_like(src.kv, float("nan"))
        assert store.restore_into(kv, [*ids, 1]) == 64
        assert torch.equal(kv[:, :, :, :64], src.kv[:, :, :, :64])
        assert torch.isnan(kv[:, :, :, 64:]).all()  # past the prefix: untouched


def test_the_plan_decides_what_is_borrowed(model, engine) -> None:
    ids = tokens(100, 4)
    src = StaticPrefill(model, 128, step=16)
    src.extend(ids, 0)
    slow = {Tier.CPU: TierCost(bytes_per_s=1.0, latency_s=0.0)}  # 1 B/s: never worth loading
    planner = LoadPlanner(BLOCK, 4096, PrefillModel(tokens_per_s=1e6), lambda: slow)
    with conversation(engine, model, tenant="t") as store:
        store.save(src.kv, ids)
        kv = torch.zeros_like(src.kv)
        restore = store.restore_layered(kv, ids, [0, 2, 4], planner=planner)
        assert restore.tokens == 0 and store.last_plan is not None
        assert store.last_plan.load == 0
        restore.release()
        assert not kv.any()


def test_layered_restore_checks_its_arguments(model, engine) -> None:
    with conversation(engine, model, tenant="t") as store:
        ids = tokens(40, 5)
        store.save(torch.randn(SHAPE.layers, 2, SHAPE.kv_heads, 64, SHAPE.head_dim), ids)
        kv = torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads, 64, SHAPE.head_dim)
        for bad in ([0, 4, 4], [1, 4], [0, 2], [0], [0, 5]):
            with pytest.raises(ValueError, match="bounds"):
                store.restore_layered(kv, ids, bad)
        with pytest.raises(ValueError, match="kv: need"):
            store.restore_layered(kv[:, :, :1], ids, [0, 4])
        assert store.counters.restored_tokens == 0
        # Refused calls returned every page: a later restore borrows and sees them all.
        restore = store.restore_layered(kv, ids, [0, 4])
        assert restore.tokens == 32
        restore.release()


def test_layered_restore_through_daemon_loads_whole(model, daemon_factory) -> None:
    """Through a daemon the pages can't be borrowed: the prefix is loaded whole, exactly."""
    from kvtier.client import connect

    address = daemon_factory(cpu_gb=0.25)
    ids, tail = tokens(80, 6), tokens(11, 7)
    src = StaticPrefill(model, 256, step=16)
    src.extend(ids, 0)
    with connect(address, tenant="t") as c, conversation(c, model) as store:
        assert store.save(src.kv, ids) == 5
        over = StagedPrefill(model, 256, step=16, groups=2)
        over.kv.normal_()
        restore = store.restore_layered(over.kv, ids + tail, over.bounds)
        assert restore.tokens == 80
        got = over.first_token_staged(ids + tail, 80, restore.wait)
        restore.release()
        assert got == next_token(model, ids + tail)
        assert torch.equal(over.kv[:, :, :, :80], src.kv[:, :, :, :80])


@pytest.mark.cuda
def test_layered_restore_on_cuda_with_graphs_equals_eager() -> None:
    """Copies on the copy stream, each stage graph after its group's event: same token and KV
    as an eager prefill over the whole restored prefix."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = random_llama(SHAPE, seed=5).cuda()
    cfg = OffloadConfig(device="cuda", cpu_memory_gb=0.25, gpu_memory_gb=0.25)
    ids, tail = tokens(200, 8), tokens(20, 9)
    with TierEngine(cfg) as eng, conversation(eng, model, tenant="t") as store:
        src = StaticPrefill(model, 512, step=32, graphs=False)
        src.extend(ids, 0)
        store.save(src.kv, ids)
        over = StagedPrefill(model, 512, step=32, groups=4, graphs=True)
        assert over.prepare_staged([192], [28]) == 1
        for _ in range(3):  # again and again: the staging and events are reused
            over.kv.normal_()
            restore = store.restore_layered(over.kv, ids + tail, over.bounds)
            got = over.first_token_staged(ids + tail, restore.tokens, restore.wait)
            restore.release()
            assert restore.tokens == 192
            assert store._copier is not None and store._copier.direct  # the 2-D DMA path
            assert got == next_token(model, ids + tail)
            eager = StaticPrefill(model, 512, step=32, graphs=False)
            eager.kv[:, :, :, :192] = src.kv[:, :, :, :192]
            assert eager.first_token(ids + tail, 192) == got
            torch.testing.assert_close(over.kv[:, :, :, :220], eager.kv[:, :, :, :220])


def test_a_restore_dropped_without_release_returns_the_pages(model, engine) -> None:
    import gc

    ids = tokens(70, 11)
    src = StaticPrefill(model, 128, step=16)
    src.extend(ids, 0)
    with conversation(engine, model, tenant="t") as store:
        store.save(src.kv, ids)
        restore = store.restore_layered(torch.zeros_like(src.kv), [*ids, 1], [0, 4])
        assert restore.tokens == 64
        c = engine._core
        with c.cond:
            assert int(c.table.protect.sum()) == 4
        del restore
        gc.collect()
        with c.cond:
            assert int(c.table.protect.sum()) == 0


@pytest.mark.cuda
def test_a_non_contiguous_buffer_is_restored_through_staging_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = random_llama(SHAPE, seed=5).cuda()
    cfg = OffloadConfig(device="cuda", cpu_memory_gb=0.25, gpu_memory_gb=0.25)
    ids = tokens(100, 12)
    with TierEngine(cfg) as eng, conversation(eng, model, tenant="t") as store:
        src = StaticPrefill(model, 256, step=32, graphs=False)
        src.extend(ids, 0)
        store.save(src.kv, ids)
        wide = torch.full((SHAPE.layers, 2, SHAPE.kv_heads, 512, SHAPE.head_dim), float("nan"),
                          device="cuda")
        kv = wide[:, :, :, :256]  # capacity 256 inside rows of 512: not contiguous
        restore = store.restore_layered(kv, [*ids, 1], [0, 2, 4])
        restore.wait_all()
        restore.release()
        assert restore.tokens == 96
        assert torch.equal(kv[:, :, :, :96], src.kv[:, :, :, :96])
        assert torch.isnan(wide[:, :, :, 96:]).all()
