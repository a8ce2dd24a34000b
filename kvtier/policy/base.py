"""Eviction and admission policies: *who leaves*, never *how*.

``EvictionPolicy`` contract (one instance per tier; the engine serialises all calls under its lock):
    * ``insert(meta)``: the page became resident (evictable or pinned) in this tier. Inserting a
      tracked page is an internal error.
    * ``touch(page_id)``: the page was accessed (acquired, read, looked up). Unknown ids are
      ignored.
    * ``update(meta)``: priority / position / length changed.
    * ``remove(page_id)``: the page left the tier other than through ``evict`` (freed, restored up).
      Unknown ids are ignored.
    * ``evict(n, protected) -> list[PageId] | None``: names exactly ``n`` victims not in
      ``protected`` (pinned or in flight), in eviction order, and stops tracking them; ``None`` (and
      no change) when fewer than ``n`` are evictable. ``n == 0`` returns ``[]``.
    * ``__len__``: number of tracked pages.
    * Batch forms, for the engine's per-batch paths: ``insert_many(metas)``,
      ``remove_many(page_ids)`` and ``touch_many(page_ids)`` leave the policy exactly as the
      per-page calls in that order would. The defaults loop over the per-page calls, so a policy
      only overrides them to go faster; ``insert_many`` of a tracked (or repeated) id is the same
      internal error as ``insert``.
    The engine re-inserts a victim whose move failed. A policy never touches page bytes or slots.

``AdmissionPolicy`` contract: ``admit(meta, hits) -> bool`` decides whether a page evicted from the
CPU tier is written to disk (``False`` = drop it). ``hits`` counts accesses since the page was
created.

Registry: ``kvtier.policy.registry.create_policy(name)`` resolves built-in names, the entry-point
group ``kvtier.policies`` and ``"module:Class"`` paths; unknown names raise ``ConfigError`` listing
the known ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Sequence
from typing import ClassVar

from kvtier.types import PageId, PageMeta


class EvictionPolicy(ABC):
    """Tracks pages of one tier and names victims. See the module docstring for the contract."""

    name: ClassVar[str] = ""

    @abstractmethod
    def insert(self, meta: PageMeta) -> None: ...

    @abstractmethod
    def touch(self, page_id: PageId) -> None: ...

    @abstractmethod
    def update(self, meta: PageMeta) -> None: ...

    @abstractmethod
    def remove(self, page_id: PageId) -> None: ...

    @abstractmethod
    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def insert_many(self, metas: Sequence[PageMeta]) -> None:
        """``insert`` of each, in order."""
        for meta in metas:
            self.insert(meta)

    def remove_many(self, page_ids: Iterable[PageId]) -> None:
        """``remove`` of each, in order."""
        for page_id in page_ids:
            self.remove(page_id)

    def touch_many(self, page_ids: Iterable[PageId]) -> None:
        """``touch`` of each, in order."""
        for page_id in page_ids:
            self.touch(page_id)

    def __contains__(self, page_id: object) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


class AdmissionPolicy(ABC):
    """Decides whether a page evicted from CPU is worth a disk write."""

    name: ClassVar[str] = ""

    @abstractmethod
    def admit(self, meta: PageMeta, hits: int) -> bool: ...
