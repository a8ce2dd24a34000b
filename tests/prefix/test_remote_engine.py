"""The remote tier through the whole engine, on the in-memory keyed medium (real engines, real
bytes): two engines sharing one medium stand for two daemons sharing one store."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import Tier, TierEngine
from kvtier.caller import Caller
from kvtier.errors import ConfigError
from kvtier.prefix.salt import salt_key
from kvtier.tiers.frame import Framer
from kvtier.tiers.keyed import DictMedium
from tests.conftest import PAGE, small_config

SECRET = b"0123456789abcdef-cluster-secret"


def secret_file(tmp_path: Any, data: bytes = SECRET, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture
def pair(tmp_path):
    """Two engines (no disk) on one shared medium, same secret."""
    medium = DictMedium()
    secret = secret_file(tmp_path)
    engines = [
        TierEngine(small_config(None, remote_secret_file=secret), remote_medium=medium)
        for _ in range(2)
    ]
    yield medium, engines
    for e in engines:
        e.close(grace=5)


def stored_blocks(engine: TierEngine, tenant: str, n: int, seed: int = 1) -> tuple[Any, list]:
    pool = engine.attach(tenant, 8)
    slots = [s for _, s in engine.allocate(pool.pool_id, n)]
    gen = torch.Generator().manual_seed(seed)
    data = []
    for s in slots:
        pool.segments[0][s].copy_(torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=gen))
        data.append(pool.segments[0][s].clone())
    return (pool, slots), data


def test_a_store_in_one_engine_is_found_and_loaded_exactly_by_another(pair):
    medium, (a, b) = pair
    (pool_a, slots_a), data = stored_blocks(a, "t", 3)
    keys = [b"k0", b"k1", b"k2"]
    assert a.store(pool_a.pool_id, keys, slots_a) == 3
    assert a.prefix._core.remote.flush(5)
    assert len(medium.data) == 3 and all(k.startswith(b"kvtier:") for k in medium.data)
    assert b.lookup("t", keys) == [Tier.REMOTE] * 3
    assert b.lookup("other-tenant", keys) == []  # another tenant finds nothing
    pool_b = b.attach("t", 8)
    slots_b = [s for _, s in b.allocate(pool_b.pool_id, 3)]
    assert b.load(pool_b.pool_id, [*keys, b"nope"], [*slots_b, slots_b[0]]) == 3
    for s, want in zip(slots_b, data, strict=True):
        assert torch.equal(pool_b.segments[0][s], want)
    assert b.lookup("t", keys) == [Tier.CPU] * 3  # landed in the CPU tier like a disk hit
    assert not a.prefix._core.table.protect.any() and not b.prefix._core.table.protect.any()
    assert b.stats().tiers[1].used_bytes == 3 * PAGE  # the landed pages' slots, no more
    assert b.load(pool_b.pool_id, keys, slots_b) == 3  # local now: nothing staged, nothing leaked
    assert b.stats().tiers[1].used_bytes == 3 * PAGE
    stats = b.stats()
    assert stats.remote is not None and stats.remote.read_pages == 3
    assert stats.counters.hits[Tier.REMOTE] == 3
    assert a.stats().remote.written_pages == 3
    assert a.stats().remote.written_bytes == sum(len(v) for v in medium.data.values())
    assert stats.remote.read_bytes == a.stats().remote.written_bytes  # both: values' bytes


def test_a_store_larger_than_one_transfer_batch_is_written_whole(tmp_path):
    """The scheduler splits a copy batch of more than BATCH_MB: every stored block still goes."""
    medium, n = DictMedium(), 300  # 4 KiB pages, 1 MiB batches: 256 pages a batch
    cfg = small_config(None, remote_secret_file=secret_file(tmp_path),
                       cpu_memory_gb=2 * n * PAGE / 2**30, gpu_memory_gb=2 * n * PAGE / 2**30)
    with TierEngine(cfg, remote_medium=medium) as e:
        pool = e.attach("t", n)
        slots = [s for _, s in e.allocate(pool.pool_id, n)]
        pool.segments[0][slots] = torch.randint(0, 256, (n, PAGE), dtype=torch.uint8)
        keys = [b"big%d" % i for i in range(n)]
        assert e.store(pool.pool_id, keys, slots) == n
        assert e.prefix._core.remote.flush(10)
        assert len(medium.data) == n


def test_lookup_answers_local_first_then_remote(pair):
    _, (a, b) = pair
    (pool_a, slots_a), _ = stored_blocks(a, "t", 2)
    assert a.store(pool_a.pool_id, [b"x0", b"x1"], slots_a) == 2
    assert a.prefix._core.remote.flush(5)
    (pool_b, slots_b), _ = stored_blocks(b, "t", 1, seed=9)
    assert b.store(pool_b.pool_id, [b"x0"], slots_b) == 1
    assert b.lookup("t", [b"x0", b"x1", b"x2"]) == [Tier.CPU, Tier.REMOTE]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other_key"])
def test_a_damaged_or_foreign_value_is_a_counted_miss(pair, damage):
    medium, (a, b) = pair
    (pool_a, slots_a), _ = stored_blocks(a, "t", 2)
    assert a.store(pool_a.pool_id, [b"d0", b"d1"], slots_a) == 2
    assert a.prefix._core.remote.flush(5)
    framer = Framer(SECRET)
    from kvtier.prefix import salt_key

    key0 = framer.store_key(salt_key("t", b"d0"))
    value = medium.data[key0]
    if damage == "flip":
        medium.data[key0] = value[:100] + bytes([value[100] ^ 1]) + value[101:]
    elif damage == "truncate":
        medium.data[key0] = value[:-1]
    elif damage == "foreign":  # framed right, but under another cluster's secret
        medium.data[key0] = Framer(b"another-secret-of-16-bytes").frame(
            salt_key("t", b"d0"), value[40 : 40 + PAGE]
        )
    else:  # a genuine value of another block (another tenant's), copied under this key
        medium.data[key0] = medium.data[framer.store_key(salt_key("t", b"d1"))]
    pool_b = b.attach("t", 8)
    slots_b = [s for _, s in b.allocate(pool_b.pool_id, 2)]
    assert b.load(pool_b.pool_id, [b"d0", b"d1"], slots_b) == 0
    rejected = b.stats().remote.rejected
    want = {"flip": "mac", "truncate": "length", "foreign": "mac", "other_key": "key"}[damage]
    assert rejected == {want: 1}


def test_the_store_down_answers_local_only_and_drops_writes(pair):
    medium, (a, b) = pair
    medium.down = True
    (pool_a, slots_a), _ = stored_blocks(a, "t", 2)
    assert a.store(pool_a.pool_id, [b"q0", b"q1"], slots_a) == 2  # local store unaffected
    assert a.prefix._core.remote.flush(5)
    assert a.stats().remote.dropped == {"store": 2}
    assert a.lookup("t", [b"q0", b"q1"]) == [Tier.CPU, Tier.CPU]
    assert b.lookup("t", [b"q0"]) == []
    assert b.stats().remote.reachable is False
    medium.down = False  # back: the next store is written
    (pool_c, slots_c), _ = stored_blocks(a, "t", 1, seed=3)
    assert a.store(pool_c.pool_id, [b"q2"], slots_c) == 1
    assert a.prefix._core.remote.flush(5)
    assert b.lookup("t", [b"q2"]) == [Tier.REMOTE]


@pytest.mark.parametrize("admission", ["reused", "never"])
def test_admission_reused_writes_on_first_reuse_never_writes_nothing(tmp_path, admission):
    medium = DictMedium()
    cfg = small_config(None, remote_secret_file=secret_file(tmp_path), remote_admission=admission)
    with TierEngine(cfg, remote_medium=medium) as e:
        (pool, slots), _ = stored_blocks(e, "t", 2)
        assert e.store(pool.pool_id, [b"r0", b"r1"], slots) == 2
        assert e.prefix._core.remote.flush(5)
        assert medium.data == {}
        assert e.load(pool.pool_id, [b"r0"], slots[:1]) == 1
        assert e.prefix._core.remote.flush(5)
        assert len(medium.data) == (1 if admission == "reused" else 0)
        assert not e.prefix._core.table.protect.any()  # every page held for a copy let go


def test_a_load_longer_than_one_fetch_goes_on_fetching(pair, monkeypatch):
    """One fetch brings a bounded window; a Load of more blocks than that fetches on from
    where it stopped, and a miss past the stored ones still ends it."""
    import kvtier.prefix.remote as remote_mod

    monkeypatch.setattr(remote_mod, "MAX_FETCH_BYTES", 3 * PAGE)  # 3 blocks a fetch
    _medium, (a, b) = pair
    (pool_a, slots_a), data = stored_blocks(a, "t", 8)
    keys = [b"w%d" % i for i in range(8)]
    assert a.store(pool_a.pool_id, keys, slots_a) == 8
    assert a.prefix._core.remote.flush(5)
    pool_b = b.attach("t", 8)
    slots_b = [s for _, s in b.allocate(pool_b.pool_id, 8)]
    assert b.load(pool_b.pool_id, [*keys, b"nope", b"w0"], [*slots_b, 0, 1]) == 8
    for s, want in zip(slots_b, data, strict=True):
        assert torch.equal(pool_b.segments[0][s], want)
    assert b.stats().remote.read_pages == 8

def test_secret_file_must_be_private_and_present(tmp_path):
    medium = DictMedium()
    loose = secret_file(tmp_path, name="loose")
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match=r"KVCACHED_OFFLOAD_REMOTE_SECRET_FILE.*chmod 600"):
        TierEngine(small_config(None, remote_secret_file=loose), remote_medium=medium)
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_REMOTE_SECRET_FILE"):
        TierEngine(small_config(None), remote_medium=medium)
    folder = tmp_path / "folder"  # was refused as "readable by group or others"
    folder.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"REMOTE_SECRET_FILE.*not a regular file"):
        TierEngine(small_config(None, remote_secret_file=str(folder)), remote_medium=medium)
    short = secret_file(tmp_path, b"short", name="short")
    with pytest.raises(ConfigError, match=r"KVCACHED_OFFLOAD_REMOTE_SECRET_FILE.*16 bytes"):
        TierEngine(small_config(None, remote_secret_file=short), remote_medium=medium)


def test_a_full_write_queue_drops_and_counts(tmp_path):
    medium = DictMedium()
    cfg = small_config(None, remote_secret_file=secret_file(tmp_path), remote_inflight_mb=1)
    with TierEngine(cfg, remote_medium=medium) as e:
        remote = e.prefix._core.remote
        big = [(bytes([i]) * 16, remote.frame_buffer(bytes([i]) * 16, 600 * 1024)[0])
               for i in range(2)]
        assert remote.offer(big) == 1  # the second does not fit in 1 MiB in flight
        assert remote.flush(5)
        assert e.stats().remote.dropped == {"queue_full": 1}


def test_a_block_stored_while_staged_keeps_its_page_and_frees_the_staged_slot(pair):
    from kvtier.prefix import salt_key
    from kvtier.prefix.shared import Stager, land

    _, (a, b) = pair
    (pool_a, slots_a), _ = stored_blocks(a, "t", 1)
    assert a.store(pool_a.pool_id, [b"m0"], slots_a) == 1
    assert a.prefix._core.remote.flush(5)
    core = b.prefix._core
    salted = [salt_key("t", b"m0")]
    with core.cond:
        owner = core.ledger.owner("t")
    stager = Stager(core, "t", owner, PAGE)
    assert core.remote.fetch_each(salted, PAGE, stager.take) == 1
    staged = stager.staged(salted)
    assert staged is not None and b.stats().tiers[1].used_bytes == PAGE
    assert int(core.ledger.incoming[Tier.CPU, owner]) == PAGE  # the tenant's, while staged
    (pool_b, slots_b), mine = stored_blocks(b, "t", 1, seed=42)
    assert b.store(pool_b.pool_id, [b"m0"], slots_b) == 1  # stored locally meanwhile
    with core.cond:
        assert land(core, staged) == 0
    assert b.stats().tiers[1].used_bytes == PAGE  # the staged slot went back
    assert int(core.ledger.incoming[Tier.CPU, owner]) == 0
    pool_b.segments[0][slots_b[0]].zero_()
    assert b.load(pool_b.pool_id, [b"m0"], slots_b) == 1
    assert torch.equal(pool_b.segments[0][slots_b[0]], mine[0])  # the local page won


def test_remote_hits_count_against_the_loading_tenants_cpu_quota(tmp_path):
    """Blocks fetched from the shared store land as the loading tenant's CPU pages: its quota
    bounds them (its own pages make the room), and the quiet tenant's blocks stay."""
    from kvtier.prefix import salt_key
    from tests.tenancy.test_quotas import ledger_matches_table

    medium, secret = DictMedium(), secret_file(tmp_path)
    writer = TierEngine(small_config(None, remote_secret_file=secret), remote_medium=medium)
    reader = TierEngine(small_config(
        None, remote_secret_file=secret, cpu_memory_gb=8 * PAGE / 2**30,
        tenant_quotas=f"noisy=cpu:{2 * PAGE};quiet=cpu:{4 * PAGE}",
    ), remote_medium=medium)
    try:
        (pool_w, slots_w), data = stored_blocks(writer, "noisy", 6)
        far = [b"n%d" % i for i in range(6)]
        assert writer.store(pool_w.pool_id, far, slots_w) == 6
        assert writer.prefix._core.remote.flush(5)
        (pool_q, slots_q), quiet_data = stored_blocks(reader, "quiet", 4, seed=5)
        mine = [b"q%d" % i for i in range(4)]
        assert reader.store(pool_q.pool_id, mine, slots_q) == 4
        pool_n = reader.attach("noisy", 8)
        slots_n = [s for _, s in reader.allocate(pool_n.pool_id, 6)]
        loaded = reader.load(pool_n.pool_id, far, slots_n)
        assert 1 <= loaded <= 6
        for s, want in zip(slots_n[:loaded], data, strict=False):
            assert torch.equal(pool_n.segments[0][s], want)
        ledger_matches_table(reader)
        core = reader.prefix._core
        noisy, quiet = core.ledger.find("noisy"), core.ledger.find("quiet")
        assert noisy and int(core.ledger.used(Tier.CPU)[noisy]) <= 2 * PAGE
        with core.cond:  # the fetched blocks still held here are noisy's, within its quota
            rows = [r for r in (core.table.keyed(salt_key("noisy", k)) for k in far)
                    if r is not None]
            assert 1 <= len(rows) <= 2
            assert all(int(core.table.owner[r]) == noisy for r in rows)
        assert reader.lookup("quiet", mine) == [Tier.CPU] * 4
        slots_q2 = [s for _, s in reader.allocate(pool_q.pool_id, 4)]
        assert reader.load(pool_q.pool_id, mine, slots_q2) == 4
        for s, want in zip(slots_q2, quiet_data, strict=True):
            assert torch.equal(pool_q.segments[0][s], want)
        assert int(core.ledger.used(Tier.CPU)[quiet]) == 4 * PAGE
    finally:
        writer.close(grace=5)
        reader.close(grace=5)


