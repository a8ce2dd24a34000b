"""One face for the in-process engine and the daemon client, as the integrations need it.

``as_backend(target, tenant)`` wraps a :class:`kvtier.TierEngine` (tenant required) or a
:class:`kvtier.client.KVTierClient` (its own tenant) in a :class:`Backend`:

- ``attach(num_slots, page_size) -> Staging``: a daemon-allocated pool whose rows the caller can
  read and write directly (``Staging.rows``: ``[num_slots, page_size]`` uint8, mapped memory).
- ``register(segments) -> Registered``: engine-owned memory; slots are the engine's block ids.
- ``allocate`` / ``release`` / ``free``: pages of a staging pool (``allocate`` pins; ``None`` when
  no slot is free). ``store`` / ``lookup`` / ``load`` / ``load_layers``: the prefix-reuse calls
  of ENGINE_API.md (``load_layers``: an iterator of per-group counts; a daemon's starts at once);
  ``borrow``: the engine's pages lent in place (in-process engines only; None from a daemon).

Nothing here retries or hides errors: ``kvtier.errors`` classes pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.types import Tier


@dataclass(slots=True)
class Staging:
    """A pool the caller reads and writes through ``rows`` (mapped daemon or engine memory)."""

    handle: Any  # kvtier Pool (engine) or client Attachment
    rows: torch.Tensor
    num_slots: int
    page_size: int


class Backend:
    """Adapter base: subclasses translate each call to their target's spelling."""

    tenant: str

    def attach(self, num_slots: int, page_size: int) -> Staging:
        raise NotImplementedError

    def register(self, segments: list[torch.Tensor]) -> Any:
        raise NotImplementedError

    def detach(self, handle: Any) -> None:
        raise NotImplementedError

    def allocate(self, handle: Any, n: int) -> list[tuple[int, int]] | None:
        raise NotImplementedError

    def release(self, handle: Any, page_ids: Sequence[int]) -> None:
        raise NotImplementedError

    def free(self, handle: Any, page_ids: Sequence[int]) -> None:
        raise NotImplementedError

    def store(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        raise NotImplementedError

    def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        raise NotImplementedError

    def load(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        raise NotImplementedError

    def load_layers(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int],
                    bounds: Sequence[int]) -> Iterator[int]:
        raise NotImplementedError

    def borrow(self, handle: Any, keys: Sequence[bytes],
               plan: Callable[[list[Tier]], int] | None = None,
               patience: Callable[[int], float] | None = None) -> Any | None:
        """The stored prefix's pages lent in place (``kvtier.prefix.borrow.Borrowed``), or None
        where the pages live in another process (a daemon): then ``load`` copies them."""
        return None


class EngineBackend(Backend):
    """An in-process :class:`kvtier.TierEngine`; pools are addressed by ``pool_id``."""

    def __init__(self, engine: Any, tenant: str) -> None:
        self.engine, self.tenant = engine, tenant

    def attach(self, num_slots: int, page_size: int) -> Staging:
        pool = self.engine.attach(self.tenant, num_slots, page_size)
        if len(pool.segments) != 1:
            raise ValueError("a staging pool must have a single segment")
        return Staging(pool, pool.segments[0], pool.num_slots, pool.page_size)

    def register(self, segments: list[torch.Tensor]) -> Any:
        return self.engine.register(self.tenant, segments)

    def detach(self, handle: Any) -> None:
        self.engine.detach(handle.pool_id)

    def allocate(self, handle: Any, n: int) -> list[tuple[int, int]] | None:
        got = self.engine.allocate(handle.pool_id, n)
        return None if got is None else [(int(p), int(s)) for p, s in got]

    def release(self, handle: Any, page_ids: Sequence[int]) -> None:
        self.engine.release(handle.pool_id, list(page_ids))

    def free(self, handle: Any, page_ids: Sequence[int]) -> None:
        self.engine.free(handle.pool_id, list(page_ids))

    def store(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(self.engine.store(handle.pool_id, keys, slots))

    def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        return list(self.engine.lookup(self.tenant, keys))

    def load(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(self.engine.load(handle.pool_id, keys, slots))

    def load_layers(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int],
                    bounds: Sequence[int]) -> Iterator[int]:
        return self.engine.load_layers(handle.pool_id, keys, slots, bounds)

    def borrow(self, handle: Any, keys: Sequence[bytes],
               plan: Callable[[list[Tier]], int] | None = None,
               patience: Callable[[int], float] | None = None) -> Any | None:
        return self.engine.borrow(handle.pool_id, keys, plan, patience)


class ClientBackend(Backend):
    """A daemon client (``KVTierClient``); pools are ``Attachment`` objects."""

    def __init__(self, client: Any) -> None:
        self.client, self.tenant = client, client.tenant

    def attach(self, num_slots: int, page_size: int) -> Staging:
        att = self.client.attach(num_slots, page_size=page_size)
        if att.tensor is None:
            raise ValueError("the daemon returned a pool without mapped memory")
        return Staging(att, att.tensor, att.num_slots, att.page_size)

    def register(self, segments: list[torch.Tensor]) -> Any:
        return self.client.register(segments)

    def detach(self, handle: Any) -> None:
        self.client.detach(handle)

    def allocate(self, handle: Any, n: int) -> list[tuple[int, int]] | None:
        got = self.client.allocate(handle, n)
        return None if got is None else [(int(p), int(s)) for p, s in got]

    def release(self, handle: Any, page_ids: Sequence[int]) -> None:
        self.client.release(handle, list(page_ids))

    def free(self, handle: Any, page_ids: Sequence[int]) -> None:
        self.client.free(handle, list(page_ids))

    def store(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(self.client.store(handle, keys, slots))

    def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        return list(self.client.lookup(keys))

    def load(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(self.client.load(handle, keys, slots))

    def load_layers(self, handle: Any, keys: Sequence[bytes], slots: Sequence[int],
                    bounds: Sequence[int]) -> Iterator[int]:
        return self.client.load_layers(handle, keys, slots, bounds)


def as_backend(target: Any, tenant: str | None = None) -> Backend:
    """Wrap an engine (``tenant`` required) or a client (its tenant; ``tenant`` must match)."""
    if isinstance(target, Backend):
        return target
    if hasattr(target, "prefix") and hasattr(target, "attach"):
        if not tenant:
            raise ValueError("tenant is required with an in-process TierEngine")
        return EngineBackend(target, tenant)
    if hasattr(target, "tenant") and hasattr(target, "lookup"):
        if tenant and tenant != target.tenant:
            raise ValueError(f"tenant {tenant!r} differs from the client's {target.tenant!r}")
        return ClientBackend(target)
    raise TypeError(f"expected a TierEngine or a KVTierClient, got {type(target).__name__}")


def round_page(nbytes: int, align: int = 4096) -> int:
    """Smallest multiple of ``align`` holding ``nbytes`` (pools take 4 KiB multiples)."""
    return max(align, -(-nbytes // align) * align)
