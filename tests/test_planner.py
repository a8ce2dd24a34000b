"""kvtier/planner.py: cost-aware loads (pure policy), then the measured rates of a real engine
driving a plan whose loaded blocks are checked byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import OffloadConfig, Tier, TierEngine
from kvtier.errors import InvalidArgument
from kvtier.planner import (
    LoadPlanner,
    PrefillModel,
    TierCost,
    default_costs,
    measured_costs,
    plan,
)
from kvtier.types import Direction

BT, BB = 16, 1 << 20  # tokens and bytes per block
FAST = TierCost(100e9, 1e-4)  # loads a block in ~10 us
SLOW = TierCost(0.1e9, 1e-3)  # loads a block in ~10 ms
PREFILL = PrefillModel(16_000)  # a block in 1 ms


def model_seconds(tiers, k, costs, prefill, total, first=0) -> float:
    """The cost ``plan`` minimises, written out plainly: the first ``k`` blocks loaded."""
    load = sum(costs[t].latency_s for t in set(tiers[:k]))
    load += sum(BB / costs[t].bytes_per_s for t in tiers[:k])
    return load + prefill.seconds((first + k) * BT, total)


def test_fast_leading_blocks_are_loaded_and_a_slow_rest_recomputed() -> None:
    tiers = [Tier.CPU] * 4 + [Tier.DISK] * 4
    p = plan(
        tiers,
        block_tokens=BT,
        block_bytes=BB,
        total_tokens=8 * BT + 5,
        costs={Tier.CPU: FAST, Tier.DISK: SLOW},
        prefill=PREFILL,
    )
    assert (p.load, p.choice) == (4, "split")
    assert p.load_s + p.compute_s < p.recompute_s


def test_a_tier_slower_than_recompute_is_never_loaded_from() -> None:
    p = plan(
        [Tier.DISK] * 6,
        block_tokens=BT,
        block_bytes=BB,
        total_tokens=6 * BT + 1,
        costs={Tier.DISK: SLOW},
        prefill=PREFILL,
    )
    assert (p.load, p.choice) == (0, "recompute") and p.compute_s == p.recompute_s
    p = plan(
        [Tier.DISK] * 6,
        block_tokens=BT,
        block_bytes=BB,
        total_tokens=6 * BT + 1,
        costs={Tier.DISK: FAST},
        prefill=PREFILL,
    )
    assert (p.load, p.choice) == (6, "load")


def test_a_tier_without_a_cost_ends_the_load_and_nothing_stored_is_none() -> None:
    p = plan(
        [Tier.CPU, Tier.REMOTE, Tier.CPU],
        block_tokens=BT,
        block_bytes=BB,
        total_tokens=3 * BT,
        costs={Tier.CPU: FAST},
        prefill=PREFILL,
    )
    assert p.load == 1
    empty = plan([], block_tokens=BT, block_bytes=BB, total_tokens=7, costs={}, prefill=PREFILL)
    assert (empty.load, empty.choice) == (0, "none")


def test_blocks_already_in_place_cost_nothing() -> None:
    """With ``first`` blocks in place only the prefill past them counts."""
    p = plan(
        [Tier.DISK] * 2,
        block_tokens=BT,
        block_bytes=BB,
        total_tokens=10 * BT,
        costs={Tier.DISK: SLOW},
        prefill=PREFILL,
        first=8,
    )
    assert p.recompute_s == pytest.approx(PREFILL.seconds(8 * BT, 10 * BT))


@given(
    tiers=st.lists(st.sampled_from([Tier.CPU, Tier.DISK, Tier.REMOTE]), max_size=12),
    extra=st.integers(0, 100),
    first=st.integers(0, 4),
    rates=st.lists(st.floats(1e6, 1e11), min_size=3, max_size=3),
    lats=st.lists(st.floats(0, 0.01), min_size=3, max_size=3),
    tps=st.floats(100, 1e6),
    attention=st.floats(0, 1e-6),
)
def test_the_plan_is_the_cheapest_prefix_and_never_worse_than_recompute(
    tiers, extra, first, rates, lats, tps, attention
) -> None:
    costs = {
        t: TierCost(r, lat)
        for t, r, lat in zip((Tier.CPU, Tier.DISK, Tier.REMOTE), rates, lats, strict=True)
    }
    prefill = PrefillModel(tps, attention)
    total = (first + len(tiers)) * BT + extra
    p = plan(
        tiers,
        block_tokens=BT,
        block_bytes=BB,
        total_tokens=total,
        costs=costs,
        prefill=prefill,
        first=first,
    )
    each = [model_seconds(tiers, k, costs, prefill, total, first) for k in range(len(tiers) + 1)]
    best = min(each)
    assert p.load_s + p.compute_s == pytest.approx(best, rel=1e-9)
    assert p.load_s + p.compute_s <= p.recompute_s * (1 + 1e-12)
    assert p.recompute_s == pytest.approx(each[0], rel=1e-12)
    ties = [k for k, s in enumerate(each) if s <= best * (1 + 1e-9)]
    assert p.load in ties


def test_prefill_fit_recovers_both_terms_and_falls_back_to_a_rate() -> None:
    truth = PrefillModel(20_000, 2e-9)
    lengths = (256, 1024, 4096, 8192)
    fitted = PrefillModel.fit((n, 0.012 + truth.seconds(0, n)) for n in lengths)  # + overhead
    assert fitted.tokens_per_s == pytest.approx(20_000, rel=1e-6)
    assert fitted.attention_s == pytest.approx(2e-9, rel=1e-6)
    linear = PrefillModel.fit((n, 0.003 + n / 5000) for n in lengths)
    assert linear.tokens_per_s == pytest.approx(5000, rel=1e-6)
    assert linear.attention_s == pytest.approx(0, abs=1e-15)
    flat = PrefillModel.fit([(1000, 0.1), (1000, 0.1)])  # one length: no attention term to see
    assert flat.tokens_per_s == pytest.approx(10_000) and flat.attention_s == 0
    with pytest.raises(InvalidArgument, match="samples"):
        PrefillModel.fit([(0, 1.0)])


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: TierCost(0), "bytes_per_s"),
        (lambda: TierCost(float("nan")), "bytes_per_s"),
        (lambda: TierCost(1e9, -1), "latency_s"),
        (lambda: PrefillModel(float("inf")), "tokens_per_s"),
        (lambda: PrefillModel(1, -1e-9), "attention_s"),
        (
            lambda: plan(
                [Tier.CPU],
                block_tokens=0,
                block_bytes=BB,
                total_tokens=BT,
                costs={},
                prefill=PREFILL,
            ),
            "block_tokens",
        ),
        (
            lambda: plan(
                [Tier.CPU] * 2,
                block_tokens=BT,
                block_bytes=BB,
                total_tokens=BT,
                costs={},
                prefill=PREFILL,
            ),
            "total_tokens",
        ),
        (
            lambda: plan(
                [],
                block_tokens=BT,
                block_bytes=BB,
                total_tokens=BT,
                costs={},
                prefill=PREFILL,
                first=-1,
            ),
            "first",
        ),
    ],
)
def test_bad_values_name_their_field(make, field) -> None:
    with pytest.raises(InvalidArgument) as err:
        make()
    assert err.value.field == field


def test_an_observed_overhead_makes_small_loads_recompute() -> None:
    """A block loads in ~10 us by the tiers' costs but each load took 5 ms more end to end:
    once observed, recomputing 2 blocks (2 ms) wins."""
    p = LoadPlanner(BT, BB, PREFILL, lambda: {Tier.CPU: FAST})
    first = p([Tier.CPU] * 2, 2 * BT + 1)
    assert first.choice == "load" and p.overhead_s == 0
    for _ in range(6):
        p.observe(first, first.load_s + 0.005)
    assert p.overhead_s == pytest.approx(0.005, rel=0.05)
    later = p([Tier.CPU] * 2, 2 * BT + 1)
    assert later.choice == "recompute"
    p.observe(later, 1.0)  # nothing was loaded: nothing learnt
    assert p.overhead_s == pytest.approx(0.005, rel=0.05)
    assert p([Tier.CPU] * 50, 50 * BT + 1).choice == "load"  # large loads still pay off


def test_slow_loads_from_disk_teach_a_per_block_extra_for_disk_only() -> None:
    """Disk blocks priced at 10 GB/s took 20 ms more each (room made in a full CPU tier):
    once observed, disk prefixes are recomputed while CPU ones still load."""
    costs = {Tier.CPU: FAST, Tier.DISK: TierCost(10e9)}
    p = LoadPlanner(BT, BB, PREFILL, lambda: costs)
    first = p([Tier.DISK] * 4, 4 * BT + 1)
    assert first.choice == "load" and first.below == 4
    p.observe(first, first.load_s + 4 * 0.020)  # one slow read is enough
    assert p.below_s == pytest.approx(0.020, rel=0.05) and p.overhead_s == 0
    later = p([Tier.DISK] * 4, 4 * BT + 1)
    assert later.choice == "recompute"
    assert p([Tier.CPU] * 4, 4 * BT + 1).choice == "load"
    mixed = p([Tier.CPU] * 2 + [Tier.DISK] * 2, 4 * BT + 1)
    assert mixed.choice == "split" and mixed.load == 2 and mixed.below == 0
    p.observe(first, first.load_s + 4 * 0.004)  # a faster read moves it half way down
    assert p.below_s == pytest.approx(0.012, rel=0.05)


def test_costs_are_read_at_most_every_refresh_s() -> None:
    reads: list[int] = []

    def costs() -> dict[Tier, TierCost]:
        reads.append(1)
        return {Tier.CPU: FAST}

    p = LoadPlanner(BT, BB, PREFILL, costs, refresh_s=60.0)
    for _ in range(5):
        assert p([Tier.CPU] * 2, 2 * BT + 1).choice == "load"
    assert len(reads) == 1
    p.refresh()  # read now, off the plan's path
    p([Tier.CPU] * 2, 2 * BT + 1)
    assert len(reads) == 2
    live = LoadPlanner(BT, BB, PREFILL, costs)
    live([Tier.CPU], BT + 1)
    live([Tier.CPU], BT + 1)
    assert len(reads) == 4  # refresh_s 0: every call
    with pytest.raises(InvalidArgument) as err:
        LoadPlanner(BT, BB, PREFILL, costs, refresh_s=-1.0)
    assert err.value.field == "refresh_s"


def test_measured_rates_replace_the_defaults() -> None:
    base = default_costs(cuda=True)
    rates = {Direction.CPU_TO_GPU: 40e9, Direction.DISK_TO_CPU: 2e9, Direction.CPU_TO_DISK: 1e9}
    got = measured_costs(rates, cuda=True, latencies={
        Direction.CPU_TO_GPU: 1e-4, Direction.DISK_TO_CPU: 3e-3, Direction.CPU_TO_DISK: 12e-3})
    assert got[Tier.CPU] == TierCost(40e9, 1e-4)
    assert got[Tier.DISK].bytes_per_s == pytest.approx(1 / (1 / 2e9 + 1 / 40e9))
    # both legs, and once a write down (room in a full CPU tier)
    assert got[Tier.DISK].latency_s == pytest.approx(3e-3 + 1e-4 + 12e-3)
    unmeasured = measured_costs({}, cuda=True)
    assert unmeasured[Tier.CPU] == base[Tier.CPU]
    assert unmeasured[Tier.DISK].latency_s == pytest.approx(
        2 * base[Tier.DISK].latency_s + base[Tier.CPU].latency_s)


def test_a_real_engine_measures_its_tiers_and_the_plan_loads_exact_bytes(tmp_path: Path) -> None:
    """Blocks stored, the engine restarted (they come back on disk), half loaded to measure the
    disk; then a prefill slower than the measured disk loads the rest, a faster one none."""
    page, n = 64 << 10, 16
    cfg = OffloadConfig(
        device="cpu",
        page_size=page,
        gpu_memory_gb=page * (n + 2) / 2**30,
        cpu_memory_gb=page * 4 * n / 2**30,
        disk_path=str(tmp_path),
        disk_gb=page * 4 * n / 2**30,
        disk_admission="always",
        pinned_chunk_mb=1,
    )
    keys = [f"b{i}".encode() for i in range(n)]
    want = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=torch.Generator())
    with TierEngine(cfg) as engine:
        pool = engine.attach("t", n)
        slots = [s for _, s in engine.allocate(pool.pool_id, n) or []]
        pool.segments[0][slots] = want
        assert engine.store(pool.pool_id, keys, slots) == n
    with TierEngine(cfg) as engine:
        assert engine.lookup("t", keys) == [Tier.DISK] * n
        rates = {d: m.bytes_per_s for d, m in engine.stats().counters.moved.items()}
        assert rates[Direction.DISK_TO_CPU] == 0  # nothing measured yet: defaults apply
        pool = engine.attach("t", n)
        slots = [s for _, s in engine.allocate(pool.pool_id, n) or []]
        assert engine.load(pool.pool_id, keys[: n // 2], slots[: n // 2]) == n // 2
        moved = engine.stats().counters.moved
        rates = {d: m.bytes_per_s for d, m in moved.items()}
        assert rates[Direction.DISK_TO_CPU] > 0 and rates[Direction.CPU_TO_GPU] > 0
        costs = measured_costs(rates, cuda=False)
        rest = engine.lookup("t", keys[n // 2 :])
        assert rest == [Tier.DISK] * (n // 2)
        disk_s = page / costs[Tier.DISK].bytes_per_s  # a block's modelled load
        args = dict(
            block_tokens=BT, block_bytes=page, total_tokens=n * BT + 1, costs=costs, first=n // 2
        )
        fast = plan(rest, prefill=PrefillModel(BT / disk_s * 100), **args)
        assert (fast.load, fast.choice) == (0, "recompute")
        slow = plan(rest, prefill=PrefillModel(BT / disk_s / 100), **args)
        assert (slow.load, slow.choice) == (n // 2, "load")
        pool.segments[0][slots] = 0
        at = n // 2
        assert engine.load(pool.pool_id, keys[at : at + slow.load], slots[at:]) == slow.load
        assert torch.equal(pool.segments[0][slots[at:]], want[at:])


def _totals_by_block(tiers, *, block_tokens, block_bytes, total_tokens, costs, prefill, first,
                     overhead_s, below_s) -> list[float]:
    """Seconds of loading k = 0, 1, .. leading blocks and prefilling the rest, worked out block
    by block (what ``plan`` computes at once)."""
    start = first * block_tokens
    totals = [prefill.seconds(start, total_tokens)]
    load_s, used = overhead_s, set()
    for k, tier in enumerate(tiers, 1):
        cost = costs.get(tier)
        if cost is None:
            break
        if tier not in used:
            used.add(tier)
            load_s += cost.latency_s
        load_s += block_bytes / cost.bytes_per_s + (below_s if tier > Tier.CPU else 0.0)
        totals.append(load_s + prefill.seconds(start + k * block_tokens, total_tokens))
    return totals


@settings(max_examples=300, deadline=None)
@given(
    tiers=st.lists(st.sampled_from([Tier.CPU, Tier.DISK, Tier.REMOTE]), max_size=40),
    first=st.integers(0, 8),
    extra=st.integers(1, 200),
    rates=st.tuples(*[st.floats(1e6, 1e11) for _ in range(3)]),
    latency=st.floats(0, 1e-2),
    tokens_per_s=st.floats(1e3, 1e7),
    attention_s=st.floats(0, 1e-8),
    overhead_s=st.floats(0, 1e-2),
    below_s=st.floats(0, 1e-3),
    drop_remote=st.booleans(),
)
def test_plan_is_the_cheapest_of_the_block_by_block_totals(
    tiers, first, extra, rates, latency, tokens_per_s, attention_s, overhead_s, below_s,
    drop_remote,
) -> None:
    costs = {t: TierCost(r, latency) for t, r in zip((Tier.CPU, Tier.DISK, Tier.REMOTE), rates,
                                                      strict=True)}
    if drop_remote:
        del costs[Tier.REMOTE]  # a tier without a cost ends the loadable run
    kw = dict(block_tokens=16, block_bytes=1 << 20,
              total_tokens=(first + len(tiers)) * 16 + extra, costs=costs,
              prefill=PrefillModel(tokens_per_s, attention_s), first=first,
              overhead_s=overhead_s, below_s=below_s)
    got = plan(tiers, **kw)
    totals = _totals_by_block(tiers, **kw)
    assert got.load < len(totals) and got.blocks == len(tiers)
    assert got.load_s + got.compute_s == pytest.approx(min(totals), rel=1e-9, abs=1e-15)
    assert totals[got.load] == pytest.approx(min(totals), rel=1e-9, abs=1e-15)
    assert got.recompute_s == totals[0]


@settings(max_examples=60, deadline=None)
@given(
    n_cpu=st.integers(0, 6),
    n_disk=st.integers(0, 6),
    extra=st.integers(1, 200),
    attention=st.floats(0, 1e-7),
)
def test_stopping_when_patience_runs_out_costs_no_more_than_recompute_or_one_late_block(
    n_cpu: int, n_disk: int, extra: int, attention: float
) -> None:
    # Disk blocks cheaper than their recompute late in a long context, so plans load them.
    prefill = PrefillModel(16_000, attention)
    costs = {Tier.CPU: FAST, Tier.DISK: TierCost(2e9, 1e-3)}
    tiers = [Tier.CPU] * n_cpu + [Tier.DISK] * n_disk
    total = len(tiers) * BT + extra
    p = plan(tiers, block_tokens=BT, block_bytes=BB, total_tokens=total, costs=costs,
             prefill=prefill)
    assert len(p.ready) == p.load and len(p.worth) == p.load + 1
    assert p.patience(p.load) == float("inf")  # all landed: nothing left to wait for
    for j in range(p.load):
        # Stopped at ``patience(j)`` with j blocks in the CPU tier: their copy, then the
        # prefill of the rest over them.
        copy = (FAST.latency_s + j * BB / FAST.bytes_per_s) if j else 0.0
        stopped = p.patience(j) + copy + prefill.seconds(j * BT, total)
        late = max(0.0, 1.5 * p.ready[j] - p.worth[j])  # the next block's lateness allowed
        assert stopped <= p.recompute_s + late + 1e-12
        assert stopped >= p.recompute_s - 1e-12  # and it never gives up while loading pays
        assert p.ready[j] >= (p.ready[j - 1] if j else 0.0)


def test_patience_waits_for_a_block_on_time_and_gives_up_on_a_late_one() -> None:
    tiers = [Tier.CPU] * 4 + [Tier.DISK] * 4
    costs = {Tier.CPU: FAST, Tier.DISK: TierCost(4e9, 1e-3)}
    total = 8 * BT + 400  # the disk blocks save their share of a long context's attention
    p = plan(tiers, block_tokens=BT, block_bytes=BB, total_tokens=total, costs=costs,
             prefill=PrefillModel(16_000, 2e-7))
    assert p.load == 8
    # Four blocks lent at once from the CPU tier: waiting is worth their recompute, less copy.
    assert p.patience(4) == pytest.approx(max(p.worth[4], 1.5 * p.ready[4]))
    assert p.worth[4] == pytest.approx(PrefillModel(16_000, 2e-7).seconds(0, 4 * BT)
                                       - FAST.latency_s - 4 * BB / FAST.bytes_per_s)
    # Nothing landed yet: only as long as the first block is not late.
    assert p.patience(0) == pytest.approx(1.5 * p.ready[0])
    none = plan([Tier.DISK] * 2, block_tokens=BT, block_bytes=BB, total_tokens=2 * BT + 1,
                costs={Tier.DISK: SLOW}, prefill=PREFILL)
    assert none.load == 0 and none.patience(0) == float("inf")