def test_a_staging_given_back_frees_its_slots_and_the_tenants_charge(pair):
    from kvtier.prefix import salt_key
    from kvtier.prefix.shared import Stager, unstage

    _, (a, b) = pair
    (pool_a, slots_a), _ = stored_blocks(a, "t", 2)
    assert a.store(pool_a.pool_id, [b"u0", b"u1"], slots_a) == 2
    assert a.prefix._core.remote.flush(5)
    core = b.prefix._core
    with core.cond:
        owner = core.ledger.owner("t")
    stager = Stager(core, "t", owner, PAGE)
    salted = [salt_key("t", k) for k in (b"u0", b"u1")]
    assert core.remote.fetch_each(salted, PAGE, stager.take) == 2
    staged = stager.staged(salted)
    assert staged is not None and staged.owner == owner
    assert int(core.ledger.used(Tier.CPU)[owner]) == 2 * PAGE  # counted while staged
    with core.cond:
        unstage(core, staged)
    assert int(core.ledger.incoming[Tier.CPU, owner]) == 0
    assert b.stats().tiers[1].used_bytes == 0
    assert b.lookup("t", [b"u0"]) == [Tier.REMOTE]  # nothing landed


def test_a_flooding_tenant_cannot_keep_anothers_blocks_out_of_the_store(tmp_path):
    """The write-behind queue is full of one tenant's blocks while the store hangs: another
    tenant's store still gets its blocks written (the flooder's newest make the room, and are
    known as not written)."""
    medium, secret = DictMedium(), secret_file(tmp_path)
    cfg = small_config(None, remote_secret_file=secret, remote_inflight_mb=1,
                       cpu_memory_gb=1024 * PAGE / 2**30)
    with TierEngine(cfg, remote_medium=medium) as e, \
            TierEngine(small_config(None, remote_secret_file=secret),
                       remote_medium=medium) as other:
        (pool_n, slots_n), _ = stored_blocks(e, "noisy", 4)
        flood = [b"f%d" % i for i in range(400)]  # ~1.6 MiB framed: more than the queue
        with medium._lock:  # the store hangs: nothing leaves the queue
            assert e.store(pool_n.pool_id, flood, [slots_n[i % 4] for i in range(400)]) == 400
            (pool_q, slots_q), data = stored_blocks(e, "quiet", 2, seed=3)
            assert e.store(pool_q.pool_id, [b"q0", b"q1"], slots_q) == 2
        assert e.prefix._core.remote.flush(10)
        assert other.lookup("quiet", [b"q0", b"q1"]) == [Tier.REMOTE] * 2
        pool_o = other.attach("quiet", 8)
        got = [s for _, s in other.allocate(pool_o.pool_id, 2)]
        assert other.load(pool_o.pool_id, [b"q0", b"q1"], got) == 2
        for s, want in zip(got, data, strict=True):
            assert torch.equal(pool_o.segments[0][s], want)
        dropped = e.stats().remote.dropped.get("queue_full", 0)
        assert dropped > 0  # noisy's blocks past the queue
        missing = [k for k in flood if other.lookup("noisy", [k]) != [Tier.REMOTE]]
        assert len(missing) == dropped
        from kvtier.prefix import salt_key

        remote = e.prefix._core.remote  # a block dropped from the queue is worth offering again
        assert all(remote.wants(salt_key("noisy", k)) for k in missing)
        assert not remote.wants(salt_key("quiet", b"q0"))


