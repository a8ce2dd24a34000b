"""kvtier/stats.py: the per-direction cost of a batch, fitted from completed batches."""

from __future__ import annotations

import pytest

from kvtier.stats import DirectionCounters


def test_varied_batches_give_the_rate_and_the_fixed_latency() -> None:
    c = DirectionCounters()
    assert (c.bytes_per_s, c.latency_s) == (0, 0)
    for i in range(40):
        nbytes = (1 + i % 7) << 20
        c.observe(nbytes, 0.002 + nbytes / 1.5e9)
    assert c.bytes_per_s == pytest.approx(1.5e9, rel=1e-6)
    assert c.latency_s == pytest.approx(0.002, rel=1e-6)


def test_equal_batches_give_bytes_over_seconds_and_no_latency() -> None:
    c = DirectionCounters()
    for _ in range(10):
        c.observe(4 << 20, 0.004)
    assert c.bytes_per_s == pytest.approx((4 << 20) / 0.004)
    assert c.latency_s == 0


def test_recent_batches_weigh_most_and_empty_ones_are_ignored() -> None:
    c = DirectionCounters()
    for _ in range(10):
        c.observe(1 << 20, (1 << 20) / 1e9)  # a slow device ...
    for _ in range(40):
        c.observe(1 << 20, (1 << 20) / 4e9)  # ... got fast
    c.observe(0, 1.0)  # a failed batch moved nothing: no throughput to learn from
    c.observe(1 << 20, 0.0)
    assert c.bytes_per_s == pytest.approx(4e9, rel=1e-3)
