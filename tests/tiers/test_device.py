"""DevicePool: slot bookkeeping, segment validation, row copies and a real second process."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from kvtier.errors import FailedPrecondition, InvalidArgument
from kvtier.tiers.base import PoolHandle
from kvtier.tiers.device import DevicePool, open_handle
from kvtier.types import SlotIndex

from .conftest import run_python

PAGE = 4096


@pytest.fixture
def pool():
    p = DevicePool.allocate(8, PAGE, "cpu")
    yield p
    p.close()


def slots(*xs: int) -> list[SlotIndex]:
    return [SlotIndex(x) for x in xs]


def test_alloc_lowest_first_all_or_nothing(pool: DevicePool) -> None:
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(6) is None  # only 5 free: nothing taken
    assert pool.num_free == 5
    pool.free(slots(1))
    assert pool.alloc(2) == [1, 3]
    assert pool.alloc(0) == []
    assert pool.num_free == 4


def test_bulk_alloc_and_free_keep_lowest_first() -> None:
    with DevicePool.allocate(64, PAGE, "cpu") as big:
        assert big.alloc(60) == list(range(60))  # most of the free slots at once
        big.free(slots(*range(10, 50)))  # many at once
        big.free(slots(3))
        assert big.alloc(2) == [3, 10]
        assert big.alloc(40) == [*range(11, 50), 60]
        assert big.num_free == 3
        with pytest.raises(AssertionError):
            big.free(slots(0, 0))  # the same slot twice in one call
        assert big.alloc(3) == [61, 62, 63]
    with DevicePool.allocate(256, PAGE, "cpu") as pool:
        assert pool.alloc(200) == list(range(200))
        pool.free(slots(*range(199, 99, -1)))  # a bulk free (ordered by the next alloc)
        pool.free(slots(7))  # after a bulk free: appended too
        assert pool.num_free == 157
        assert pool.alloc(3) == [7, 100, 101]  # a few: heap pops after one heapify
        pool.free(slots(5))  # a single free onto a heap again
        assert pool.alloc(2) == [5, 102]
        assert pool.alloc(153) == [*range(103, 200), *range(200, 256)]
        assert pool.alloc(1) is None


def test_double_free_is_an_internal_error(pool: DevicePool) -> None:
    got = pool.alloc(1)
    assert got == [0]
    pool.free(got)
    with pytest.raises(AssertionError):
        pool.free(got)
    with pytest.raises(AssertionError):
        pool.free(slots(8))


def test_cpu_pool_is_a_sealed_memfd_without_a_name(pool: DevicePool) -> None:
    fd = pool.handle().fd
    assert os.fstat(fd).st_size == 8 * PAGE
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvtier-pool")
    for size in (0, PAGE, 16 * PAGE):  # neither shrinks nor grows: no SIGBUS for any mapper
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(OSError):
        os.fstat(fd)  # the pool's descriptor is closed
    with pytest.raises(FailedPrecondition):
        pool.handle()


def test_second_process_sees_bytes_both_ways(pool: DevicePool) -> None:
    pool.segments[0][3].fill_(0xAB)
    pool.segments[0][5, :10] = torch.arange(10, dtype=torch.uint8)
    handle = pool.handle()
    code = (
        "import pickle, sys\n"
        "from kvtier.tiers.device import open_handle\n"
        "t = open_handle(pickle.loads(bytes.fromhex(sys.argv[1])))\n"
        "print(t.shape[0], t.shape[1], int(t[3].sum()), t[5, :10].tolist())\n"
        "t[6].fill_(7)\n"
    )
    out = run_python(code, pickle.dumps(handle).hex(), pass_fds=(handle.fd,))
    out = out.stdout.split(maxsplit=3)
    assert out[:3] == ["8", str(PAGE), str(0xAB * PAGE)]
    assert out[3].strip() == str(list(range(10)))
    assert torch.all(pool.segments[0][6] == 7)  # the child's write landed in our mapping
    assert int(pool.segments[0][7].sum()) == 0


def test_open_handle_in_process(pool: DevicePool) -> None:
    view = open_handle(pool.handle())
    view[2].fill_(9)
    assert torch.all(pool.gather_rows(slots(2)) == 9)


def test_gather_scatter_across_segments() -> None:
    backing = torch.zeros(4, 48, dtype=torch.uint8)
    segs = [backing[:, 0:16], backing[:, 20:28], torch.zeros(4, 12, dtype=torch.uint8)]
    pool = DevicePool.from_segments(segs)
    assert (pool.num_slots, pool.page_size) == (4, 36)
    src = torch.arange(72, dtype=torch.uint8).view(2, 36)
    pool.scatter_rows(slots(3, 1), src)
    assert torch.equal(pool.gather_rows(slots(3, 1)), src)
    assert torch.equal(backing[3, 0:16], src[0, 0:16])
    assert torch.equal(backing[1, 20:28], src[1, 16:24])
    assert torch.equal(segs[2][3], src[0, 24:36])
    assert int(backing[:, 16:20].sum()) == 0  # bytes between segments untouched
    assert int(backing[0].sum()) == 0 and int(backing[2].sum()) == 0  # other rows untouched
    with pytest.raises(FailedPrecondition):
        pool.handle()
    with pytest.raises(InvalidArgument):
        pool.scatter_rows(slots(0), src)


@pytest.mark.parametrize(
    ("segments", "field"),
    [
        ([], "segments"),
        ([torch.zeros(4, 8, dtype=torch.float32)], "segments[0]"),
        ([torch.zeros(4, 8, 2, dtype=torch.uint8)], "segments[0]"),
        (
            [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(5, 8, dtype=torch.uint8)],
            "segments[1]",
        ),
        ([torch.zeros(8, 4, dtype=torch.uint8).t()], "segments[0]"),
    ],
)
def test_from_segments_rejects(segments: list[torch.Tensor], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        DevicePool.from_segments(segments)
    assert info.value.field == field


def test_allocate_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgument):
        DevicePool.allocate(0, PAGE, "cpu")
    with pytest.raises(InvalidArgument):
        DevicePool.allocate(1, PAGE, "tpu")
    with pytest.raises(InvalidArgument):
        open_handle(PoolHandle("nfs", 1, PAGE, "cpu"))
    with pytest.raises(FailedPrecondition):  # a descriptor that is not a sealed memfd
        open_handle(PoolHandle("memfd", 1, PAGE, "cpu", fd=0))


def test_ipc_unpickler_refuses_foreign_globals() -> None:
    evil = pickle.dumps((os.system, ("true",)))
    with pytest.raises(InvalidArgument):
        open_handle(PoolHandle("cuda_ipc", 1, PAGE, "cuda:0", ipc=evil))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_shared_with_second_process() -> None:
    pool = DevicePool.allocate(4, PAGE, "cuda:0")
    pool.segments[0][1].fill_(5)
    torch.cuda.synchronize()
    code = (
        "import pickle, sys, torch\n"
        "from kvtier.tiers.device import open_handle\n"
        "t = open_handle(pickle.loads(bytes.fromhex(sys.argv[1])))\n"
        "print(int(t[1].sum()))\n"
        "t[2].fill_(3); torch.cuda.synchronize()\n"
    )
    out = run_python(code, pickle.dumps(pool.handle()).hex())
    assert out.stdout.split() == [str(5 * PAGE)]
    assert torch.all(pool.segments[0][2] == 3)
    src = torch.full((2, PAGE), 4, dtype=torch.uint8, device="cuda:0")
    pool.scatter_rows(slots(0, 3), src)
    assert torch.equal(pool.gather_rows(slots(3, 0)), src)
    pool.close()


@pytest.mark.parametrize("blob", [
    b"", b"KVIPC1", b"KVIPC1{", b"KVIPC1[]", b'KVIPC1{"device": 0}',
    b'KVIPC1{"device": -1, "size": 1, "offset": 0, "ref_counter_offset": 0, '
    b'"event_sync_required": false, "handle": "", "ref_counter_handle": "", "event_handle": ""}',
    b'KVIPC1{"device": 0, "size": "1", "offset": 0, "ref_counter_offset": 0, '
    b'"event_sync_required": false, "handle": "", "ref_counter_handle": "", "event_handle": ""}',
    b'KVIPC1{"device": 0, "size": 1, "offset": 0, "ref_counter_offset": 0, '
    b'"event_sync_required": false, "handle": "!!", "ref_counter_handle": "", "event_handle": ""}',
], ids=["empty", "magic-only", "bad-json", "not-a-dict", "missing", "negative", "string-int",
        "bad-base64"])
def test_malformed_cuda_handles_are_refused_naming_the_field(blob: bytes) -> None:
    with pytest.raises(InvalidArgument) as err:
        open_handle(PoolHandle("cuda_ipc", 1, PAGE, "cuda:0", ipc=blob))
    assert err.value.field == "handle.ipc"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check of a process without CUDA")
def test_a_well_formed_cuda_handle_in_a_process_without_cuda_is_refused() -> None:
    blob = (b'KVIPC1{"device": 0, "size": 4096, "offset": 0, "ref_counter_offset": 0, '
            b'"event_sync_required": false, "handle": "AAAA", "ref_counter_handle": "AAAA", '
            b'"event_handle": ""}')
    with pytest.raises(InvalidArgument, match="no CUDA device") as err:
        open_handle(PoolHandle("cuda_ipc", 1, PAGE, "cuda:0", ipc=blob))
    assert err.value.field == "handle.ipc"
