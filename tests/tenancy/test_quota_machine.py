"""Random sequences of a noisy tenant's stores, allocations, offloads, reads and frees against a
quiet tenant that stays within its quota, on one small engine with CPU and disk quotas.

Invariants after every step (once transfers are idle): the quiet tenant's stored blocks are all
still in the CPU tier and load back exactly; no tenant holds more than its quota in any tier;
the ledger equals what the page table says. Every read of the noisy tenant's pages returns
exactly what was written, or ``PageLost`` (its own quota dropped them): never other bytes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import TierEngine
from kvtier.errors import PageLost
from kvtier.types import Tier
from tests.conftest import PAGE, small_config
from tests.tenancy.test_quotas import ledger_matches_table

SLOTS, CPU_PAGES, DISK_PAGES = 4, 8, 48
QUOTAS = {"a": (3, 12), "b": (3, 24)}  # tenant -> (CPU pages, disk pages)
PICK = st.integers(0, 63)  # which of a's pages a rule takes (``QuotaMachine._page``)


class QuotaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        spec = ";".join(f"{t}=cpu:{c * PAGE},disk:{d * PAGE}" for t, (c, d) in QUOTAS.items())
        cfg = small_config(
            Path(self.dir.name),
            cpu_memory_gb=CPU_PAGES * PAGE / 2**30,
            disk_gb=DISK_PAGES * PAGE / 2**30,
            disk_admission="always",
            tenant_quotas=spec,
        )
        self.engine = TierEngine(cfg)
        self.a, self.b = self.engine.attach("a", SLOTS), self.engine.attach("b", SLOTS)
        self.pages: dict[int, int] = {}  # a's page id -> fill byte
        self.keys = {"a": {}, "b": {}}  # tenant -> key -> fill byte
        self.next_key = 0

    def teardown(self) -> None:
        self.engine.close(grace=5)
        self.dir.cleanup()

    def _store(self, tenant: str, n: int, value: int) -> None:
        pool = self.a if tenant == "a" else self.b
        got = self.engine.allocate(pool.pool_id, n)
        assert got is not None
        keys = []
        for i, (_, slot) in enumerate(got):
            pool.segments[0][slot].fill_((value + i) % 251)
            keys.append(f"{tenant}-{self.next_key}".encode())
            self.keys[tenant][keys[-1]] = (value + i) % 251
            self.next_key += 1
        assert self.engine.store(pool.pool_id, keys, [s for _, s in got]) == n
        self.engine.free(pool.pool_id, [p for p, _ in got])

    @rule(n=st.integers(1, SLOTS), value=st.integers(0, 250))
    def a_stores(self, n: int, value: int) -> None:
        self._store("a", n, value)

    @precondition(lambda self: len(self.keys["b"]) < QUOTAS["b"][0])
    @rule(value=st.integers(0, 250))
    def b_stores_within_its_quota(self, value: int) -> None:
        self._store("b", 1, value)

    @rule(n=st.integers(1, 3), value=st.integers(0, 250))
    def a_allocates_and_writes(self, n: int, value: int) -> None:
        got = self.engine.allocate(self.a.pool_id, n)
        if got is None:
            return
        for pid, slot in got:
            self.a.segments[0][slot].fill_(value)
            self.pages[pid] = value
        self.engine.release(self.a.pool_id, [p for p, _ in got])

    def _page(self, pick: int) -> int:
        """One of a's pages by a drawn number. The draws never depend on the pages: which ones
        exist can follow the engine's timing (an allocation that found no free slot yet), and
        Hypothesis refuses draws that change between runs of the same choices."""
        pages = sorted(self.pages)
        return pages[pick % len(pages)]

    @precondition(lambda self: bool(self.pages))
    @rule(picks=st.lists(PICK, min_size=1, max_size=4))
    def a_offloads(self, picks: list[int]) -> None:
        ids = [self._page(p) for p in picks]
        self.engine.offload(self.a.pool_id, list(dict.fromkeys(ids)))

    @precondition(lambda self: bool(self.pages))
    @rule(pick=PICK)
    def a_reads_back(self, pick: int) -> None:
        pid = self._page(pick)
        try:
            got = self.engine.read(self.a.pool_id, pid)
        except PageLost:
            self.engine.free(self.a.pool_id, [pid])
            del self.pages[pid]
            return
        assert bool((got == self.pages[pid]).all()), f"page {pid}: other bytes"

    @precondition(lambda self: bool(self.pages))
    @rule(pick=PICK)
    def a_frees(self, pick: int) -> None:
        pid = self._page(pick)
        self.engine.free(self.a.pool_id, [pid])
        del self.pages[pid]

    @invariant()
    def quiet_tenant_keeps_its_blocks(self) -> None:
        keys = list(self.keys["b"])
        assert self.engine.lookup("b", keys) == [Tier.CPU] * len(keys)
        if not keys:
            return
        got = self.engine.allocate(self.b.pool_id, len(keys))
        assert got is not None
        slots = [s for _, s in got]
        try:
            assert self.engine.load(self.b.pool_id, keys, slots) == len(keys)
            for key, slot in zip(keys, slots, strict=True):
                want = torch.full((PAGE,), self.keys["b"][key], dtype=torch.uint8)
                assert torch.equal(self.b.segments[0][slot], want)
        finally:
            self.engine.free(self.b.pool_id, [p for p, _ in got])

    @invariant()
    def nobody_holds_more_than_its_quota(self) -> None:
        ledger_matches_table(self.engine)  # waits for idle first
        ledger = self.engine._core.ledger
        for tenant, (cpu, disk) in QUOTAS.items():
            owner = ledger.find(tenant)
            assert ledger.used(Tier.CPU)[owner] <= cpu * PAGE, tenant
            assert ledger.used(Tier.DISK)[owner] <= disk * PAGE, tenant


QuotaMachine.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQuotaMachine = QuotaMachine.TestCase
