"""Restore overlapped with the prefill: ``StagedPrefill`` and ``LayerGroupStore`` on a real engine.

The staged prefill must give the same tokens and KV as the unstaged one, and a prefix restored
group by group (each group's load just before its layers run) the same as one restored whole
with ``restore_into``, from stale buffers, with and without a planner."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, next_token, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, Tier, TierEngine  # noqa: E402
from kvtier.integrations.transformers.cache import ConversationStore  # noqa: E402
from kvtier.integrations.transformers.overlap import LayerGroupStore  # noqa: E402
from kvtier.integrations.transformers.staged import StagedPrefill  # noqa: E402
from kvtier.integrations.transformers.static import StaticPrefill  # noqa: E402
from kvtier.planner import LoadPlanner, PrefillModel, TierCost  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=4, hidden=64, heads=4, kv_heads=2)
MODES = pytest.mark.parametrize("kv_step", [None, 64], ids=["exact", "masked"])


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=3)


@pytest.fixture
def engine() -> Iterator[TierEngine]:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=0.25, gpu_memory_gb=0.25, pinned_chunk_mb=1)
    with TierEngine(cfg) as eng:
        yield eng


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, SHAPE.vocab)


def group_store(eng: TierEngine, model, bounds: list[int]) -> LayerGroupStore:
    return LayerGroupStore(eng, bounds=bounds, model=model, dtype=model.dtype,
                           device=model.device, tenant="t", block_size=BLOCK)


@MODES
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_staged_equals_unstaged(model, kv_step, groups) -> None:
    staged = StagedPrefill(model, 256, step=16, kv_step=kv_step, groups=groups)
    plain = StaticPrefill(model, 256, step=16, kv_step=kv_step)
    a, b = tokens(70, 1), tokens(9, 2)
    for sp in (staged, plain):
        sp.extend(a, 0)
    seen: list[int] = []
    got = staged.first_token_staged(a + b, 64, seen.append)
    assert seen == list(range(groups))
    assert got == plain.first_token(a + b, 64) == next_token(model, a + b)
    assert torch.equal(staged.kv[:, :, :, :79], plain.kv[:, :, :, :79])


def test_staged_checks_its_arguments(model) -> None:
    for bad in (0, SHAPE.layers + 1):
        with pytest.raises(ValueError, match="groups"):
            StagedPrefill(model, 64, groups=bad)
    sp = StagedPrefill(model, 64, step=16, groups=2)
    with pytest.raises(ValueError, match="start"):
        sp.first_token_staged(tokens(10, 1), 10, lambda g: None)
    with pytest.raises(ValueError, match="capacity"):
        sp.first_token_staged(tokens(70, 1), 0, lambda g: None)


@MODES
def test_overlapped_restore_equals_whole_restore(model, engine, kv_step) -> None:
    """Turn 2 restored group by group into stale buffers == restored whole == recomputed."""
    turn1, prompt_tail = tokens(75, 4), tokens(20, 5)
    src = StagedPrefill(model, 256, step=16, kv_step=kv_step, groups=2)
    src.extend(turn1, 0)
    with group_store(engine, model, src.bounds) as groups, ConversationStore(
            engine, tenant="t", model=model, dtype=model.dtype, device="cpu",
            block_size=BLOCK) as whole:
        assert groups.save(src.kv, turn1) == 75 // BLOCK
        assert whole.save(src.kv, turn1) == 75 // BLOCK
        prompt = turn1 + prompt_tail
        assert groups.lookup(prompt) == 64
        assert groups.tiers(prompt) == [Tier.CPU] * 4

        over = StagedPrefill(model, 256, step=16, kv_step=kv_step, groups=2)
        over.kv.normal_()  # stale bytes everywhere: only the restored prefix may be read
        n, got = groups.first_token(over, prompt)
        plain = StaticPrefill(model, 256, step=16, kv_step=kv_step)
        plain.kv.normal_()
        m = whole.restore_into(plain.kv, prompt)
        assert n == m == 64
        assert got == plain.first_token(prompt, m) == next_token(model, prompt)
        assert torch.equal(over.kv[:, :, :, : len(prompt)], plain.kv[:, :, :, : len(prompt)])
        assert [st.counters.restored_from for st in groups.stores] == [{Tier.CPU: 4}] * 2


def test_group_pages_are_their_own(model, engine) -> None:
    """A group's pages are keyed apart from the whole-layer pages and from other groups'."""
    ids = tokens(40, 6)
    sp = StagedPrefill(model, 128, step=16, groups=2)
    sp.extend(ids, 0)
    with group_store(engine, model, sp.bounds) as groups, ConversationStore(
            engine, tenant="t", model=model, dtype=model.dtype, device="cpu",
            block_size=BLOCK) as whole:
        whole.save(sp.kv, ids)
        assert groups.lookup(ids) == 0
        groups.stores[0].save(groups.group(sp.kv, 0), ids)
        assert groups.stores[0].lookup(ids) == 32 and groups.lookup(ids) == 0
        with pytest.raises(ValueError, match="restore"):
            groups.stores[0].restore(ids)


def test_the_plan_decides_what_is_restored(model, engine) -> None:
    ids = tokens(100, 7)
    sp = StagedPrefill(model, 256, step=16, groups=2)
    sp.extend(ids, 0)
    with group_store(engine, model, sp.bounds) as groups:
        groups.save(sp.kv, ids)
        prompt = ids + tokens(5, 8)
        cost = {Tier.CPU: TierCost(1e9, 0.0)}
        for rate, choice, blocks in ((1e15, "recompute", 0), (1.0, "load", 6)):
            planner = LoadPlanner(BLOCK, groups.block_bytes, PrefillModel(rate), lambda: cost)
            over = StagedPrefill(model, 256, step=16, groups=2)
            over.kv.normal_()
            n, got = groups.first_token(over, prompt, planner=planner)
            plan = groups.last_plan
            assert plan is not None and plan.choice == choice and n == blocks * BLOCK
            assert got == next_token(model, prompt)


def test_a_group_short_of_blocks_falls_back_exactly(model, engine) -> None:
    """A block of a later group lost between the lookup and its load (an eviction racing the
    restore, which can't be staged deterministically, so group 2's load is cut short here):
    every group is restored to the shorter prefix and the prefill rerun from there."""
    ids = tokens(100, 11)
    sp = StagedPrefill(model, 256, step=16, groups=4)
    sp.extend(ids, 0)
    with group_store(engine, model, sp.bounds) as groups:
        groups.save(sp.kv, ids)
        real = groups.stores[2].restore_into
        groups.stores[2].restore_into = (  # type: ignore[method-assign]
            lambda kv, token_ids, **kw: real(kv, token_ids[:2 * BLOCK + 1], **kw))
        over = StagedPrefill(model, 256, step=16, groups=4)
        over.kv.normal_()
        prompt = ids + tokens(7, 12)
        n, got = groups.first_token(over, prompt)
        assert n == 2 * BLOCK and got == next_token(model, prompt)
        assert torch.equal(over.kv[:, :, :, : 2 * BLOCK], sp.kv[:, :, :, : 2 * BLOCK])
        torch.testing.assert_close(over.kv[:, :, :, :100], sp.kv[:, :, :, :100])


def test_bad_layer_groups_are_refused(model, engine) -> None:
    for bad in ([0, 4, 4], [1, 4], [0, 2], [0]):
        with pytest.raises(ValueError, match="bounds"):
            group_store(engine, model, bad)
    with pytest.raises(ValueError, match="layers"):
        ConversationStore(engine, tenant="t", model=model, dtype=model.dtype,
                          device="cpu", layers=range(2, 9))
    with group_store(engine, model, [0, 1, 4]) as groups, pytest.raises(ValueError,
                                                                          match="prefill"):
            groups.first_token(StagedPrefill(model, 64, groups=2), tokens(20, 1))


def test_overlapped_restore_through_daemon(model, daemon_factory) -> None:
    """The group stores attach through a real daemon; a second client of the same tenant
    restores what the first saved, group by group, exactly; another tenant finds nothing."""
    from kvtier.client import connect

    address = daemon_factory(cpu_gb=0.25)
    ids, tail = tokens(80, 13), tokens(11, 14)
    src = StagedPrefill(model, 256, step=16, groups=2)
    src.extend(ids, 0)
    kw = dict(bounds=src.bounds, model=model, dtype=model.dtype, device="cpu",
              block_size=BLOCK)
    with connect(address, tenant="t") as a, LayerGroupStore(a, **kw) as saver:
        assert saver.save(src.kv, ids) == 5
    with connect(address, tenant="t") as b, LayerGroupStore(b, **kw) as groups:
        over = StagedPrefill(model, 256, step=16, groups=2)
        over.kv.normal_()
        n, got = groups.first_token(over, ids + tail)
        assert n == 80 and got == next_token(model, ids + tail)
        assert torch.equal(over.kv[:, :, :, :80], src.kv[:, :, :, :80])
    with connect(address, tenant="u") as c, LayerGroupStore(c, **kw) as other:
        assert other.lookup(ids + tail) == 0  # another tenant can't even name these blocks


@pytest.mark.cuda
def test_overlapped_restore_on_cuda_equals_whole_restore() -> None:
    """Per-group graphs replayed with each group's restore just before: same tokens and KV."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = random_llama(SHAPE, seed=3).cuda()
    cfg = OffloadConfig(device="cuda", cpu_memory_gb=0.25, gpu_memory_gb=0.25)
    ids, tail = tokens(200, 9), tokens(20, 10)
    with TierEngine(cfg) as eng, group_store(eng, model, [0, 1, 2, 3, 4]) as groups:
        src = StagedPrefill(model, 512, step=32, groups=4, graphs=True)
        src.extend(ids, 0)
        groups.save(src.kv, ids)
        over = StagedPrefill(model, 512, step=32, groups=4, graphs=True)
        assert over.prepare_staged([192], [28]) == 1
        over.kv.normal_()
        n, got = groups.first_token(over, ids + tail)
        torch.cuda.synchronize()
        assert n == 192
        assert got == next_token(model, ids + tail)
        eager = StaticPrefill(model, 512, step=32, graphs=False)
        eager.extend(ids, 0)
        assert eager.first_token(ids + tail, 192) == got
        torch.testing.assert_close(over.kv[:, :, :, :220], eager.kv[:, :, :, :220])
