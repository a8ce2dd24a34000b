"""Where a keyed store's and load's time goes (``benchmarks/registered.py --stages``).

Wraps the engine's own steps for a few rounds (and unwraps them after, so later timings are
clean) and reports, per call, milliseconds: the whole call; ``first_launch`` (call start to the
first batch launch: the key bookkeeping every copy waits for); per stage the total wall time
(``salt``: tenant-salted key hashes; ``slots``: CPU slots for stored blocks; ``new_keyed``:
page-table rows and key index; ``resident``: a load's lookup and protection of its prefix;
``launch``/``sync``/``complete``: starting batches, waiting for their copies, completing
them under the engine lock (on the caller's thread when it holds the lane on loan,
``kvtier/loan.py``, else on the lane's; ``launch`` counts only the lane's, ``handler`` both);
``wait``: the caller waiting for the copies); and ``tail`` (the last copy done to the call
returning).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import kvtier.moves.completion as completion
import kvtier.prefix.store as prefix
import kvtier.scheduler as scheduler
from kvtier import OffloadConfig, TierEngine

GIB = 1 << 30
EVENTS: list[tuple[str, float, float, str]] = []  # (stage, start, end, thread)


def _targets() -> list[tuple[Any, str, str]]:
    out = [
        (prefix, "salt_key", "salt"),
        (prefix.PrefixStore, "_cpu_slots", "slots"),
        (prefix.PrefixStore, "_new_keyed", "new_keyed"),
        (prefix.PrefixStore, "resident_prefix", "resident"),
        (prefix.PrefixStore, "wait", "wait"),
        (scheduler.TransferScheduler, "_launch", "launch"),
        (completion.Completion, "_complete_chunk", "complete"),
    ]
    if torch.cuda.is_available():
        import kvtier.transfer.cuda as cuda
        import kvtier.transfer.segtable as segtable
        from kvtier.tiers.pinned import HostArena

        out += [
            (torch.cuda.Event, "synchronize", "sync"),
            # Inside ``launch``: the handler's whole launch, and its parts.
            (cuda._CudaHandler, "launch", "handler"),
            (HostArena, "runs_array", "runs"),
            (cuda._CudaHandler, "_index", "index"),
            (segtable.SegmentTable, "_launch", "kernel"),
        ]
    return out


@contextmanager
def instrumented() -> Iterator[None]:
    saved = []
    for owner, name, stage in _targets():
        fn: Callable[..., Any] = getattr(owner, name)
        saved.append((owner, name, fn))

        def wrapper(*a: Any, _fn: Callable[..., Any] = fn, _stage: str = stage, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                EVENTS.append((_stage, start, time.perf_counter(),
                               threading.current_thread().name))

        setattr(owner, name, functools.wraps(fn)(wrapper))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _call(fn: Callable[[], Any], device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    EVENTS.clear()
    start = time.perf_counter()
    fn()
    end = time.perf_counter()
    out = {"call": (end - start) * 1e3}
    launches = [e for e in EVENTS if e[0] == "launch"]
    if launches:
        out["first_launch"] = (min(e[1] for e in launches) - start) * 1e3
    syncs = [e for e in EVENTS if e[0] == "sync"]
    if syncs:
        out["tail"] = (end - max(e[2] for e in syncs)) * 1e3
    for stage in {e[0] for e in EVENTS}:
        out[stage] = sum(e[2] - e[1] for e in EVENTS if e[0] == stage) * 1e3
    out["batches"] = float(len(launches))
    return {k: round(v, 3) for k, v in out.items()}


def stage_report(
    segments: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, device: torch.device,
    batch_mb: int, rounds: int = 3,
) -> dict[str, list[dict[str, float]]]:
    """Per round, the store's and the load's stage times (ms); the first round is a warm-up."""
    import os

    n, page = len(src), sum(s.shape[1] for s in segments)
    cfg = OffloadConfig(
        device=str(device), cpu_memory_gb=1.2 * n * page / GIB, gpu_memory_gb=0.01,
        pinned_chunk_mb=256, batch_mb=batch_mb, max_inflight_mb=max(512, 4 * batch_mb),
        metrics_addr="",
    )
    engine = TierEngine(cfg)
    out: dict[str, list[dict[str, float]]] = {"store": [], "load": []}
    try:
        pool = engine.register("stages", segments)
        src_l, dst_l = src.tolist(), dst.tolist()
        for r in range(rounds + 1):
            keys = [os.urandom(32) for _ in range(n)]
            with instrumented():
                st = _call(functools.partial(engine.store, pool.pool_id, keys, src_l), device)
                ld = _call(functools.partial(engine.load, pool.pool_id, keys, dst_l), device)
            if r:
                out["store"].append(st)
                out["load"].append(ld)
            c = engine._core  # benchmark only: forget the round's keys
            with c.cond:
                rows = [c.table.keyed(prefix.salt_key("stages", k)) for k in keys]
                c.drop(torch.tensor([x for x in rows if x is not None]).numpy(), "bench")
    finally:
        engine.close()
    return out
