"""Tenant salting of block keys: ``blake2b(key, key=H(tenant), digest_size=16)``.

Inside the engine every key is salted with its tenant, so one tenant can't even name another's
blocks. ``salt_keys`` salts a list at once (one hasher lookup, no call per key); ``Salted``
salts a load window's keys as they are first needed, each once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any


@functools.lru_cache(maxsize=1024)
def _tenant_key(tenant: str) -> bytes:
    return hashlib.blake2b(tenant.encode(), digest_size=32, person=b"kvtier-tenant").digest()


@functools.lru_cache(maxsize=1024)
def _tenant_hasher(tenant: str) -> Any:
    """A blake2b already keyed with the tenant's key; only ever copied (half the cost of keying
    a fresh one per block: the key is a whole compression block)."""
    return hashlib.blake2b(key=_tenant_key(tenant), digest_size=16)


def salt_key(tenant: str, key: bytes) -> bytes:
    """``blake2b(key, key=H(tenant), digest_size=16)``."""
    h = _tenant_hasher(tenant).copy()
    h.update(key)
    return h.digest()


def salt_keys(tenant: str, keys: Sequence[bytes]) -> list[bytes]:
    """``salt_key`` of each of ``keys``."""
    copy = _tenant_hasher(tenant).copy
    out: list[bytes] = []
    push = out.append
    for key in keys:
        h = copy()
        h.update(key)
        push(h.digest())
    return out


class Salted:
    """A load window's keys, each salted once (when first needed) for the tenant's table."""

    def __init__(self, tenant: str, keys: Sequence[bytes]) -> None:
        self._tenant, self._keys = tenant, keys
        self._salted: list[bytes] = []

    def span(self, lo: int, hi: int) -> list[bytes]:
        hi = min(hi, len(self._keys))
        if len(self._salted) < hi:
            self._salted += salt_keys(self._tenant, self._keys[len(self._salted) : hi])
        return self._salted[lo:hi]
