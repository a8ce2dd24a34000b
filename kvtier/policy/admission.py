"""Disk admission: which pages evicted from the CPU tier are worth a disk write.

``hits`` is the number of accesses since the page was created, *not* counting the creation
itself (so a page written once and never read again has ``hits == 0``).

* ``AlwaysAdmit`` (``"always"``): every page goes to disk.
* ``ReusedAdmit`` (``"reused"``, the default): only pages that were reused, i.e. ``hits >=
  min_hits`` (1 by default). One-shot prefixes never cost a disk write, which saves SSD wear.
* ``NeverAdmit`` (``"never"``): nothing goes to disk; evicted CPU pages are dropped.

``create_admission(name)`` builds one by name and raises ``ConfigError`` naming
``KVCACHED_OFFLOAD_DISK_ADMISSION`` for an unknown name.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from kvtier.config import ENV_PREFIX
from kvtier.errors import ConfigError
from kvtier.policy.base import AdmissionPolicy
from kvtier.types import PageMeta


class AlwaysAdmit(AdmissionPolicy):
    """Admits every page."""

    name: ClassVar[str] = "always"

    def admit(self, meta: PageMeta, hits: int) -> bool:
        return True


class NeverAdmit(AdmissionPolicy):
    """Admits no page: the disk tier only ever holds what was stored before."""

    name: ClassVar[str] = "never"

    def admit(self, meta: PageMeta, hits: int) -> bool:
        return False


class ReusedAdmit(AdmissionPolicy):
    """Admits a page only if it was accessed at least ``min_hits`` times after its creation."""

    name: ClassVar[str] = "reused"

    def __init__(self, *, min_hits: int = 1) -> None:
        if min_hits < 0:
            raise ValueError(f"min_hits must be >= 0, got {min_hits}")
        self.min_hits = min_hits

    def admit(self, meta: PageMeta, hits: int) -> bool:
        return hits >= self.min_hits


_ADMISSIONS: Mapping[str, type[AdmissionPolicy]] = MappingProxyType(
    {cls.name: cls for cls in (AlwaysAdmit, ReusedAdmit, NeverAdmit)}
)


def create_admission(name: str) -> AdmissionPolicy:
    """Build the admission policy called ``name`` (case-insensitive)."""
    cls = _ADMISSIONS.get(name.strip().lower())
    if cls is None:
        accepted = "|".join(_ADMISSIONS)
        raise ConfigError(f"{ENV_PREFIX}DISK_ADMISSION={name!r} is invalid; accepted: {accepted}")
    return cls()
