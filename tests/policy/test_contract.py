"""The EvictionPolicy contract, checked for every registered policy (built-ins and plugins)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvtier.policy.base import EvictionPolicy
from kvtier.policy.registry import BUILTIN_POLICIES, create_policy, known_policies
from kvtier.types import PageId

from .helpers import evict, insert_all, meta, touch_all

POLICIES = known_policies()
IDS = st.integers(min_value=0, max_value=15)


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return create_policy(request.param)


def test_builtin_names_match_their_class(policy: EvictionPolicy) -> None:
    if type(policy).__module__.startswith("kvtier."):
        assert BUILTIN_POLICIES[policy.name].endswith(f":{type(policy).__name__}")


def test_evict_is_all_or_nothing(policy: EvictionPolicy) -> None:
    insert_all(policy, range(1, 6))
    touch_all(policy, [2, 4, 4])
    assert evict(policy, 3, protected=[1, 2, 3]) is None
    assert len(policy) == 5
    assert all(PageId(i) in policy for i in range(1, 6))
    assert evict(policy, 6) is None
    assert len(policy) == 5
    victims = evict(policy, 2, protected=[1, 2, 3])
    assert victims is not None and sorted(victims) == [4, 5]
    assert len(policy) == 3


def test_evict_zero_and_negative(policy: EvictionPolicy) -> None:
    assert evict(policy, 0) == []
    insert_all(policy, [1])
    assert evict(policy, 0, protected=[1]) == []
    with pytest.raises(ValueError):
        policy.evict(-1, set())
    assert len(policy) == 1


def test_evicted_pages_are_distinct_unprotected_and_untracked(policy: EvictionPolicy) -> None:
    insert_all(policy, range(10))
    touch_all(policy, [3, 3, 7, 0, 9, 9, 9])
    protected = {0, 2, 4, 6, 8}
    victims = evict(policy, 5, protected=protected)
    assert victims is not None
    assert sorted(victims) == [1, 3, 5, 7, 9]
    assert all(PageId(v) not in policy for v in victims)
    assert len(policy) == 5


def test_unknown_ids_are_ignored(policy: EvictionPolicy) -> None:
    insert_all(policy, [1, 2])
    policy.touch(PageId(99))
    policy.remove(PageId(99))
    policy.update(meta(99, priority=5.0))
    assert len(policy) == 2
    assert PageId(99) not in policy


def test_double_insert_is_an_error(policy: EvictionPolicy) -> None:
    insert_all(policy, [1])
    with pytest.raises(ValueError):
        policy.insert(meta(1))
    assert len(policy) == 1


def test_remove_and_reinsert(policy: EvictionPolicy) -> None:
    insert_all(policy, [1, 2, 3])
    policy.remove(PageId(2))
    assert PageId(2) not in policy and len(policy) == 2
    assert evict(policy, 2) is not None
    assert len(policy) == 0
    insert_all(policy, [1, 2, 3])
    assert len(policy) == 3
    victims = evict(policy, 3)
    assert victims is not None and sorted(victims) == [1, 2, 3]


class PolicyMachine(RuleBasedStateMachine):
    """Drives one policy with random calls; a plain set of tracked ids is the model."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.policy = create_policy(name)
        self.model: set[int] = set()

    @rule(page=IDS, priority=st.sampled_from([0.5, 1.0, 4.0]), position=st.integers(0, 7))
    def insert(self, page: int, priority: float, position: int) -> None:
        if page in self.model:
            return
        self.policy.insert(meta(page, priority=priority, position=position, length=8))
        self.model.add(page)

    @rule(page=IDS)
    def touch(self, page: int) -> None:
        self.policy.touch(PageId(page))

    @rule(page=IDS, priority=st.sampled_from([0.5, 2.0]), position=st.integers(0, 7))
    def update(self, page: int, priority: float, position: int) -> None:
        self.policy.update(meta(page, priority=priority, position=position, length=8))

    @rule(page=IDS)
    def remove(self, page: int) -> None:
        self.policy.remove(PageId(page))
        self.model.discard(page)

    @rule(n=st.integers(0, 6), protected=st.frozensets(IDS, max_size=8))
    def evict(self, n: int, protected: frozenset[int]) -> None:
        victims = evict(self.policy, n, protected)
        evictable = self.model - protected
        if len(evictable) < n:
            assert victims is None
            return
        assert victims is not None
        assert len(victims) == n == len(set(victims))
        assert set(victims) <= evictable
        self.model -= set(victims)

    @invariant()
    def tracked_set_matches_model(self) -> None:
        assert len(self.policy) == len(self.model)
        for page in range(16):
            assert (PageId(page) in self.policy) == (page in self.model)


@pytest.mark.parametrize("name", POLICIES)
def test_state_machine(name: str) -> None:
    run_state_machine_as_test(
        lambda: PolicyMachine(name),
        settings=settings(max_examples=150, stateful_step_count=60, deadline=None),
    )
