"""Keyed prefix blocks: pages named by a content key instead of a page id.

What a Store / Lookup / Load request touches, top first:

* ``store.py`` ``PrefixStore``: store, lookup and load of keyed blocks in the CPU and disk tiers
  (``salt_key`` mixes the tenant into every key: one tenant can't name another's blocks);
* ``shared.py``: the steps that put blocks into, and bring them back from, the shared store;
* ``remote.py`` ``RemoteTier``: the shared keyed store (framing, MACs, admission, write-behind)
  over a ``kvtier.tiers.keyed.KeyedMedium``;
* ``flush.py`` ``flush_keyed``: at shutdown, keyed CPU-tier blocks written to disk.
"""

from __future__ import annotations

from kvtier.prefix.chunks import FIRST_CHUNK, chunk_sizes
from kvtier.prefix.store import PrefixStore, salt_key

__all__ = ["FIRST_CHUNK", "PrefixStore", "chunk_sizes", "salt_key"]
