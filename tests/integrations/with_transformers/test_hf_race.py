"""A load raced against the recompute (``RacedRestore``) on a real engine: whichever way the race
goes, the first token and the KV equal a full recompute's.

Which side wins a real race depends on timing; the tests that need a given outcome fix it with
a subclass whose check waits for the load before a chosen group (the load, the switch and the
recompute are the real ones)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import TinyShape, next_token, random_llama, random_tokens  # noqa: E402

from kvtier import OffloadConfig, Tier, TierEngine  # noqa: E402
from kvtier.integrations.transformers.overlap import LayerGroupStore  # noqa: E402
from kvtier.integrations.transformers.race import RacedRestore  # noqa: E402
from kvtier.integrations.transformers.staged import StagedPrefill  # noqa: E402

BLOCK = 16
SHAPE = TinyShape(layers=4, hidden=64, heads=4, kv_heads=2)


class SwitchBefore(RacedRestore):
    """A race whose checks say "not yet" before layer ``at`` and wait for the load there: the
    load wins exactly before layer ``at``."""

    at = 0

    def _landed(self, loader, g: int) -> int:
        if g < self.at:
            return 0
        if g == self.at:
            loader.join()
        return super()._landed(loader, g)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=5)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[TierEngine]:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=0.25, gpu_memory_gb=0.25, pinned_chunk_mb=1,
                        disk_path=str(tmp_path / "disk"), disk_gb=0.5, disk_admission="always")
    with TierEngine(cfg) as eng:
        yield eng


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, SHAPE.vocab)


def setup(model, engine, kv_step=None,
          n_groups=4) -> tuple[LayerGroupStore, StagedPrefill, StagedPrefill]:
    """A stored 100-token conversation; (store, its source prefill, a stale prefill)."""
    src = StagedPrefill(model, 256, step=16, kv_step=kv_step, groups=n_groups)
    src.extend(tokens(100, 1), 0)
    groups = LayerGroupStore(engine, bounds=src.bounds, model=model,
                             dtype=model.dtype, device=model.device, tenant="t",
                             block_size=BLOCK)
    assert groups.save(src.kv, tokens(100, 1)) == 6
    fresh = StagedPrefill(model, 256, step=16, kv_step=kv_step, groups=n_groups)
    fresh.kv.normal_()  # stale bytes: only what the race writes may be read
    return groups, src, fresh


@pytest.mark.parametrize("kv_step", [None, 64], ids=["exact", "masked"])
@pytest.mark.parametrize(("at", "n_groups"), [(0, 4), (2, 4), (3, 4), (1, 2), (3, 2)])
def test_a_load_that_lands_is_switched_to_exactly(model, engine, at, n_groups, kv_step) -> None:
    """Before a first layer of a group or mid-group (layers 1 and 3 of two 2-layer groups)."""
    groups, src, fresh = setup(model, engine, kv_step, n_groups)
    with groups:
        race = SwitchBefore(groups, fresh)
        race.at = at
        prompt = tokens(100, 1) + tokens(10, 2)
        out = race.first_token(prompt, 96)
        race.join()
        assert out.won and out.switched_at == at and out.restored == 96
        assert out.token == next_token(model, prompt)
        torch.testing.assert_close(fresh.kv[:, :, :, :100], src.kv[:, :, :, :100])
        # The landed layers hold the stored bytes exactly.
        assert torch.equal(fresh.kv[at:, :, :, :96], src.kv[at:, :, :, :96])


def test_a_load_that_lands_nothing_is_recomputed(model, engine) -> None:
    groups, _, fresh = setup(model, engine)
    with groups:
        race = SwitchBefore(groups, fresh)
        prompt = tokens(60, 3)  # nothing of it is stored: the load lands 0 tokens
        out = race.first_token(prompt, 48)
        race.join()
        assert not out.won and out.restored == 0
        assert out.token == next_token(model, prompt)


def test_a_real_race_is_exact_either_way(model, engine) -> None:
    groups, src, fresh = setup(model, engine)
    with groups:
        race = RacedRestore(groups, fresh)
        prompt = tokens(100, 1) + tokens(30, 4)
        out = race.first_token(prompt, 96)
        race.join()
        assert out.restored in (0, 96) and out.won == (out.restored == 96)
        assert out.token == next_token(model, prompt)
        torch.testing.assert_close(fresh.kv[:, :, :, :100], src.kv[:, :, :, :100])
        assert Tier.CPU in groups.stores[-1].counters.restored_from  # the load did run


def push_to_disk(model, engine, groups: LayerGroupStore, ids: list[int]) -> None:
    """Store unrelated blocks (pages of the same size: the CPU tier is one pinned chunk) until
    every group's blocks of ``ids`` have left the CPU tier for disk."""
    kv = torch.randn(SHAPE.layers, 2, SHAPE.kv_heads, BLOCK * 32, SHAPE.head_dim)
    with LayerGroupStore(engine, bounds=groups.bounds, model=model,
                         dtype=model.dtype, device="cpu", tenant="t", block_size=BLOCK,
                         model_id="filler") as filler:
        # Eight times the CPU tier's budget, without looking ``ids`` up in between (a lookup
        # is a use and would keep them on the CPU tier).
        for seed in range(8):
            filler.save(kv, tokens(BLOCK * 32, 100 + seed), wait_s=2.0)
    assert set(groups.tiers(ids)) == {Tier.DISK}


