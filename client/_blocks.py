"""Content keys for blocks of tokens: chained hashes shared by the integrations.

Primitives:

- :func:`chain_keys` — one 16-byte key per *full* block of ``block_size`` token ids; key
  ``i`` hashes key ``i-1`` with block ``i``'s ids, so equal keys imply equal prefixes. A
  trailing partial block gets no key (it is recomputed by the engine, never stored).
- :func:`rekey` — turn hashes an engine already computes (vLLM's block hashes) into keys of the
  same width and namespace, without re-hashing the tokens.
- :class:`KeyChains` — ``chain_keys`` with memory: a conversation's next turn shares its
  previous turn's blocks, so only the new blocks are hashed.
- :func:`namespace` — a short digest of what the bytes of a page depend on besides the
  tokens (model, dtype, KV layout, block size); mixed into the first key so two layouts can
  never share a page.

The daemon salts every key per tenant; these keys only need to be stable and collision-free.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

KEY_BYTES = 16
_ROOT = b"kvtier-blocks-v1"


def namespace(*parts: object) -> bytes:
    """A 16-byte digest of ``parts`` (their ``repr``); order matters."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-ns")
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.digest()


def _step(parent: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-blk")
    h.update(parent)
    h.update(payload)
    return h.digest()


def _ids_bytes(ids: Iterable[int]) -> bytes:
    """Little-endian int64 of each id (fast path through ``array``)."""
    arr = array("q", ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def chain_keys(
    tokens: Sequence[int], block_size: int, *, ns: bytes = b"", start: int = 0
) -> list[bytes]:
    """Keys of the full blocks of ``tokens``, leaving out the first ``start`` keys.

    ``block_size`` must be positive. ``len(result) == len(tokens) // block_size - start``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = _step(_ROOT, ns)
    keys: list[bytes] = []
    for b in range(len(tokens) // block_size):
        parent = _step(parent, _ids_bytes(tokens[b * block_size : (b + 1) * block_size]))
        if b >= start:
            keys.append(parent)
    return keys


def rekey(hashes: Iterable[bytes | int], *, ns: bytes = b"") -> list[bytes]:
    """Map an engine's own chained block hashes to ``KEY_BYTES`` keys in namespace ``ns``.

    The engine's hashes already chain (each depends on its whole prefix), so each maps on its own.
    """
    out: list[bytes] = []
    for h in hashes:
        raw = h if isinstance(h, bytes) else int(h).to_bytes(16, "little", signed=True)
        out.append(_step(ns, raw))
    return out


def _plain(tokens: Sequence[int]) -> list[int]:
    """A list of Python ints, sharing nothing with ``tokens`` (a slice of the caller's ids): a
    tensor's or array's items would be views of its buffer, changed by an in-place edit."""
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)
    return list(tokens) if tolist is None else list(tolist())


class KeyChains:
    """``keys(tokens) == chain_keys(tokens, block_size, ns=ns)``, reusing a remembered chain.

    Chains are remembered by their first block's key (the ``capacity`` most recent); a chain whose
    whole blocks are a prefix of ``tokens`` is reused and extended, anything else is hashed anew.
    What is remembered is a copy of the ids as Python ints, never a view of the caller's tensor.
    """

    def __init__(self, block_size: int, *, ns: bytes = b"", capacity: int = 64) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size, self.capacity = block_size, capacity
        self._root = _step(_ROOT, ns)
        self._chains: OrderedDict[bytes, tuple[list[int], list[bytes]]] = OrderedDict()

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            return []
        head = _plain(tokens[: n * bs])
        first = _step(self._root, _ids_bytes(head[:bs]))
        keys = [first]
        hit = self._chains.get(first)
        if hit is not None:
            m = min(len(hit[1]), n)
            # One slice, compared in C (a turn's prompt holds the previous turn's int objects:
            # mostly identity checks): a chain 30 blocks long costs ~30 us, not ~120.
            known = hit[0] if m * bs == len(hit[0]) else hit[0][: m * bs]
            if known == (head if m == n else head[: m * bs]):
                keys = hit[1][:m]
        parent = keys[-1]
        for b in range(len(keys), n):
            parent = _step(parent, _ids_bytes(head[b * bs : (b + 1) * bs]))
            keys.append(parent)
        self._chains[first] = (head, keys)
        self._chains.move_to_end(first)
        while len(self._chains) > self.capacity:
            self._chains.popitem(last=False)
        return list(keys)
