"""Tier storage primitives: where page bytes physically live.

A tier stores fixed-size *slots*. It knows nothing of pages, tenants or policies: the engine's page
table maps pages to slots. Contracts:

``DevicePool`` (``tiers/device.py``) — the GPU tier of one attached engine.
    * ``segments``: list of 2-D ``uint8`` tensors ``[num_slots, seg_bytes]`` (row stride may exceed
      ``seg_bytes``); page ``i``'s bytes are the concatenation of row ``i`` of every segment. A
      daemon-allocated pool has one segment; an engine-registered pool (vLLM) has one per layer/KV.
    * ``take(n) -> int64 array | None``: all or nothing, the ``n`` lowest free slots, sorted.
    * ``give(slots)``: returns an int64 array of slots; freeing a free, out-of-range or repeated
      slot is an internal error (assert), detected before anything changes. Both are vectorised.
    * ``alloc(n) -> list[SlotIndex] | None`` / ``free(slots)``: the same on lists.
    * ``handle() -> PoolHandle``: what another process needs to map the pool (CUDA IPC handle on a
      GPU, the sealed memfd in CPU mode; the daemon passes that over a unix socket, never a path).
      ``close()`` releases the memory.
    * On CUDA the memory is one device allocation; without CUDA it is a sealed memfd
      (``tiers/memfd.py``) mapped shared, so a second process holding the fd maps the same bytes.

``HostArena`` (``tiers/pinned.py``) — the pinned CPU tier, shared by all pools.
    * Exact-size chunks (``chunk_bytes``, page-aligned, pinned with ``cudaHostRegister`` when CUDA
      is present; never torch's power-of-two caching host allocator), created lazily up to
      ``budget_bytes``. One *slab* per page size; a slab's slot id is ``chunk_no * per_chunk + i``.
    * ``alloc(page_size, n) -> list[HostSlot] | None``: all or nothing; prefers contiguous runs in
      one chunk (so one DMA fills a batch). Never exceeds the budget. ``alloc_array`` returns the
      same slots as an int64 array.
    * ``free(page_size, slots)`` / ``free_array(page_size, slots)``; ``rows(page_size, slots) ->
      list[Tensor]`` (1-D views); ``runs(page_size, slots) -> list[tuple[Tensor, range]]``: groups
      slots (in the given order) into contiguous runs, each with a 2-D view ``[len, page_size]``
      and the positions of its slots in the input list. ``runs_array(page_size, slots) ->
      list[tuple[Tensor, lo, hi]]`` does it for an int64 array, without a Python loop per slot.
    * ``used_bytes``/``capacity_bytes`` count slot bytes in use / the budget. ``reserved_bytes``
      counts chunk bytes actually allocated (≤ budget).

``DiskStore`` (``tiers/disk.py``) — the NVMe tier.
    * One preallocated file per page size under ``path``, fixed-size slots, total ≤ budget.
    * ``alloc(page_size, n)`` / ``free(page_size, slots)`` like the host arena.
    * ``write(page_size, slots, srcs) -> Future[list[bool]]`` and
      ``read(page_size, slots, dsts) -> Future[list[bool]]`` run on a thread pool (O_DIRECT where
      the filesystem allows it); each page carries an xxh3-64 checksum recorded only once its bytes
      are durable. A read whose bytes fail the checksum returns ``False`` for that page and counts a
      checksum failure: corrupt bytes are never reported as good.
    * ``set_record(page_size, slot, record)`` attaches a persistable record (content key, tenant,
      metadata) to a written slot; ``records()`` lists them. Every record change is journaled
      (``tiers/disk_journal.py``: in the file within 10 ms, so it survives a kill -9 from then on);
      ``persist()`` syncs the journal and compacts it into an atomically written snapshot once it
      grew large. On open, the snapshot and journal are replayed (a torn tail is ignored) and
      every record whose slot lies past the end of its file is dropped and counted. The
      directory and files are private (0700 / 0600) whatever the umask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

HostSlot = NewType("HostSlot", int)
MediumSlot = NewType("MediumSlot", int)
"""A slot of a medium below the CPU (``tiers/medium.py``); the disk store's are ``DiskSlot``."""
DiskSlot = MediumSlot


@dataclass(slots=True, frozen=True)
class PoolHandle:
    """How a second process maps a pool. ``kind`` is ``"cuda_ipc"`` or ``"memfd"``."""

    kind: str
    num_slots: int
    page_size: int
    device: str
    fd: int = -1  # kind == "memfd": sealed memfd of num_slots * page_size bytes (owner's fd)
    ipc: bytes = b""  # kind == "cuda_ipc": tiers.sharing handle bytes (a capability: never log)


@dataclass(slots=True)
class SlotRecord:
    """Persisted with a medium's slot so a restarted daemon finds keyed pages again (the disk
    store's journal: ``DiskRecord``)."""

    key: bytes
    tenant: str
    checksum: int = 0
    meta: dict[str, int] = field(default_factory=dict)


DiskRecord = SlotRecord


@dataclass(slots=True)
class TierCounters:
    """Plain counters a tier updates on its hot path; ``kvtier.metrics`` exports them."""

    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    checksum_failures: int = 0
    io_errors: int = 0
    dropped_records: int = 0
