"""Batch policy calls agree with the per-page calls, for every registered policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.base import EvictionPolicy
from kvtier.policy.registry import create_policy, known_policies
from kvtier.types import PageId

from .helpers import evict, insert_all, meta

POLICIES = known_policies()
IDS = st.lists(st.integers(min_value=0, max_value=23), max_size=10)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), IDS, st.sampled_from([0.5, 1.0, 4.0])),
        st.tuples(st.just("remove"), IDS, st.just(1.0)),
        st.tuples(st.just("touch"), IDS, st.just(1.0)),
        st.tuples(st.just("evict"), IDS, st.just(1.0)),
    ),
    max_size=30,
)


def _apply(one: EvictionPolicy, many: EvictionPolicy, op: str, ids: list[int], prio: float) -> None:
    if op == "insert":
        fresh = [i for i in dict.fromkeys(ids) if PageId(i) not in one]
        metas = [meta(i, priority=prio, position=i % 4, length=4) for i in fresh]
        for m in metas:
            one.insert(m)
        many.insert_many(metas)
    elif op == "remove":
        for i in ids:
            one.remove(PageId(i))
        many.remove_many([PageId(i) for i in ids])
    elif op == "touch":
        for i in ids:
            one.touch(PageId(i))
        many.touch_many([PageId(i) for i in ids])
    else:  # evict len(ids) // 2 with the rest protected: the two must name the same victims
        n = len(ids) // 2
        assert evict(one, n, ids[n:]) == evict(many, n, ids[n:])


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_batch_calls_agree_with_per_page_calls(name: str, ops: list) -> None:
    one, many = create_policy(name), create_policy(name)
    for op, ids, prio in ops:
        _apply(one, many, op, ids, prio)
        assert len(one) == len(many)
    # Same state: the whole eviction order agrees.
    assert evict(one, len(one)) == evict(many, len(many))


@pytest.mark.parametrize("name", POLICIES)
def test_insert_many_of_a_tracked_or_repeated_id_is_an_error(name: str) -> None:
    policy = create_policy(name)
    insert_all(policy, [1, 2])
    with pytest.raises(ValueError):
        policy.insert_many([meta(3), meta(2)])
    fresh = create_policy(name)
    with pytest.raises(ValueError):
        fresh.insert_many([meta(5), meta(5)])


@pytest.mark.parametrize("name", POLICIES)
def test_batch_calls_accept_empty_and_unknown_ids(name: str) -> None:
    policy = create_policy(name)
    policy.insert_many([])
    policy.remove_many([])
    policy.touch_many([])
    insert_all(policy, [1])
    policy.remove_many([PageId(7)])
    policy.touch_many([PageId(7)])
    assert len(policy) == 1 and PageId(1) in policy
