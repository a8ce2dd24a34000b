"""``OffloadedOptimizer``'s constructor arguments, checked in one place before anything is built.

    * ``check_options(...)``: raises :class:`~kvtier.errors.InvalidArgument` naming the first
      argument that is out of range, with the accepted values; nothing is allocated before.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import InvalidArgument

MODES = ("cpu", "gpu_stream")
TIERS = ("cpu", "disk")


def check_options(*, mode: str, state_tier: str, disk_path: str | None, disk_store: Any,
                  timeout_s: float) -> None:
    if mode not in MODES:
        raise InvalidArgument("mode", f"{mode!r}; accepted: {'|'.join(MODES)}")
    if state_tier not in TIERS:
        raise InvalidArgument("state_tier", f"{state_tier!r}; accepted: {'|'.join(TIERS)}")
    if state_tier == "disk" and disk_path is None and disk_store is None:
        raise InvalidArgument("disk_path", "state_tier='disk' needs disk_path or disk_store")
    if not isinstance(timeout_s, int | float) or not timeout_s > 0 \
            or timeout_s == float("inf"):
        raise InvalidArgument("timeout_s", f"{timeout_s!r}; accepted: a finite number > 0")
