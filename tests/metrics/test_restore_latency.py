"""The restore-latency histogram (``kvtier_restore_latency_seconds``) against a real engine:
every restore counted, however many happen between two scrapes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvtier.metrics import EngineCollector


def test_every_restore_between_two_scrapes_is_counted(make_engine) -> None:
    """The engine kept the last 4,096 samples until a scrape drained them: 5,000 restores
    between scrapes raised the histogram's count by 4,096 (over ~270 restores/s at a 15 s
    scrape interval, p99 was read from what was left). Now the engine keeps counts."""
    engine = make_engine(disk=False)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, "test"))
    pool = engine.attach("t", 4)
    page = engine.allocate(pool.pool_id, 1)[0][0]
    engine.release(pool.pool_id, [page])
    rounds = 5000
    for _ in range(rounds):
        assert engine.offload(pool.pool_id, [page]) == 1
        assert engine.wait_idle()
        assert engine.acquire(pool.pool_id, [page]) is not None  # restored: one sample
        engine.release(pool.pool_id, [page])
    text = generate_latest(registry).decode()
    count = next(line for line in text.splitlines()
                 if line.startswith("kvtier_restore_latency_seconds_count"))
    assert float(count.rsplit(" ", 1)[1]) == rounds
    inf = next(line for line in text.splitlines()
               if line.startswith('kvtier_restore_latency_seconds_bucket{le="+Inf"}'))
    assert float(inf.rsplit(" ", 1)[1]) == rounds
