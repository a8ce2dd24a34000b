"""The block mover the integrations share: copy blocks between an engine's KV tensors and kvtier.

``BlockTransfer(req_id, keys, block_ids, prefix_ids)``: pages by key <-> engine blocks by id.
``BlockMover(backend, rows, register=...)``:

- ``register=True``: the engine's KV memory is registered with kvtier (CUDA IPC); slots are
  block ids and the daemon copies directly. ``register=False`` (CPU, or memory the daemon can't
  map): a small staging pool in daemon memory; blocks are copied through it in chunks of
  ``staging_slots``.
- ``load(t) -> int``: leading blocks of ``t`` now holding exactly the stored bytes. Blocks after
  that were not written and must be recomputed (the vLLM connector reports them as invalid).
- ``load_groups(t, bounds) -> Iterator[int]``: register mode only: ``load`` one group of
  segments at a time (``bounds``: segment indices ``0 = b0 < ... = len(rows.segments)``); per
  group, once its bytes are in place, the leading blocks loaded in every group so far (never
  growing). A daemon's call starts at once; closing the iterator early cancels it. It counts
  nothing: the caller keeps the ``load_*`` counters.
- ``store(t) -> int``: blocks stored (already-present keys count); a shortfall is not an error.
  It reads the blocks as they are when called (the caller waits for the engine's writes first).
- ``stage(keys) -> Staged`` / ``unstage``: staging mode only, the load's first half — blocks
  into staging slots, which the caller copies out as it likes (e.g. layer by layer).
- Loads and stores may run on two threads at once (the client is thread-safe); loads update only
  the ``load_*`` counters, stores only the ``store_*`` ones.
- Errors of the daemon (away, restarted: the pool is gone) pass through; the caller re-attaches.

``MoverCounters`` are plain numbers; the connector logs them and can write them to a file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ._backend import Backend, round_page
from .block_rows import BlockRows


@dataclass(slots=True)
class BlockTransfer:
    """Copy ``len(keys)`` pages between kvtier (by key) and engine blocks (by id), in order."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    prefix_ids: list[int] = field(default_factory=list)  # the chain's blocks before block_ids


@dataclass(slots=True)
class Staged:
    """Pages of the staging pool holding loaded blocks: ``rows`` is ``[got, page_bytes]``."""

    ids: list[int]
    slots: list[int]
    got: int
    rows: torch.Tensor | None


@dataclass(slots=True)
class MoverCounters:
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    stored_blocks: int = 0
    store_failed_blocks: int = 0
    load_calls: int = 0
    store_calls: int = 0
    unsafe_store_blocks: int = 0  # not stored: an earlier block of the chain failed to load
    attaches: int = 0  # times its owner attached (more than 1: re-attached after an outage)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class BlockMover:
    def __init__(self, backend: Backend, rows: BlockRows, *, register: bool,
                 staging_slots: int = 64, counters: MoverCounters | None = None) -> None:
        self.backend, self.rows = backend, rows
        self.counters = counters if counters is not None else MoverCounters()
        self._registered = register
        if register:
            self._pool = backend.register(rows.segments)
        else:
            self._staging = backend.attach(min(staging_slots, rows.num_blocks),
                                           round_page(rows.page_bytes))
            self._pool = self._staging.handle

    def close(self) -> None:
        self.backend.detach(self._pool)

    def load(self, t: BlockTransfer) -> int:
        self.counters.load_calls += 1
        if self._registered:
            got = self.backend.load(self._pool, t.keys, t.block_ids)
        else:
            got = self._chunked(t, self._load_chunk)
        self.counters.loaded_blocks += got
        self.counters.load_failed_blocks += len(t.keys) - got
        return got

    def load_groups(self, t: BlockTransfer, bounds: Sequence[int]) -> Iterator[int]:
        if not self._registered:
            raise ValueError("load_groups needs a registered pool (staging: stage + scatter)")
        return self.backend.load_layers(self._pool, t.keys, t.block_ids, bounds)

    def store(self, t: BlockTransfer) -> int:
        """Store ``t``'s blocks as they are now: on CUDA the caller first waits for the writes
        (an event of the stream that wrote them, or a synchronize)."""
        self.counters.store_calls += 1
        if self._registered:
            got = self.backend.store(self._pool, t.keys, t.block_ids)
        else:
            got = self._chunked(t, self._store_chunk)
        self.counters.stored_blocks += got
        self.counters.store_failed_blocks += len(t.keys) - got
        return got

    @property
    def registered(self) -> bool:
        return self._registered

    @property
    def staging_slots(self) -> int:
        """Blocks one ``stage`` call may take (0 when registered: nothing is staged)."""
        return 0 if self._registered else self._staging.num_slots

    def stage(self, keys: list[bytes]) -> Staged:
        """Load ``keys`` (at most ``staging_slots``) into staging slots, for the caller to copy
        out (``Staged.rows``) before ``unstage``. ``got``: the leading keys that loaded."""
        b, st = self.backend, self._staging
        pages = b.allocate(st.handle, len(keys))
        if pages is None:
            return Staged([], [], 0, None)
        ids, slots = [p for p, _ in pages], [s for _, s in pages]
        try:
            got = b.load(st.handle, keys, slots)
        except BaseException:
            self._drop(ids)
            raise
        rows = None
        if got:  # [got, page_bytes], contiguous: what BlockRows.scatter copies in one launch
            idx = torch.tensor(slots[:got], device=st.rows.device)
            rows = st.rows[:, : self.rows.page_bytes].index_select(0, idx)
        return Staged(ids, slots, got, rows)

    def unstage(self, staged: Staged) -> None:
        if staged.ids:
            self._drop(staged.ids)

    def _drop(self, ids: list[int]) -> None:
        self.backend.release(self._staging.handle, ids)
        self.backend.free(self._staging.handle, ids)

    def _chunked(self, t: BlockTransfer, op: object) -> int:
        step, done = self._staging.num_slots, 0
        for i in range(0, len(t.keys), step):
            keys, blocks = t.keys[i : i + step], t.block_ids[i : i + step]
            got = op(keys, blocks)  # type: ignore[operator]
            done += got
            if got < len(keys):
                break
        return done

    def _load_chunk(self, keys: list[bytes], blocks: list[int]) -> int:
        staged = self.stage(keys)
        try:
            if staged.rows is not None:
                self.rows.scatter(blocks[: staged.got], staged.rows)
            return staged.got
        finally:
            self.unstage(staged)

    def _store_chunk(self, keys: list[bytes], blocks: list[int]) -> int:
        b, st = self.backend, self._staging
        pages = b.allocate(st.handle, len(keys))
        if pages is None:
            return 0
        ids, slots = [p for p, _ in pages], [s for _, s in pages]
        try:
            tmp = torch.empty(len(keys), self.rows.page_bytes, dtype=torch.uint8,
                              device=self.rows.device)
            self.rows.gather(blocks, tmp)
            st.rows[:, : self.rows.page_bytes].index_copy_(
                0, torch.tensor(slots, device=st.rows.device), tmp.to(st.rows.device))
            if st.rows.is_cuda:  # this thread's copies, not the whole device
                torch.cuda.current_stream(st.rows.device).synchronize()
            return b.store(st.handle, keys, slots)
        finally:
            b.release(st.handle, ids)
            b.free(st.handle, ids)