def _drop_local(engine: TierEngine, tenant: str, keys: list[bytes]) -> None:
    """The engine's own copies of ``keys`` go (as an eviction would take them)."""
    core = engine.prefix._core
    with core.cond:
        core.drop(np.array([core.table.keyed(salt_key(tenant, k)) for k in keys],
                           dtype=np.int64), "test")


def test_blocks_the_store_lost_are_written_again(pair):
    """A daemon remembered which blocks it had written (or read) and never offered them again:
    once the shared store lost them (restarted empty, evicted, expired, deleted by a peer) they
    stayed missing for every node. A Store making a new local page offers it whatever was
    known, and a remote miss forgets what was known of that block."""
    medium, (a, b) = pair
    (pool, slots), _ = stored_blocks(a, "t", 3)
    keys = [b"k0", b"k1", b"k2"]
    assert a.store(pool.pool_id, keys, slots) == 3
    assert a.prefix._core.remote.flush(5) and len(medium.data) == 3
    medium.data.clear()  # the store lost them
    _drop_local(a, "t", keys)
    assert a.store(pool.pool_id, keys, slots) == 3
    assert a.prefix._core.remote.flush(5) and len(medium.data) == 3  # written again
    # B reads them (so knows them to be in the store); the store loses them; B's lookup misses.
    (pool_b, slots_b), _ = stored_blocks(b, "t", 3, seed=2)
    assert b.load(pool_b.pool_id, keys, slots_b) == 3
    remote_b = b.prefix._core.remote
    assert not remote_b.wants(salt_key("t", keys[0]))
    medium.data.clear()
    _drop_local(b, "t", keys)
    assert b.lookup("t", keys) == []
    assert remote_b.wants(salt_key("t", keys[0]))  # offered again the next time it is stored


