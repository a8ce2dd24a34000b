"""The field rules (kvtier.validate) shared by the engine's entry points and the daemon."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtier.errors import InvalidArgument, NotFound
from kvtier.validate import (
    MAX_IDS,
    check_ids,
    check_keys,
    check_name,
    check_page_size,
    check_slots,
    check_timeout,
)


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


@pytest.mark.parametrize(("bad", "why"), [
    ("", "must not be empty"),
    ("a" * 129, "must be at most 128 characters"),
    ("-lead", "starting with a letter or digit"),
    ("sp ace", "letters, digits"),
    ("caf\u00e9", "letters, digits"),
    ("abc\n", "letters, digits"),  # '$' matched before a trailing newline
    (7, "letters, digits"),
])
def test_names_are_refused_with_the_reason(bad, why):
    with pytest.raises(InvalidArgument, match=f"^pool.tenant: .*{why}"):
        check_name("pool.tenant", bad)


def test_names_at_the_limits_are_taken():
    assert check_name("tenant", "a" * 128) == "a" * 128
    assert check_name("tenant", "0._:@/-") == "0._:@/-"


def test_keys_are_1_to_64_bytes():
    assert check_keys("keys", [b"k", b"x" * 64]) == [b"k", b"x" * 64]
    assert check_keys("keys", ()) == []
    many = [bytes([i % 251 + 1]) * 32 for i in range(1024)]
    for bad in ([b""], [b"x" * 65], ["k"], [*many, b""], [*many[:500], bytearray(b"k"), *many],
                [*many, "k"]):
        with pytest.raises(InvalidArgument, match=r"^keys: each key must be 1\.\.64 bytes"):
            check_keys("keys", bad)

    class Key(bytes):
        pass

    assert check_keys("keys", [*many, Key(b"k")])[-1] == b"k"  # a bytes subclass is bytes


def test_slots_are_ints_in_range():
    assert check_slots("slots", range(8), 8) == list(range(8))
    assert check_slots("slots", [], 8) == []

    class Slot(int):
        pass

    assert check_slots("slots", [0, Slot(3)], 8) == [0, 3]  # an int subclass is an int
    for bad, shown in (([0, 8], "8"), ([-1], "-1"), ([1, True], "True"), ([1, 2.0], "2.0"),
                       ([0, "1"], "'1'"), ([*range(7)] * 200 + [np.int64(3)], repr(np.int64(3)))):
        with pytest.raises(InvalidArgument, match=rf"^slots: slot {re.escape(shown)} is outside"):
            check_slots("slots", bad, 8)


@pytest.mark.parametrize("ok", [4096, 8192, 64 << 20])
def test_page_sizes_taken(ok):
    assert check_page_size("page_size", ok) == ok


@pytest.mark.parametrize("bad", [0, -4096, 1000, 4097, (64 << 20) + 4096, 4096.0, True, "4096"])
def test_page_sizes_refused(bad):
    with pytest.raises(InvalidArgument, match=r"^page_size: must be 4KiB\.\.64MiB"):
        check_page_size("page_size", bad)


def test_timeouts():
    assert check_timeout("timeout_s", 0) == 0.0 and check_timeout("timeout_s", 2.5) == 2.5
    for bad in (-1.0, -1e-9, float("nan"), float("inf"), float("-inf"), True, "1"):
        with pytest.raises(InvalidArgument, match=r"^timeout_s: must be a finite number >= 0"):
            check_timeout("timeout_s", bad)
