"""Whether the caller of a call still waits for its result.

Work done for a caller that has gone may touch memory the caller has since reused: a load
copies into the caller's slots, and an engine hands the slots of a load that failed (it timed
out) to a recompute or to another request. Such work stops at its next step instead of going
on once the daemon gets to it (paused by a debugger, a VM pause, a swap storm; or slow).

Contract:
    * ``Caller(deadline=inf)``: waiting until ``give_up()`` (it cancelled) or until ``deadline``
      (``time.monotonic()`` seconds) has passed; ``gone`` is then True for good.
    * A copy batch carrying a caller (``Moves.caller``) that is gone when its turn to launch
      comes is not launched: every result is False (``kvtier/scheduler.py``). A load checks
      before each chunk or layer group and stops there (``kvtier/prefix/store.py``,
      ``kvtier/prefix/layers.py``); a chunk already launched still lands. ``patience`` ends a
      load's wait for disk reads once the caller is gone.
"""

from __future__ import annotations

import math
import time


class Caller:
    """See the module docstring."""

    __slots__ = ("_deadline", "_gave_up")

    def __init__(self, deadline: float = math.inf) -> None:
        self._deadline = deadline
        self._gave_up = False

    def give_up(self) -> None:
        self._gave_up = True

    @property
    def gone(self) -> bool:
        return self._gave_up or time.monotonic() >= self._deadline

    def patience(self, landed: int) -> float:
        """A wait for disk reads (``kvtier/prefix/resident.py``'s ``Patience``): as long as it
        takes while the caller waits, none once it is gone."""
        return -math.inf if self.gone else math.inf