def test_a_block_known_for_half_its_ttl_is_offered_again(tmp_path):
    """The store expires values after REMOTE_TTL_S; what a daemon knew of one goes stale at
    half of it, so a block stored again after that is written again before it expires."""
    engine = TierEngine(small_config(None, remote_secret_file=secret_file(tmp_path),
                                     remote_ttl_s=2), remote_medium=DictMedium())
    try:
        (pool, slots), _ = stored_blocks(engine, "t", 1)
        assert engine.store(pool.pool_id, [b"k"], slots) == 1
        remote = engine.prefix._core.remote
        assert remote.flush(5) and not remote.wants(salt_key("t", b"k"))
        time.sleep(1.2)
        assert remote.wants(salt_key("t", b"k"))
    finally:
        engine.close(grace=5)


class _LeavesDuringCopies(Caller):
    """A caller still waiting when the store checks before its chunk and when the chunk's copy
    batch is launched, gone by the store's end (its timeout passed while the copies ran: some
    may have read memory it reused since)."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    @property
    def gone(self) -> bool:
        self.checks += 1
        return self.checks > 2


def test_a_store_whose_caller_left_during_its_copies_writes_nothing_behind(tmp_path):
    """What such a store stored is taken back locally (``forget``), but it was still handed to
    the write-behind: another daemon (and this one, after the take-back) then loaded from the
    remote store bytes the caller had written after it gave up (813 of 1,024 pages of a
    paused daemon's store, 3 mixed)."""
    medium = DictMedium()
    with TierEngine(small_config(None, remote_secret_file=secret_file(tmp_path)),
                    remote_medium=medium) as e:
        (pool, slots), _ = stored_blocks(e, "t", 2)
        caller = _LeavesDuringCopies()
        e.store(pool.pool_id, [b"w0", b"w1"], slots, caller)
        assert caller.checks == 3  # the chunk, its launch, the write-behind
        assert e.prefix._core.remote.flush(5)
        assert medium.data == {}
        assert e.store(pool.pool_id, [b"w2"], slots[:1]) == 1  # a caller still there: written
        assert e.prefix._core.remote.flush(5)
        assert len(medium.data) == 1
