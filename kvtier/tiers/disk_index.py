"""The disk tier's index snapshot: one JSON file, replaced atomically.

``save_index(path, entries, journal)`` writes ``index.json.tmp`` afresh (mode 0600 whatever the
umask; a leftover is unlinked first, so nothing it links to is ever written), fsyncs it, renames
it over ``index.json`` and fsyncs the directory, so a crash leaves either the old or the new
snapshot, never a mix; a write that fails (a full disk) raises ``OSError`` and removes the
temporary file. ``journal`` is the generation of the first journal file the
snapshot does *not* contain (``kvtier.tiers.disk_journal``): older journal files are folded in.
``load_index(path)`` returns the entries it can trust, the number it dropped (malformed fields, a
checksum that is not an unsigned 64-bit int, a duplicate slot) and that generation (0 when absent).
A missing index is empty; an unreadable one is empty with every record counted as dropped where
they can be counted. Neither follows a symbolic link (``diskio.open_regular``).

Layout (version 1): ``{"version": 1, "journal": <int>, "records": [{"page_size", "slot", "key"
(hex), "tenant", "checksum" (xxh3-64 of the page), "meta": {str: int}}, ...]}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.diskio import open_private, open_regular

INDEX_NAME = "index.json"
INDEX_TMP = INDEX_NAME + ".tmp"
_VERSION = 1
_MAX_U64 = (1 << 64) - 1
MAX_GENERATION = 10**18  # journal generations (decimal file names of at most 18 digits)
log = logging.getLogger(__name__)

IndexEntry = tuple[int, DiskSlot, DiskRecord]  # (page_size, slot, record)


def save_index(directory: str, entries: list[IndexEntry], journal: int = 0) -> None:
    """Atomically replace ``directory/index.json`` with ``entries``."""
    doc = {
        "version": _VERSION,
        "journal": journal,
        "records": [encode_entry(ps, slot, rec) for ps, slot, rec in entries],
    }
    final = os.path.join(directory, INDEX_NAME)
    tmp = os.path.join(directory, INDEX_TMP)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a crash (or a link: only the link goes), never followed
    fd = open_private(tmp, os.O_WRONLY | os.O_EXCL)
    try:
        with open(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # its space back, on a disk that is full
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


def load_index(directory: str) -> tuple[list[IndexEntry], int, int]:
    """``(trusted entries, dropped count, journal generation)`` from ``directory/index.json``."""
    try:
        fd = open_regular(os.path.join(directory, INDEX_NAME), os.O_RDONLY)
        with open(fd, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return [], 0, 0
    except (OSError, ValueError) as exc:
        log.warning("disk index unreadable, starting empty: %s", exc)
        return [], 0, 0
    raw = doc.get("records") if isinstance(doc, dict) else None
    journal = doc.get("journal", 0) if isinstance(doc, dict) else 0
    if (
        not isinstance(raw, list)
        or doc.get("version") != _VERSION
        or not (_is_int(journal) and 0 <= journal < MAX_GENERATION)
    ):
        log.warning("disk index has an unknown layout, starting empty")
        return [], len(raw) if isinstance(raw, list) else 0, 0
    entries: list[IndexEntry] = []
    seen: set[tuple[int, int]] = set()
    dropped = 0
    for item in raw:
        entry = decode_entry(item)
        if entry is None or (entry[0], entry[1]) in seen:
            dropped += 1
            continue
        seen.add((entry[0], entry[1]))
        entries.append(entry)
    return entries, dropped, journal


def encode_entry(page_size: int, slot: DiskSlot, rec: DiskRecord) -> dict[str, Any]:
    return {
        "page_size": page_size,
        "slot": int(slot),
        "key": rec.key.hex(),
        "tenant": rec.tenant,
        "checksum": rec.checksum,
        "meta": rec.meta,
    }


def decode_entry(item: Any) -> IndexEntry | None:
    """A trusted entry, or None when any field is malformed."""
    if not isinstance(item, dict):
        return None
    ps, slot, checksum = item.get("page_size"), item.get("slot"), item.get("checksum")
    key, tenant, meta = item.get("key"), item.get("tenant"), item.get("meta", {})
    if not (isinstance(ps, int) and isinstance(slot, int) and isinstance(checksum, int)):
        return None
    if isinstance(ps, bool) or isinstance(slot, bool) or isinstance(checksum, bool):
        return None
    if ps <= 0 or slot < 0 or not 0 <= checksum <= _MAX_U64:
        return None
    if not (isinstance(key, str) and isinstance(tenant, str) and isinstance(meta, dict)):
        return None
    if not all(isinstance(k, str) and _is_int(v) for k, v in meta.items()):
        return None
    try:
        key_bytes = bytes.fromhex(key)
    except ValueError:
        return None
    return ps, DiskSlot(slot), DiskRecord(key_bytes, tenant, checksum, dict(meta))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
