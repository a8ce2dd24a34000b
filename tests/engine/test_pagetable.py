"""The page table's rows: ids with generations, reuse, lookups, uniqueness, grouping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import NotFound
from kvtier.pagetable import _S_NONE as S_NONE  # the table's own code for "no page"
from kvtier.pagetable import ROW_BITS, PageTable, by_value
from kvtier.types import PoolId, Tier

POOL = PoolId(7)


def _pages(table: PageTable, n: int, pool: int = POOL, tier: Tier = Tier.GPU) -> np.ndarray:
    rows = table.add(n, pool=pool, size=4096)
    table.settle(rows, tier, np.zeros(n, dtype=np.int64))
    return rows


def test_first_ids_are_the_rows_and_lookups_keep_order() -> None:
    table = PageTable(capacity=4)
    rows = _pages(table, 10)  # grows past the initial capacity
    ids = table.ids(rows).tolist()
    assert ids == list(range(1, 11))
    assert table.rows(POOL, ids[::-1]).tolist() == rows[::-1].tolist()
    assert table.live == 10


def test_a_removed_row_is_reused_under_a_new_id_and_the_old_id_is_gone() -> None:
    table = PageTable()
    rows = _pages(table, 3)
    old = table.id_of(int(rows[1]))
    table.remove(rows[1:2])
    assert table.state[rows[1]] == S_NONE and table.live == 2
    again = _pages(table, 1)
    assert again.tolist() == [rows[1]]
    new = table.id_of(int(again[0]))
    assert new != old and new >> ROW_BITS == 1
    assert table.rows(POOL, [new]).tolist() == [rows[1]]
    with pytest.raises(NotFound, match=str(old)):
        table.rows(POOL, [old])


@pytest.mark.parametrize("bad", [0, 99, 1 << 40 | 1, (1 << 63) + 5])
def test_unknown_ids_name_the_first_bad_one(bad: int) -> None:
    table = PageTable()
    ids = table.ids(_pages(table, 2)).tolist()
    with pytest.raises(NotFound, match=f"page {bad} "):
        table.rows(POOL, [ids[0], bad, ids[1]])


def test_pages_of_another_pool_are_not_found() -> None:
    table = PageTable()
    other = table.ids(_pages(table, 1, pool=8)).tolist()
    with pytest.raises(NotFound):
        table.rows(POOL, other)
    assert table.of_pool(PoolId(8)).tolist() == table.rows(PoolId(8), other).tolist()


@given(st.lists(st.integers(min_value=1, max_value=20), max_size=60))
def test_unique_keeps_first_occurrences_in_order(values: list[int]) -> None:
    table = PageTable(capacity=32)
    got = table.unique(np.array(values, dtype=np.int64)).tolist()
    assert got == list(dict.fromkeys(values))


def test_keys_are_forgotten_with_their_row() -> None:
    table = PageTable()
    rows = _pages(table, 2, pool=0, tier=Tier.CPU)
    table.add_key(int(rows[0]), b"k0", "tenant")
    assert table.keyed(b"k0") == rows[0]
    table.remove(rows[:1])
    assert table.keyed(b"k0") is None and not table.key_of and not table.tenant_of


def test_tier_counts_and_by_value() -> None:
    table = PageTable()
    _pages(table, 3, tier=Tier.GPU)
    _pages(table, 2, tier=Tier.CPU)
    assert table.tier_counts().tolist() == [3, 2, 0]
    groups = by_value(np.array([5, 3, 5, 3, 9]))
    assert [(k, pos.tolist()) for k, pos in groups] == [(5, [0, 2]), (3, [1, 3]), (9, [4])]


def test_a_removed_row_is_found_by_no_id_and_no_pool() -> None:
    # Without a state check, removal itself must make every id of the row unknown: the old
    # generation is stale, and the next one (not yet handed out) names a row with pool 0.
    table = PageTable()
    rows = _pages(table, 2)
    old = table.id_of(int(rows[0]))
    table.remove(rows[:1])
    guessed = (old >> ROW_BITS) + 1 << ROW_BITS | int(rows[0])
    for page in (old, guessed):
        with pytest.raises(NotFound, match=f"page {page} "):
            table.rows(POOL, [table.id_of(int(rows[1])), page])
    with pytest.raises(NotFound):  # keyed pages (pool 0) are no pool's pages
        table.rows(PoolId(0), [guessed])


def test_ids_text_caps_long_lists() -> None:
    table = PageTable()
    rows = _pages(table, 20)
    ids = table.ids(rows).tolist()
    assert table.ids_text(rows[:3]) == str(ids[:3])
    assert table.ids_text(rows) == f"{str(ids[:8])[:-1]}, ... and 12 more]"