@pytest.mark.parametrize("forced", [True, False], ids=["switch-before-2", "real-race"])
def test_a_prefix_on_disk_raced_is_exact(model, tmp_path: Path, forced) -> None:
    cfg = OffloadConfig(device="cpu", cpu_memory_gb=1 / 1024, gpu_memory_gb=0.25,
                        pinned_chunk_mb=1, disk_path=str(tmp_path / "disk"), disk_gb=0.5,
                        disk_admission="always")
    with TierEngine(cfg) as eng:
        groups, src, fresh = setup(model, eng)
        with groups:
            push_to_disk(model, eng, groups, tokens(100, 1))
            race = SwitchBefore(groups, fresh) if forced else RacedRestore(groups, fresh)
            race.at = 2
            prompt = tokens(100, 1) + tokens(10, 2)
            out = race.first_token(prompt, 96)
            race.join()
            assert out.token == next_token(model, prompt)
            torch.testing.assert_close(fresh.kv[:, :, :, :100], src.kv[:, :, :, :100])
            if forced:
                assert out.switched_at == 2 and out.restored == 96
                assert torch.equal(fresh.kv[2:, :, :, :96], src.kv[2:, :, :, :96])
            assert Tier.DISK in groups.stores[-1].counters.restored_from


def test_bad_race_arguments_are_refused(model, engine) -> None:
    groups, _, fresh = setup(model, engine)
    with groups:
        with pytest.raises(ValueError, match="prefill"):
            RacedRestore(groups, StagedPrefill(model, 256, groups=2))
        race = RacedRestore(groups, fresh)
        for ids, cut in ((tokens(300, 1), 0), (tokens(20, 1), 20), (tokens(20, 1), -1)):
            with pytest.raises(ValueError, match="cut"):
                race.first_token(ids, cut)


@pytest.mark.cuda
def test_race_switch_on_cuda_is_exact() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = random_llama(SHAPE, seed=5).cuda()
    cfg = OffloadConfig(device="cuda", cpu_memory_gb=0.25, gpu_memory_gb=0.25)
    with TierEngine(cfg) as eng:
        groups, src, fresh = setup(model, eng)
        with groups:
            race = SwitchBefore(groups, fresh)
            race.at = 2
            prompt = tokens(100, 1) + tokens(10, 2)
            out = race.first_token(prompt, 96)
            race.join()
            torch.cuda.synchronize()
            assert out.switched_at == 2 and out.token == next_token(model, prompt)
            torch.testing.assert_close(fresh.kv[:, :, :, :100], src.kv[:, :, :, :100])
