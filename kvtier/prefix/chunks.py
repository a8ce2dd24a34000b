"""How a keyed store or load is cut into chunks, so that copies start early and the key
bookkeeping of each chunk runs while the chunks before it are copied (``chunk_sizes``)."""

from __future__ import annotations

# Blocks whose bookkeeping precedes the first copy of a store or a load. Smaller first chunks
# start the copies sooner but leave the copy engine idle between the next few launches (each
# costs ~0.2 ms of the caller's time); 96 measured best on an H100 for 256 KiB blocks (against
# 128, with the second chunk a quarter larger; 32 and 64 were slower than 128 before that).
FIRST_CHUNK = 96


def chunk_sizes(n: int, page_size: int, batch_bytes: int) -> list[int]:
    """How a store or load of ``n`` blocks is cut so that copies start early: the first chunk's
    key bookkeeping (hashes, lookups, page-table rows) is all that runs before the first copy;
    each later chunk's runs while the chunks before it are copied, so it must fit in their copy.
    On an H100 that is ~2.1 us a block and ~0.24 ms a launch against ~4.8 us a block of 256 KiB
    copied: from 96 blocks on a chunk a quarter larger fits, one twice as large only from ~330
    (doubling after the second chunk left the copy engine idle at the third). So each chunk is
    a quarter larger than the one before, twice as large from ``4 * FIRST_CHUNK`` on (small
    blocks' bookkeeping outlasts their copies whatever the chunks: fewer launches), up to a
    batch's worth."""
    most = max(1, batch_bytes // page_size)
    size, out = min(FIRST_CHUNK, most), []
    while n > 0:
        out.append(min(size, n))
        n -= out[-1]
        grow = size // 4 if size < 4 * FIRST_CHUNK else size  # doubling fits from ~330 on
        size = min(size + max(1, grow), most)
    return out
