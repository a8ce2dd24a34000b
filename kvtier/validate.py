"""The field rules of kvtier: input checks of the engine's entry points and of the daemon.

Each check raises ``InvalidArgument(field, ...)`` naming the field it was given, and returns the
value in the form the engine takes. This is the one place a field rule is written: the daemon's
``server/validate.py`` adds only wire-level limits (how many ids one request may carry, proto3's
"0 means unset") and calls these for the rest.
"""

from __future__ import annotations

import array
import math
import re
from collections.abc import Hashable, Sequence

import numpy as np

from kvtier.errors import InvalidArgument, NotFound

MAX_IDS = 1 << 20
MAX_NAME_CHARS = 128
MAX_KEY_BYTES = 64
MAX_PAGE_SIZE = 64 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")  # whole string: fullmatch


def check_name(field: str, value: object) -> str:
    """A tenant (or other) name: 1..128 characters of ASCII letters, digits and ``._:@/-``,
    starting with a letter or digit."""
    if isinstance(value, str) and not value:
        raise InvalidArgument(field, "must not be empty")
    if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(field, f"must be at most {MAX_NAME_CHARS} characters")
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidArgument(
            field,
            "must be 1-128 characters of letters, digits and ._:@/- "
            f"starting with a letter or digit, got {value!r}",
        )
    return value


def check_priority(field: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(field, f"must be a finite number > 0, got {value!r}")
    return float(value)


def check_ids(field: str, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Page ids as an ``int64`` array, converted once in C (a million ids in a few ms).

    Accepts a sequence of integers (Python ints, or anything with ``__index__`` such as numpy
    integers; ``bool`` counts as an int, as in Python) or a 1-D integer ndarray. Raises
    ``InvalidArgument`` naming ``field`` for an empty, oversized or non-integer list or an id
    <= 0, and ``NotFound`` for an id of 2**63 or more (no page can have it).
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            got = f"{ids.dtype} {ids.shape}"
            raise InvalidArgument(field, f"must be a 1-D integer array, got {got}")
    elif isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise InvalidArgument(field, "must be a list of page ids")
    if not len(ids):
        raise InvalidArgument(field, "must not be empty")
    if len(ids) > MAX_IDS:
        raise InvalidArgument(field, f"at most {MAX_IDS} ids per call, got {len(ids)}")
    arr = _array_int64s(ids) if isinstance(ids, np.ndarray) else _int64s(field, ids)
    low = int(arr.argmin())
    if arr[low] <= 0:
        raise InvalidArgument(field, f"ids must be positive integers, got {int(arr[low])}")
    return arr


def _array_int64s(ids: np.ndarray) -> np.ndarray:
    if ids.dtype.kind == "u" and int(ids.max()) >= 1 << 63:
        raise NotFound(f"page {int(ids.max())} not found")
    return ids.astype(np.int64, copy=False)


def _int64s(field: str, ids: Sequence[int]) -> np.ndarray:
    try:
        return np.frombuffer(array.array("q", ids), dtype=np.int64)
    except TypeError:
        bad = next(i for i in ids if not hasattr(type(i), "__index__"))
        raise InvalidArgument(field, f"ids must be positive integers, got {bad!r}") from None
    except OverflowError:
        bad = next(i for i in ids if not -(1 << 63) <= i < 1 << 63)
        if bad < 0:
            raise InvalidArgument(field, f"ids must be positive integers, got {bad}") from None
        raise NotFound(f"page {bad} not found") from None


def check_slots(field: str, slots: Sequence[int], num_slots: int) -> list[int]:
    if isinstance(slots, str | bytes) or not isinstance(slots, Sequence):
        raise InvalidArgument(field, "must be a list of slot indexes")
    for s in slots:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots:
            raise InvalidArgument(field, f"slot {s!r} is outside [0, {num_slots})")
    return list(slots)


def check_keys(field: str, keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InvalidArgument(field, "must be a list of byte strings")
    if len(keys) > MAX_IDS:
        raise InvalidArgument(field, f"at most {MAX_IDS} keys per call")
    for k in keys:
        if not isinstance(k, bytes) or not 1 <= len(k) <= MAX_KEY_BYTES:
            raise InvalidArgument(field, f"each key must be 1..{MAX_KEY_BYTES} bytes")
    return list(keys)


def check_page_size(field: str, value: object) -> int:
    """A page size in bytes: 4 KiB..64 MiB and a multiple of 4 KiB."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or not (4096 <= value <= MAX_PAGE_SIZE and value % 4096 == 0)):
        raise InvalidArgument(field, f"must be 4KiB..64MiB and a multiple of 4KiB, got {value}")
    return value


def check_timeout(field: str, value: object) -> float:
    """A wait in seconds: a finite number >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidArgument(field, f"must be a finite number >= 0, got {value!r}")
    return float(value)


def unrepeated(
    keys: Sequence[bytes], slots: Sequence[int]
) -> tuple[Sequence[bytes], Sequence[int]]:
    """A load's keys and slots up to the first key repeated in them: a prefix of chained keys
    never repeats one, so the prefix ends there (a repeat would restore, protect and copy one
    page twice). Unchanged when their lengths differ or a key can't be hashed: ``args`` then
    names what is wrong."""
    if len(keys) != len(slots):
        return keys, slots
    try:
        n = first_repeat(keys)
    except TypeError:
        return keys, slots
    return keys[:n], slots[:n]


def first_repeat(items: Sequence[Hashable]) -> int:
    """Index of the first item equal to an earlier one (``len(items)`` when none is)."""
    if len(set(items)) == len(items):  # the usual case: one pass in C
        return len(items)
    seen: set[Hashable] = set()
    for i, item in enumerate(items):
        if item in seen:
            return i
        seen.add(item)
    return len(items)
