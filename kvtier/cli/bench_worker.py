"""The synthetic engine behind ``kvtier bench``: one tenant, one pool, verified bytes.

Each ``Worker`` drives a real client: allocate and write known patterns, re-acquire and check
every byte, free, offload, store/lookup/load prefix keys. Mismatches are counted, never hidden.
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any


def pattern(page_size: int, tag: int) -> Any:
    """Deterministic page bytes for ``tag``: a header with the tag, then a fill byte."""
    import torch

    row = torch.full((page_size,), tag % 251, dtype=torch.uint8)
    head = struct.pack("<Q", tag)[: min(8, page_size)]
    row[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return row


# --- per-engine results ------------------------------------------------------------------------
@dataclass
class EngineResult:
    rpc: dict[str, list[float]] = field(default_factory=dict)
    restore: list[float] = field(default_factory=list)
    resident: list[float] = field(default_factory=list)
    ops: int = 0
    verified: int = 0
    mismatches: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Page:
    slot: int
    tag: int
    offloaded: bool = False


class Worker:
    """One synthetic engine: its own client, tenant and pool."""

    def __init__(
        self, index: int, client: Any, pool_pages: int, pages: int, page_size: int, seed: int
    ) -> None:
        self.index, self.client, self.page_size, self.pages = index, client, page_size, pages
        self.pool_pages = pool_pages
        self.rng = random.Random(seed * 1000 + index)
        self.result = EngineResult()
        self.released: dict[int, Page] = {}
        self.keys: list[tuple[bytes, int]] = []
        self.next_tag = index << 40
        self.att: Any = None

    def call(self, method: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.result.rpc.setdefault(method, []).append(time.perf_counter() - start)

    def tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    def tensor(self) -> Any:
        return self.att.tensor

    def run(self, deadline: float) -> None:
        from kvtier.errors import KVTierError

        self.att = self.call(
            "Attach", self.client.attach, self.pool_pages, page_size=self.page_size
        )
        steps = [
            (self.step_allocate, 3),
            (self.step_acquire, 4),
            (self.step_free, 1),
            (self.step_offload, 1),
            (self.step_prefix, 1),
        ]
        funcs, weights = zip(*steps, strict=True)
        while time.monotonic() < deadline:
            try:
                self.rng.choices(funcs, weights)[0]()
            except KVTierError as exc:
                self.note_error(exc)
            self.result.ops += 1

    def note_error(self, exc: Exception) -> None:
        from kvtier.errors import NotFound, PageLost

        if isinstance(exc, (PageLost, NotFound)):
            self.result.lost += 1
        elif len(self.result.errors) < 20:
            self.result.errors.append(f"{type(exc).__name__}: {exc}")
        else:
            self.result.errors.append("...")

    def step_allocate(self) -> None:
        if len(self.released) >= self.pages:
            return self.step_free()
        got = self.call("Allocate", self.client.allocate, self.att, self.rng.randint(1, 4))
        if not got:
            return None
        t = self.tensor()
        for page_id, slot in got:
            tag = self.tag()
            t[slot].copy_(pattern(self.page_size, tag))
            self.released[page_id] = Page(slot, tag)
        self.call("Release", self.client.release, self.att, [p for p, _ in got])
        return None

    def pick(self, n: int) -> list[int]:
        ids = list(self.released)
        return self.rng.sample(ids, min(n, len(ids)))

    def step_acquire(self) -> None:
        ids = self.pick(self.rng.randint(1, 4))
        if not ids:
            return
        start = time.perf_counter()
        try:
            slots = self.call("Acquire", self.client.acquire, self.att, ids)
        except Exception:
            self.forget_lost(ids)
            raise
        took = time.perf_counter() - start
        if slots is None:
            return
        restored = any(
            self.released[p].offloaded or self.released[p].slot != s
            for p, s in zip(ids, slots, strict=True)
        )
        (self.result.restore if restored else self.result.resident).append(took)
        self.verify(ids, slots)
        self.call("Release", self.client.release, self.att, ids)

    def forget_lost(self, ids: list[int]) -> None:
        """After a failed acquire, free the pages (some may be lost) and stop tracking them."""
        from kvtier.errors import KVTierError

        for p in ids:
            self.released.pop(p, None)
        with suppress(KVTierError):
            self.call("Free", self.client.free, self.att, ids)

    def verify(self, ids: list[int], slots: list[int]) -> None:
        import torch

        t = self.tensor()
        for p, s in zip(ids, slots, strict=True):
            page = self.released[p]
            self.result.verified += 1
            if not torch.equal(t[s], pattern(self.page_size, page.tag)):
                self.result.mismatches += 1
            page.slot, page.offloaded = s, False

    def step_free(self) -> None:
        ids = self.pick(self.rng.randint(1, 8))
        if ids:
            for p in ids:
                del self.released[p]
            self.call("Free", self.client.free, self.att, ids)

    def step_offload(self) -> None:
        ids = self.pick(self.rng.randint(1, 4))
        if ids and self.call("Offload", self.client.offload, self.att, ids):
            for p in ids:
                self.released[p].offloaded = True

    def step_prefix(self) -> None:
        if self.keys and self.rng.random() < 0.6:
            return self.reuse_prefix()
        got = self.call("Allocate", self.client.allocate, self.att, 1)
        if not got:
            return None
        page_id, slot = got[0]
        tag = self.tag()
        self.tensor()[slot].copy_(pattern(self.page_size, tag))
        key = f"bench-{self.index}-{tag}".encode()
        if self.call("Store", self.client.store, self.att, [key], [slot]):
            self.keys.append((key, tag))
        self.call("Free", self.client.free, self.att, [page_id])
        return None

    def reuse_prefix(self) -> None:
        key, tag = self.rng.choice(self.keys)
        if not self.call("Lookup", self.client.lookup, [key]):
            self.keys.remove((key, tag))
            return
        got = self.call("Allocate", self.client.allocate, self.att, 1)
        if not got:
            return
        page_id, slot = got[0]
        try:
            if self.call("Load", self.client.load, self.att, [key], [slot]) == 1:
                self.result.verified += 1
                if not bool((self.tensor()[slot] == pattern(self.page_size, tag)).all()):
                    self.result.mismatches += 1
        finally:
            self.call("Free", self.client.free, self.att, [page_id])


# --- embedded daemon ---------------------------------------------------------------------------
