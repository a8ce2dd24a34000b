"""The RowPolicy contract, for every registered policy through ``create_row_policy``.

``lru`` is row-native; every other policy runs behind ``PerPagePolicy``. Victim order must match
the per-page policy fed the same calls.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.adapter import PerPagePolicy
from kvtier.policy.base import EvictionPolicy, RowMeta, RowPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.registry import create_policy, create_row_policy, known_policies
from kvtier.types import PageId

from .helpers import evict, evict_rows, insert_rows, meta, row_meta, rows

POLICIES = known_policies()
IDS = st.lists(st.integers(min_value=0, max_value=23), max_size=10)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), IDS, st.sampled_from([0.5, 1.0, 4.0])),
        st.tuples(st.just("remove"), IDS, st.just(1.0)),
        st.tuples(st.just("touch"), IDS, st.just(1.0)),
        st.tuples(st.just("update"), IDS, st.sampled_from([0.5, 2.0])),
        st.tuples(st.just("evict"), IDS, st.just(0.0)),
        st.tuples(st.just("partial"), IDS, st.just(0.0)),
    ),
    max_size=40,
)


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> RowPolicy:
    return create_row_policy(request.param)


def _batch_meta(ids: list[int], prio: float, shift: int = 0) -> RowMeta:
    """Metadata as the per-page side gets it: position ``(id + shift) % 4`` of 4."""
    batch = rows(*ids)
    return RowMeta(
        np.full(len(batch), prio), (batch + shift) % 4, np.full(len(batch), 4, dtype=np.int64)
    )


def _apply(ref: EvictionPolicy, pol: RowPolicy, op: str, ids: list[int], prio: float) -> None:
    """One call on both: per-page ``ref`` and row ``pol``; evictions must name the same rows."""
    uniq = list(dict.fromkeys(ids))
    if op == "insert":
        fresh = [i for i in uniq if PageId(i) not in ref]
        ref.insert_many([meta(i, priority=prio, position=i % 4, length=4) for i in fresh])
        pol.insert(rows(*fresh), _batch_meta(fresh, prio))
    elif op == "remove":
        ref.remove_many([PageId(i) for i in uniq])
        pol.remove(rows(*uniq))
    elif op == "touch":
        ref.touch_many([PageId(i) for i in uniq])
        pol.touch(rows(*uniq))
    elif op == "update":
        for i in uniq:
            ref.update(meta(i, priority=prio, position=(i + 1) % 4, length=4))
        pol.update(rows(*uniq), _batch_meta(uniq, prio, shift=1))
    else:
        n, guarded = len(ids) // 2, ids[len(ids) // 2 :]
        if op == "partial":
            free = sum(1 for i in range(24) if PageId(i) in ref and i not in guarded)
            assert evict(ref, min(n, free), guarded) == evict_rows(pol, n, guarded, partial=True)
        else:
            assert evict(ref, n, guarded) == evict_rows(pol, n, guarded)


def test_native_or_adapted(policy: RowPolicy) -> None:
    assert isinstance(policy, LRUPolicy | PerPagePolicy)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_victims_match_the_per_page_policy(name: str, ops: list) -> None:
    ref, pol = create_policy(name), create_row_policy(name)
    for op, ids, prio in ops:
        _apply(ref, pol, op, ids, prio)
        assert len(ref) == len(pol)
    assert pol.contains(rows(*range(24))).tolist() == [PageId(i) in ref for i in range(24)]
    assert evict(ref, len(ref)) == evict_rows(pol, len(pol))


def test_evict_all_or_nothing_vs_partial(policy: RowPolicy) -> None:
    insert_rows(policy, range(1, 6))
    assert evict_rows(policy, 3, protected=[1, 2, 3]) is None
    assert len(policy) == 5
    assert policy.contains(rows(1, 2, 3, 4, 5)).all()
    assert evict_rows(policy, 6) is None and len(policy) == 5
    partial = evict_rows(policy, 3, protected=[1, 2, 3], partial=True)
    assert partial is not None and sorted(partial) == [4, 5]
    assert evict_rows(policy, 2, protected=[1, 2, 3], partial=True) == []
    assert len(policy) == 3


def test_evict_zero_negative_and_empty(policy: RowPolicy) -> None:
    for partial in (False, True):
        out = policy.evict(0, lambda r: np.zeros(len(r), dtype=bool), partial=partial)
        assert out is not None and out.dtype == np.int64 and len(out) == 0
    assert evict_rows(policy, 1, partial=True) == []
    assert evict_rows(policy, 1) is None
    insert_rows(policy, [1])
    with pytest.raises(ValueError):
        policy.evict(-1, lambda r: np.zeros(len(r), dtype=bool))
    assert len(policy) == 1


def test_protected_callable_is_honoured(policy: RowPolicy) -> None:
    insert_rows(policy, range(20))
    policy.remove(rows(7, 8))
    seen: list[np.ndarray] = []

    def guarded(batch: np.ndarray) -> np.ndarray:
        seen.append(batch.copy())
        return batch % 2 == 0

    victims = policy.evict(9, guarded)
    assert victims is not None and victims.dtype == np.int64
    assert sorted(victims.tolist()) == [1, 3, 5, 9, 11, 13, 15, 17, 19]
    tracked = set(range(20)) - {7, 8}
    assert seen and all(set(batch.tolist()) <= tracked for batch in seen)
    assert not policy.contains(victims).any()
    assert len(policy) == 9


def test_untracked_rows_are_ignored(policy: RowPolicy) -> None:
    insert_rows(policy, [1, 2])
    policy.touch(rows(99, 3))
    policy.remove(rows(99, 1_000_000))
    policy.update(rows(99), row_meta(1, priority=5.0))
    policy.remove(rows())
    policy.touch(rows())
    assert len(policy) == 2
    assert policy.contains(rows(1, 2, 3, 99)).tolist() == [True, True, False, False]


def test_insert_of_a_tracked_row_raises_and_changes_nothing(policy: RowPolicy) -> None:
    insert_rows(policy, [1, 2, 3])
    with pytest.raises(ValueError, match=r"\b2\b"):
        insert_rows(policy, [4, 2, 5])
    with pytest.raises(ValueError, match=r"\b6\b"):
        insert_rows(policy, [6, 7, 6])
    assert len(policy) == 3
    assert policy.contains(rows(1, 2, 3, 4, 5, 6, 7)).tolist() == [True] * 3 + [False] * 4
    victims = evict_rows(policy, 3)
    assert victims is not None and sorted(victims) == [1, 2, 3]
    insert_rows(policy, [4, 6])  # the rejected rows are insertable afterwards
    assert len(policy) == 2


def test_len_contains_and_reinsert(policy: RowPolicy) -> None:
    assert len(policy) == 0 and policy.contains(rows()).dtype == bool
    insert_rows(policy, [5, 1, 3])
    policy.remove(rows(1))
    assert len(policy) == 2
    assert policy.contains(rows(5, 1, 3, 0)).tolist() == [True, False, True, False]
    insert_rows(policy, [1])
    assert len(policy) == 3
    victims = evict_rows(policy, 3)
    assert victims is not None and sorted(victims) == [1, 3, 5]
    assert len(policy) == 0


@settings(max_examples=30, deadline=None)
@given(before=IDS, batch=IDS)
def test_touch_after_insert_false_means_the_touch_changes_nothing(
    before: list[int], batch: list[int]
) -> None:
    """A policy that lets the engine skip the touch right after an insert must evict the same
    rows, in the same order, with the touch and without it."""
    for name in POLICIES:
        if create_row_policy(name).touch_after_insert:
            continue
        plain, touched = create_row_policy(name), create_row_policy(name)
        old = list(dict.fromkeys(before))
        new = [i for i in dict.fromkeys(batch) if i not in old]
        for pol in (plain, touched):
            pol.insert(rows(*old), _batch_meta(old, 1.0))
            pol.insert(rows(*new), _batch_meta(new, 1.0))
        touched.touch(rows(*new))
        n = len(old) + len(new)
        assert plain.evict(n, lambda r: np.zeros(len(r), dtype=bool)).tolist() == (
            touched.evict(n, lambda r: np.zeros(len(r), dtype=bool)).tolist()
        )
