"""Input checks shared by the engine's entry points. Each raises ``InvalidArgument(field, ...)``."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import cast

from kvtier.errors import InvalidArgument
from kvtier.types import PageId

MAX_IDS = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")


def check_name(field: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
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


def check_ids(field: str, ids: Sequence[int]) -> list[PageId]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise InvalidArgument(field, "must be a list of page ids")
    if not ids:
        raise InvalidArgument(field, "must not be empty")
    if len(ids) > MAX_IDS:
        raise InvalidArgument(field, f"at most {MAX_IDS} ids per call, got {len(ids)}")
    if set(map(type, ids)) == {int} and min(ids) > 0:  # the common case, checked in C
        return cast("list[PageId]", list(ids))  # PageId is an int at run time
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i <= 0:
            raise InvalidArgument(field, f"ids must be positive integers, got {i!r}")
    return [PageId(i) for i in ids]


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
        if not isinstance(k, bytes) or not 1 <= len(k) <= 64:
            raise InvalidArgument(field, "each key must be 1-64 bytes")
    return list(keys)
