"""kvtier/prefix/layers.py: keyed loads of a registered pool one group of segments at a time
(real engines, CPU mode and CUDA; real bytes)."""

from __future__ import annotations

import pytest
import torch

from kvtier import OffloadConfig, TierEngine
from kvtier.errors import InvalidArgument, NotFound

BLOCKS, LAYERS = 24, 4


def _engine(device: str, disk_dir: str = "") -> TierEngine:
    kw = dict(disk_path=disk_dir, disk_gb=0.05, disk_admission="always") if disk_dir else {}
    return TierEngine(OffloadConfig(
        device=device, page_size=4096, gpu_memory_gb=1 / 1024, cpu_memory_gb=0.02,
        pinned_chunk_mb=1, batch_mb=1, max_inflight_mb=8, metrics_addr="", **kw))


def _segments(device: str) -> list[torch.Tensor]:
    """A K and a V segment per layer, 2 KiB and 1 KiB per block (a page of 12 KiB)."""
    out = []
    for _ in range(LAYERS):
        out.append(torch.randint(0, 256, (BLOCKS, 2048), dtype=torch.uint8, device=device))
        out.append(torch.randint(0, 256, (BLOCKS, 1024), dtype=torch.uint8, device=device))
    return out


def _round_trip(device: str) -> None:
    segs = _segments(device)
    with _engine(device) as engine:
        pool = engine.register("t", segs)
        src, dst = list(range(0, 8)), list(range(20, 12, -1))
        keys = [f"b{i}".encode() for i in src]
        want = [torch.cat([s[b] for s in segs]).cpu() for b in src]
        assert engine.store(pool.pool_id, keys, src) == 8
        before = [s.clone() for s in segs]
        bounds = [0, 2, 6, 8]  # layer 0 | layers 1-2 | layer 3
        seen = []
        for g, n in enumerate(engine.load_layers(pool.pool_id, keys, dst, bounds)):
            seen.append(n)
            lo, hi = bounds[g], bounds[g + 1]
            for i, s in enumerate(segs):  # landed: groups up to g; untouched: the later ones
                for j, b in enumerate(dst):
                    if i < hi:
                        off = sum(x.shape[1] for x in segs[:i])
                        assert torch.equal(s[b].cpu(), want[j][off : off + s.shape[1]]), (g, i)
                    else:
                        assert torch.equal(s[b], before[i][b]), (g, i, "written early")
            assert lo < hi
        assert seen == [8, 8, 8]
        for i, s in enumerate(segs):  # blocks not loaded: untouched
            for b in range(BLOCKS):
                if b not in dst:
                    assert torch.equal(s[b], before[i][b])


def test_each_group_lands_in_order_and_nothing_else_is_written() -> None:
    _round_trip("cpu")


@pytest.mark.cuda
def test_each_group_lands_in_order_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _round_trip("cuda")


def test_a_missing_block_ends_the_prefix_in_every_group() -> None:
    segs = _segments("cpu")
    with _engine("cpu") as engine:
        pool = engine.register("t", segs)
        assert engine.store(pool.pool_id, [b"a", b"b", b"c"], [0, 1, 2]) == 3
        got = list(engine.load_layers(pool.pool_id, [b"a", b"b", b"x", b"c"], [5, 6, 7, 8],
                                      [0, 4, 8]))
        assert got == [2, 2]
        assert engine.lookup("t", [b"a", b"b", b"c"])  # still stored, nothing left protected


def test_bad_arguments_are_refused_before_anything_is_copied() -> None:
    segs = _segments("cpu")
    with _engine("cpu") as engine:
        pool = engine.register("t", segs)
        engine.store(pool.pool_id, [b"a"], [0])
        before = [s.clone() for s in segs]
        for bad in ([], [0], [1, 8], [0, 9], [0, 4, 4, 8], [0, 5, 3, 8], [*range(9), 8]):
            with pytest.raises(InvalidArgument) as err:
                next(engine.load_layers(pool.pool_id, [b"a"], [3], bad))
            assert err.value.field == "segment_bounds", bad
        with pytest.raises(InvalidArgument) as err:
            next(engine.load_layers(pool.pool_id, [b"a"], [3, 4], [0, 8]))
        assert err.value.field == "slots"
        with pytest.raises(InvalidArgument) as err:
            next(engine.load_layers(pool.pool_id, [b"a"], [BLOCKS], [0, 8]))
        assert err.value.field == "slots"
        with pytest.raises(NotFound):
            next(engine.load_layers(9999, [b"a"], [3], [0, 8]))
        assert all(torch.equal(a, b) for a, b in zip(segs, before, strict=True))


def test_closing_early_leaves_nothing_protected(tmp_path) -> None:
    segs = _segments("cpu")
    with _engine("cpu", str(tmp_path)) as engine:
        pool = engine.register("t", segs)
        keys = [f"k{i}".encode() for i in range(6)]
        assert engine.store(pool.pool_id, keys, list(range(6))) == 6
        it = engine.load_layers(pool.pool_id, keys, list(range(10, 16)), [0, 2, 8])
        assert next(it) == 6
        it.close()  # a client gone mid-way
        c = engine._core
        with c.cond:
            assert int(c.table.protect.sum()) == 0
        assert list(engine.load_layers(pool.pool_id, keys, list(range(10, 16)), [0, 8])) == [6]
