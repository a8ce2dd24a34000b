"""Input checks shared by the engine's entry points: page id lists and arrays."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import InvalidArgument, NotFound
from kvtier.validate import MAX_IDS, check_ids


def test_ids_become_one_int64_array_and_an_int64_array_is_taken_as_is():
    got = check_ids("page_ids", [3, 1, np.int32(7)])
    assert got.dtype == np.int64 and got.tolist() == [3, 1, 7]
    arr = np.array([5, 6], dtype=np.int64)
    assert check_ids("page_ids", arr) is arr
    assert check_ids("page_ids", np.array([5], dtype=np.uint32)).tolist() == [5]


@pytest.mark.parametrize(
    "bad",
    [[], [1.5], ["3"], [1, None], [0], [4, -2], "12", b"12", 7, np.zeros((2, 2), np.int64),
     np.array([1.0])],
)
def test_bad_ids_name_the_field(bad):
    with pytest.raises(InvalidArgument, match="page_ids"):
        check_ids("page_ids", bad)


def test_ids_no_page_can_have_are_not_found():
    with pytest.raises(NotFound, match=str((1 << 63) + 5)):
        check_ids("page_ids", [1, (1 << 63) + 5])
    with pytest.raises(NotFound):
        check_ids("page_ids", np.array([1 << 63], dtype=np.uint64))
    with pytest.raises(InvalidArgument, match="page_ids"):
        check_ids("page_ids", [-(1 << 70)])


def test_too_many_ids_are_refused_before_conversion():
    with pytest.raises(InvalidArgument, match=f"at most {MAX_IDS}"):
        check_ids("page_ids", range(1, MAX_IDS + 2))
