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

``RowPolicy`` contract (the engine-side interface; one instance per tier; calls are serialised).
Every call takes a batch of page-table rows: a 1-D ``int64`` ndarray of distinct non-negative
ints. Per-row metadata comes as a ``RowMeta`` whose arrays are aligned with ``rows``.
    * ``insert(rows, meta)``: the rows became tracked, in order (first = oldest / least recent).
      Inserting a tracked row is an internal error: ``ValueError`` naming the first offender, and
      nothing changes.
    * ``remove(rows)``: the rows left the tier other than through ``evict``; untracked rows are
      ignored.
    * ``touch(rows)``: the rows were accessed, in order; untracked rows are ignored.
    * ``update(rows, meta)``: priority / position / length changed; not an access.
    * ``evict(n, protected, *, partial=False) -> ndarray | None``: names ``n`` unprotected
      tracked rows in eviction order (``int64``) and stops tracking them. ``protected(rows)``
      returns a bool mask aligned with ``rows`` (``True`` = may not be evicted); it may be called
      any number of times on any subsets of the tracked rows. With ``partial=False`` it returns
      ``None`` (and changes nothing) when fewer than ``n`` rows are evictable; with
      ``partial=True`` it returns up to ``n`` victims (possibly none), never ``None``.
      ``n == 0`` returns an empty array; ``n < 0`` raises ``ValueError``.
    * ``__len__``: number of tracked rows; ``contains(rows)``: bool mask, tracked or not.
    * ``uses_meta``: ``False`` for a policy that never reads ``meta`` (LRU); the engine then
      passes ``NO_META`` (empty arrays) on its hot paths instead of gathering three columns.
    * ``touch_after_insert``: ``False`` when a ``touch`` of rows right after their ``insert``
      changes nothing (pure recency: LRU); the engine then skips that touch.
    ``registry.create_row_policy(name)`` returns a policy that is natively a ``RowPolicy`` as is
    and wraps any other ``EvictionPolicy`` in ``adapter.PerPagePolicy`` (rows become page ids).

``AdmissionPolicy`` contract: ``admit(meta, hits) -> bool`` decides whether a page evicted from the
CPU tier is written to disk (``False`` = drop it). ``hits`` counts accesses since the page was
created.

Registry: ``kvtier.policy.registry.create_policy(name)`` resolves built-in names, the entry-point
group ``kvtier.policies`` and ``"module:Class"`` paths; unknown names raise ``ConfigError`` listing
the known ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.types import PageId, PageMeta

# ``protected(rows)``: bool mask aligned with ``rows``, True = may not be evicted.
RowFilter = Callable[[np.ndarray], np.ndarray]


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


@dataclass(slots=True, frozen=True)
class RowMeta:
    """Per-row metadata aligned with a rows array."""

    priority: np.ndarray  # float64, > 0; higher = keep longer
    position: np.ndarray  # int64, index of the page in its sequence
    length: np.ndarray  # int64, length of the sequence in pages


_NO_ROWS = np.empty(0, dtype=np.int64)
NO_META = RowMeta(np.empty(0, dtype=np.float64), _NO_ROWS, _NO_ROWS)  # for ``uses_meta = False``


class RowPolicy(ABC):
    """Tracks page-table rows of one tier in batches and names victims; see the module docstring."""

    uses_meta: ClassVar[bool] = True
    touch_after_insert: ClassVar[bool] = True

    @abstractmethod
    def insert(self, rows: np.ndarray, meta: RowMeta) -> None: ...

    @abstractmethod
    def remove(self, rows: np.ndarray) -> None: ...

    @abstractmethod
    def touch(self, rows: np.ndarray) -> None: ...

    @abstractmethod
    def update(self, rows: np.ndarray, meta: RowMeta) -> None: ...

    @abstractmethod
    def evict(
        self, n: int, protected: RowFilter, *, partial: bool = False
    ) -> np.ndarray | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def contains(self, rows: np.ndarray) -> np.ndarray: ...


class AdmissionPolicy(ABC):
    """Decides whether a page evicted from CPU is worth a disk write."""

    name: ClassVar[str] = ""

    @abstractmethod
    def admit(self, meta: PageMeta, hits: int) -> bool: ...
