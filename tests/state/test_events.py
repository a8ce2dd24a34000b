"""kvtier/state/events.py against a real engine: a subscription's bounded queue is fair between
pools, so one tenant's burst can't push another's events out."""

from __future__ import annotations

from tests.conftest import PAGE


def test_one_pools_burst_does_not_push_out_another_pools_events(make_engine) -> None:
    """The queue dropped its oldest events whoever owned them: a tenant freeing thousands of
    pages while another freed 160 left the other's stream with none of them."""
    engine = make_engine(disk=False, gpu_memory_gb=64 * PAGE / 2**30)
    a, b = engine.attach("a", 32), engine.attach("b", 16)
    mine = engine.allocate(b.pool_id, 16)
    assert mine is not None
    events = engine.subscribe(256)
    for _ in range(64):  # 2,048 "freed" events of pool a
        got = engine.allocate(a.pool_id, 32)
        assert got is not None
        engine.free(a.pool_id, [p for p, _ in got])
        if _ == 32:
            engine.free(b.pool_id, [p for p, _ in mine])  # in the middle of the burst
    queued = events.drain(10_000)
    freed_b = {e.page_id for e in queued if e.pool_id == b.pool_id and e.kind == "freed"}
    assert freed_b == {p for p, _ in mine}
    assert len(queued) == 256 and events.dropped > 1000
    kinds = [e.pool_id for e in queued]
    assert kinds.count(a.pool_id) == 256 - 16
    events.close()
    assert events.get(timeout=0.01) is None
