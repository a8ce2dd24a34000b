"""Tickets and leases on their own, with real descriptors: single use, tenant-bound, expiring."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from kvtier.server.leases import Leases
from kvtier.server.tickets import MAX_DEPOSITS, Tickets

from kvtier.tiers import memfd


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def pool_fd() -> Iterator[int]:
    fd = memfd.create(4096)
    yield fd
    os.close(fd)


def test_pool_ticket_is_single_use_tenant_bound_and_gives_a_copy(pool_fd: int) -> None:
    t = Tickets()
    ticket = t.issue("a", 7, pool_fd)
    assert t.redeem(ticket, "b") is None  # another tenant: refused, and nothing used up
    assert t.redeem(ticket[:-1] + bytes([ticket[-1] ^ 1]), "a") is None
    pool_id, fd = t.redeem(ticket, "a") or (0, -1)
    assert pool_id == 7 and fd not in (-1, pool_fd)
    assert os.fstat(fd).st_ino == os.fstat(pool_fd).st_ino  # the same memory
    os.close(fd)
    assert t.redeem(ticket, "a") is None
    assert t.renewable(ticket, "a") == 7 and t.renewable(ticket, "b") is None
    t.forget_pool(7)
    assert t.renewable(ticket, "a") is None


def test_expired_tickets_close_their_descriptors_and_name_unmappable_pools(pool_fd: int) -> None:
    t = Tickets(ttl=0.01)
    t.issue("a", 1, pool_fd)  # a memfd pool nobody redeemed: nobody can ever map it
    t.issue("a", 2, -1)  # a CUDA pool (a TCP client): it keeps living
    dep = memfd.create(4096)
    ticket = t.deposit("a", dep, conn=5)
    assert ticket is not None
    time.sleep(0.05)
    assert t.take_deposit(ticket, "a") is None
    assert t.expire() == [1]
    assert not is_open(dep)


def test_deposits_are_bounded_per_connection_and_die_with_it() -> None:
    t = Tickets()
    other = memfd.create(4096)  # first, so no descriptor number below is reused
    fds = [memfd.create(4096) for _ in range(MAX_DEPOSITS + 1)]
    tickets = [t.deposit("a", fd, conn=1) for fd in fds]
    assert None not in tickets[:-1] and tickets[-1] is None
    assert not is_open(fds[-1])  # a refused deposit is closed at once
    kept = t.deposit("a", other, conn=2)
    t.drop_conn(1)
    assert not any(is_open(fd) for fd in fds)
    got = t.take_deposit(kept or b"", "a")
    assert got is not None and got[1] == 2
    os.close(got[0])
    t.close()


def test_a_full_deposit_registry_takes_from_the_connection_holding_most() -> None:
    """With ``max_total`` held by one client's connection, another connection's deposit took
    nothing (REFUSED until those expired: one client kept every Register out). Now it takes
    the place of the oldest deposit of the connection holding the most, while that one holds
    more than it would."""
    t = Tickets(max_total=4)
    hog = [memfd.create(4096) for _ in range(4)]
    hog_tickets = [t.deposit("x", fd, conn=1) for fd in hog]
    assert None not in hog_tickets
    mine = [memfd.create(4096) for _ in range(3)]
    got = [t.deposit("b", fd, conn=2) for fd in mine]
    assert got[0] is not None and got[1] is not None  # the hog held 4 > 1, then 3 > 2
    assert got[2] is None and not is_open(mine[2])  # 2 each: the hog holds no more than 3
    assert not is_open(hog[0]) and not is_open(hog[1]) and is_open(hog[2])  # the oldest went
    assert t.take_deposit(hog_tickets[0] or b"", "x") is None
    for ticket in got[:2]:
        taken = t.take_deposit(ticket or b"", "b")
        assert taken is not None and taken[1] == 2
        os.close(taken[0])
    t.close()


def test_leases_orphan_reap_rebind() -> None:
    leases = Leases()
    s1, s2 = leases.open(), leases.open()
    assert leases.bind(10, s1) and leases.bind(11, s1) and leases.bind(12, s2)
    assert not leases.rebind(10, s2)  # held by a live session
    assert sorted(leases.close(s1)) == [10, 11]
    assert leases.rebind(11, s2)  # its client came back within the grace
    assert leases.reap([10, 11]) == [10]
    assert leases.reap([10]) == []
    leases.forget(12)
    assert leases.close(s2) == [11]
    assert not leases.bind(13, s1)  # binding to a closed session orphans at once


def test_a_detached_pools_unredeemed_ticket_closes_its_descriptor(pool_fd: int) -> None:
    """A client that attached and detached without redeeming left the registry's copy of the
    pool's descriptor open for the ticket's 30 s (14,875 descriptors at ~600 attaches a second):
    forgetting the pool closes it, and the ticket is dead."""
    t = Tickets()
    open_fds = len(os.listdir("/proc/self/fd"))
    tickets = [t.issue("a", pool, pool_fd) for pool in range(1, 65)]
    assert len(os.listdir("/proc/self/fd")) == open_fds + 64
    for pool in range(1, 65):
        t.forget_pool(pool)
    assert len(os.listdir("/proc/self/fd")) == open_fds
    assert all(t.redeem(ticket, "a") is None for ticket in tickets)
    assert t.expire(time.monotonic() + 3600) == []  # nothing left to expire (or close twice)
    again = t.issue("a", 1, pool_fd)  # the id reused by a new pool: its own ticket
    got = t.redeem(again, "a")
    assert got is not None and got[0] == 1
    os.close(got[1])
