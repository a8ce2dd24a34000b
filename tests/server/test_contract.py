"""The contracts written in kvtier.proto's comments, checked against a real daemon: duplicate ids,
Free of a pinned page, per-call limits, registered pools, Store of a present key, and Lookup
against Load across page sizes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from kvtier_daemon_fixture import PAGE, Daemon

from kvtier.errors import FailedPrecondition
from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

S = grpc.StatusCode
TENANT = "contract"


class Pool:
    """One attached pool over raw gRPC (no fast lane), with pin counts from Stats."""

    def __init__(self, stub: pb_grpc.KVTierStub, pages: int = 4, page_size: int = 0) -> None:
        self.stub = stub
        att = stub.Attach(pb.AttachRequest(tenant=TENANT, num_pages=pages, page_size=page_size),
                          timeout=10)
        self.ref = pb.PoolRef(tenant=TENANT, pool_id=att.pool_id, instance=att.instance)
        self.shm = att.handle.shm_path
        self.size = att.page_size

    def allocate(self, n: int) -> list[tuple[int, int]]:
        got = self.stub.Allocate(pb.AllocateRequest(pool=self.ref, count=n), timeout=10)
        return [(p.page_id, p.slot) for p in got.pages]

    def call(self, method: str, ids: list[int]) -> object:
        return getattr(self.stub, method)(pb.PagesRequest(pool=self.ref, page_ids=ids), timeout=10)

    def pinned(self) -> int:
        return self.stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10).pinned_pages

    def fill(self, slot: int, value: int) -> None:
        view = torch.from_file(self.shm, shared=True, size=os.path.getsize(self.shm),
                               dtype=torch.uint8)
        view[slot * self.size:(slot + 1) * self.size].fill_(value)

    def first_byte(self, slot: int) -> int:
        view = torch.from_file(self.shm, shared=True, size=os.path.getsize(self.shm),
                               dtype=torch.uint8)
        return int(view[slot * self.size])

    def detach(self) -> None:
        self.stub.Detach(pb.DetachRequest(pool=self.ref), timeout=10)


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> Iterator[pb_grpc.KVTierStub]:
    with grpc.insecure_channel(daemon.address) as ch:
        yield pb_grpc.KVTierStub(ch)


def code_of(call: object, *args: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.code(), err.value.details() or ""


def test_duplicate_ids_in_one_call_count_once(stub: pb_grpc.KVTierStub) -> None:
    pool = Pool(stub)
    (page, slot), = pool.allocate(1)
    pool.call("Release", [page])
    base = pool.pinned()
    reply = stub.Acquire(pb.AcquireRequest(pool=pool.ref, page_ids=[page, page]), timeout=10)
    assert list(reply.slots) == [slot, slot]
    assert pool.pinned() == base + 1
    pool.call("Release", [page, page])  # one level, as the acquire took one
    assert pool.pinned() == base
    assert code_of(pool.call, "Release", [page])[0] == S.FAILED_PRECONDITION
    stub.Acquire(pb.AcquireRequest(pool=pool.ref, page_ids=[page]), timeout=10)
    stub.Acquire(pb.AcquireRequest(pool=pool.ref, page_ids=[page]), timeout=10)
    pool.call("Release", [page])  # pins across calls nest: still pinned once
    assert pool.pinned() == base + 1
    pool.call("Release", [page])
    pool.detach()


def test_free_of_a_pinned_page_drops_it_and_its_pin(stub: pb_grpc.KVTierStub) -> None:
    pool = Pool(stub)
    (page, _), = pool.allocate(1)
    base = pool.pinned()
    pool.call("Free", [page])
    assert pool.pinned() == base - 1
    assert code_of(pool.call, "PageTiers", [page])[0] == S.NOT_FOUND
    pool.detach()


def test_per_call_limits(stub: pb_grpc.KVTierStub) -> None:
    pool = Pool(stub)
    code, details = code_of(pool.call, "PageTiers", list(range(65_537)))
    assert code == S.INVALID_ARGUMENT and details.startswith("len(page_ids): "), details
    assert code_of(pool.call, "PageTiers", list(range(1, 65_537)))[0] == S.NOT_FOUND  # allowed
    keys = [b"k"] * 65_537
    code, details = code_of(stub.Lookup, pb.LookupRequest(tenant=TENANT, keys=keys), 10)
    assert code == S.INVALID_ARGUMENT and details.startswith("len(keys): ")
    assert stub.Lookup(pb.LookupRequest(tenant=TENANT, keys=keys[:65_536]), timeout=10) is not None
    for bad in ("x" * 129, "tab\there", "", "-lead", "é"):
        code, details = code_of(stub.Lookup, pb.LookupRequest(tenant=bad, keys=[b"k"]), 10)
        assert code == S.INVALID_ARGUMENT and details.startswith("tenant: ")
        ref = pb.PoolRef(tenant=bad, pool_id=pool.ref.pool_id)  # the same rule on pool calls
        code, details = code_of(stub.Detach, pb.DetachRequest(pool=ref), 10)
        assert code == S.INVALID_ARGUMENT and details.startswith("pool.tenant: ")
    name = "a" + "Z9._:@/-" * 15 + "1234567"  # 128 characters, every allowed kind
    assert stub.Lookup(pb.LookupRequest(tenant=name, keys=[b"k"]), timeout=10) is not None
    pool.detach()


def test_store_of_a_present_key_counts_and_keeps_the_first_bytes(
    stub: pb_grpc.KVTierStub,
) -> None:
    pool = Pool(stub)
    (a, sa), (b, sb) = pool.allocate(2)
    pool.fill(sa, 11)
    pool.fill(sb, 22)
    key = uuid.uuid4().bytes
    store = stub.Store
    assert store(pb.StoreRequest(pool=pool.ref, keys=[key], slots=[sa]), timeout=10).count == 1
    assert store(pb.StoreRequest(pool=pool.ref, keys=[key], slots=[sb]), timeout=10).count == 1
    pool.fill(sb, 0)
    load = stub.Load(pb.LoadRequest(pool=pool.ref, keys=[key], slots=[sb]), timeout=10)
    assert load.count == 1 and pool.first_byte(sb) == 11  # the first bytes stored, not 22
    pool.call("Release", [a, b])
    pool.detach()


def test_lookup_finds_keys_that_load_cannot_copy_into_another_page_size(
    stub: pb_grpc.KVTierStub,
) -> None:
    small, big = Pool(stub, page_size=PAGE), Pool(stub, page_size=2 * PAGE)
    (page, slot), = small.allocate(1)
    key = uuid.uuid4().bytes
    stub.Store(pb.StoreRequest(pool=small.ref, keys=[key], slots=[slot]), timeout=10)
    assert list(stub.Lookup(pb.LookupRequest(tenant=TENANT, keys=[key]), timeout=10).tiers) == [
        Tier.CPU]
    (_, big_slot), = big.allocate(1)
    load = stub.Load(pb.LoadRequest(pool=big.ref, keys=[key], slots=[big_slot]), timeout=10)
    assert load.count == 0
    small.call("Release", [page])
    small.detach()
    big.detach()


def test_registered_pools_have_no_allocate_and_no_fast_lane(daemon: Daemon) -> None:
    path = f"/dev/shm/kvtier-test-{uuid.uuid4().hex}"
    with open(path, "wb") as fh:
        fh.truncate(2 * PAGE)
    try:
        seg = torch.from_file(path, shared=True, size=2 * PAGE, dtype=torch.uint8).view(2, PAGE)
        with daemon.client(TENANT) as c:
            att = c.register([seg], shm_paths=[path])
            assert att.fast_lane is None and att.tensor is None
            with pytest.raises(FailedPrecondition):
                c.allocate(att, 1)
            seg[1].fill_(7)  # Store needs no pin: the engine owns these slots
            assert c.store(att, [uuid.uuid4().bytes], [1]) == 1
            c.detach(att)
    finally:
        os.unlink(path)
