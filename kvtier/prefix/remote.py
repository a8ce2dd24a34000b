"""The remote tier: keyed pages shared through a keyed medium (a Redis / Valkey store).

Contract:
    * Only keyed (prefix) pages go remote, under store keys derived from the cluster-wide secret
      and the tenant-salted block key (``kvtier.tiers.frame``): no tenant can name another's
      pages, and nobody without the secret can name or forge any.
    * ``offer(items)``: stored blocks ``(salted key, open frame)`` (``frame_buffer``: the block's
      bytes already copied into the value's place, so framing copies nothing) go to the
      write-behind queue
      (``kvtier.tiers.writebehind``) — bounded, its own thread; a full queue drops and counts.
      ``admission`` (always | reused | never) says whether a Store (always) or a block's first
      reuse by a Load (reused) offers it; ``never`` makes the tier read-only.
    * ``contains(salted) -> int``: how many leading keys the store holds (one pipelined batch).
    * ``fetch(salted, length) -> list[memoryview]``: the payloads of the leading keys whose
      values verify (exact bytes a daemon of this cluster stored for that tenant and key); the
      first miss or refused value ends the list, and so does ``MAX_FETCH_BYTES`` (a longer
      prefix loads in part: the caller loads the rest again). Refusals are counted by reason.
    * Every fault of the store is a miss (the medium's contract); nothing here raises for one.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvtier.config import ENV_PREFIX, MIB, OffloadConfig
from kvtier.errors import ConfigError
from kvtier.tiers.frame import Framer
from kvtier.tiers.keyed import KeyedMedium
from kvtier.tiers.writebehind import WriteBehind

log = logging.getLogger(__name__)
RECENT_KEYS = 65536  # salted keys known to be in the store (not offered again)
GET_BATCH_BYTES = 4 * MIB  # payload bytes fetched per pipelined batch
MAX_FETCH_BYTES = 256 * MIB  # payload bytes one fetch (one Load) brings at most
# Batches read and checked at once, each on its own connection. One: on a 16-core H100 host
# (redis-py 8.1 + hiredis, 256 KiB values) 1 thread fetched 1.00 GB/s, 3 or 6 threads 0.85
# (the threads' reply parsing contends for the interpreter lock).
FETCH_THREADS = 1
WRITE_THREADS = 2  # write-behind threads: one frames a batch while another sends one


@dataclass(slots=True, frozen=True)
class RemoteStats:
    """A snapshot for ``kvtier status`` and the metrics exporter."""

    reachable: bool
    written_pages: int
    written_bytes: int
    read_pages: int
    read_bytes: int
    queued_bytes: int
    dropped: dict[str, int] = field(default_factory=dict)  # write drops by reason
    rejected: dict[str, int] = field(default_factory=dict)  # refused values by reason
    errors: dict[str, int] = field(default_factory=dict)  # store faults by kind


class RemoteTier:
    def __init__(
        self, medium: KeyedMedium, framer: Framer, *, admission: str = "always",
        ttl_s: int = 0, max_inflight_bytes: int = 256 * MIB, batch_bytes: int = 16 * MIB,
    ) -> None:
        self.medium, self.framer, self.admission = medium, framer, admission
        self._writer = WriteBehind(
            medium, self._encode, max_bytes=max_inflight_bytes, batch_bytes=batch_bytes,
            ttl_s=ttl_s, threads=WRITE_THREADS, on_drop=self._forget,
        )
        self._fetchers = ThreadPoolExecutor(FETCH_THREADS, "kvtier-remote-fetch")
        self._lock = threading.Lock()
        # Keys known to be in the store (not offered again), with when that was last known:
        # a miss forgets one, and one older than half the store's TTL is offered again.
        self._recent: OrderedDict[bytes, float] = OrderedDict()
        self._fresh_s = ttl_s / 2 if ttl_s else math.inf
        self._read_pages = self._read_bytes = 0
        self._rejected: dict[str, int] = {}

    def frame_buffer(self, salted: bytes, n: int) -> tuple[bytearray, memoryview]:
        """A value's buffer for ``salted`` and the view its ``n`` block bytes are copied into."""
        return self.framer.open(salted, n)

    def _encode(self, salted: bytes, buf: bytearray) -> tuple[bytes, memoryview]:
        return self.framer.store_key(salted), self.framer.seal(buf)

    def _remember(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._recent[key] = now
                self._recent.move_to_end(key)
            while len(self._recent) > RECENT_KEYS:
                self._recent.popitem(last=False)

    def _forget(self, keys: Sequence[bytes]) -> None:
        """Keys that may not be in the store (evicted from the queue, in a batch the store did
        not wholly take, missed or refused on a read: lost, expired or tampered with there):
        worth offering again."""
        with self._lock:
            for key in keys:
                self._recent.pop(key, None)

    def wants(self, salted: bytes) -> bool:
        """Whether a block is worth offering (not known to be in the store already, or known
        for longer than half its TTL: it may have expired there)."""
        with self._lock:
            known = self._recent.get(salted)
        return known is None or time.monotonic() - known > self._fresh_s

    def offer(self, items: Sequence[tuple[bytes, bytearray]], tenant: str = "") -> int:
        """Queue one tenant's framed blocks for the store (fair between tenants: see
        ``WriteBehind``); how many were queued."""
        taken = self._writer.offer(items, tenant)
        self._remember([k for k, _ in items[:taken]])
        return taken

    def contains(self, salted: Sequence[bytes]) -> int:
        found = self.medium.contains_many([self.framer.store_key(k) for k in salted])
        if False in found:
            self._forget([k for k, there in zip(salted, found, strict=True) if not there])
            return found.index(False)
        return len(found)

    def fetch(self, salted: Sequence[bytes], length: int) -> list[memoryview]:
        """The verified values of the longest stored prefix of ``salted`` (a bounded window)."""
        out: list[memoryview] = []

        def keep(batch: list[memoryview]) -> int:
            out.extend(batch)
            return len(batch)

        self.fetch_each(salted, length, keep)
        return out

    def fetch_each(self, salted: Sequence[bytes], length: int,
                   take: Callable[[list[memoryview]], int]) -> int:
        """Hand each batch of verified values of the longest stored prefix of ``salted`` to
        ``take`` as it arrives, in order (the next batches are read meanwhile); ``take`` returns
        how many it kept, fewer ending the fetch. Returns how many were kept in all."""
        # At most MAX_FETCH_BYTES a call, in batches of GET_BATCH_BYTES: FETCH_THREADS batches
        # are read and MAC-checked at once (on their own connections; hashing and socket reads
        # run without the GIL), results taken in order; the first miss or refusal ends it.
        salted = salted[: max(1, MAX_FETCH_BYTES // max(1, length))]
        step = max(1, GET_BATCH_BYTES // max(1, length))
        parts = [salted[lo : lo + step] for lo in range(0, len(salted), step)]
        ahead: deque[Future[list[memoryview | str | None]]] = deque()
        kept = sent = 0
        try:
            while sent < len(parts) or ahead:
                # one batch more than the threads: a thread never waits for the caller
                while sent < len(parts) and len(ahead) <= FETCH_THREADS:
                    ahead.append(self._fetchers.submit(self._get_verified, parts[sent], length))
                    sent += 1
                got = ahead.popleft().result()
                good = self._prefix_of_values(got)
                n = take(good) if good else 0
                kept += n
                if n < len(got):
                    if len(good) < len(got):  # missed or refused there: offer it again
                        self._forget([salted[kept - n + len(good)]])
                    break
            return kept
        finally:
            for fut in ahead:
                fut.cancel()  # a batch already running ends within the store's timeout
            self._fetched(salted, kept, length)

    def _get_verified(
        self, keys: Sequence[bytes], length: int
    ) -> list[memoryview | str | None]:
        # Read no more of a value than a good one holds (+1 byte: a longer one is refused).
        most = max((self.framer.framed_size(k, length) for k in keys), default=0)
        values = self.medium.get_many([self.framer.store_key(k) for k in keys], most)
        unframe = self.framer.unframe
        return [None if v is None else unframe(k, v, length)
                for k, v in zip(keys, values, strict=True)]

    def _prefix_of_values(self, got: list[memoryview | str | None]) -> list[memoryview]:
        """The values before the first miss (None) or refused value (its reason, counted)."""
        good: list[memoryview] = []
        for v in got:
            if not isinstance(v, memoryview):
                if isinstance(v, str):
                    self._count_rejected(v)
                break
            good.append(v)
        return good

    def _fetched(self, salted: Sequence[bytes], n: int, length: int) -> None:
        self._remember(list(salted[:n]))
        with self._lock:
            self._read_pages += n
            self._read_bytes += sum(self.framer.framed_size(s, length) for s in salted[:n])

    def _count_rejected(self, reason: str) -> None:
        log.debug("remote value refused (%s)", reason)
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def flush(self, timeout: float) -> bool:
        """Wait until every offered block is written or dropped (benchmarks, tests, drain)."""
        return self._writer.flush(timeout)

    def stats(self) -> RemoteStats:
        health, w = self.medium.health(), self._writer.counters
        with self._lock:
            return RemoteStats(
                reachable=health.reachable, written_pages=w.pages, written_bytes=w.bytes,
                read_pages=self._read_pages, read_bytes=self._read_bytes,
                queued_bytes=self._writer.queued_bytes, dropped=dict(w.dropped),
                rejected=dict(self._rejected), errors=dict(health.errors),
            )

    def close(self, timeout: float) -> None:
        self._writer.close(timeout)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self.medium.close()


def read_private(path: str, var: str) -> bytes:
    """A secret file's bytes (stripped); refuses a file that group or others can read."""
    name = ENV_PREFIX + var
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{name}: {path!r} is not a regular file")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"{name}: {path!r} is readable by group or others; make it private (chmod 600)"
            )
        with open(path, "rb") as fh:
            data = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
    if not data:
        raise ConfigError(f"{name}: {path!r} is empty")
    return data


def open_remote(config: OffloadConfig, medium: KeyedMedium | None = None) -> RemoteTier | None:
    """The remote tier ``config`` asks for (``medium`` replaces the Redis one), or None."""
    if medium is None and not config.remote_url:
        return None
    if not config.remote_secret_file:
        raise ConfigError(f"{ENV_PREFIX}REMOTE_SECRET_FILE: the remote tier needs a secret file")
    secret = read_private(config.remote_secret_file, "REMOTE_SECRET_FILE")
    if len(secret) < 16:
        raise ConfigError(f"{ENV_PREFIX}REMOTE_SECRET_FILE: the secret must hold >= 16 bytes")
    try:
        framer = Framer(secret)
        if medium is None:
            from kvtier.tiers.redis_medium import RedisMedium
    except ImportError as exc:
        raise ConfigError(
            f"{ENV_PREFIX}REMOTE_URL: the remote tier needs the packages redis, hiredis and "
            f"blake3 ({exc.name} is not installed)"
        ) from None
    if medium is None:
        password = None
        if config.remote_password_file:
            raw = read_private(config.remote_password_file, "REMOTE_PASSWORD_FILE")
            password = raw.decode("utf-8", "replace")
        medium = RedisMedium(
            config.remote_url, password=password, timeout_s=config.remote_timeout_ms / 1000
        )
    return RemoteTier(
        medium, framer, admission=config.remote_admission, ttl_s=config.remote_ttl_s,
        max_inflight_bytes=config.remote_inflight_mb * MIB,
        batch_bytes=min(config.batch_bytes, 16 * MIB),
    )
