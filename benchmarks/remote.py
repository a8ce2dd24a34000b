"""Remote tier benchmark: kvtier's remote store and load against the raw redis client, same run.

Measures, against one real redis-server (started here on a free 127.0.0.1 port unless ``--url``):
    * store: ``engine.store`` of N pages until the write-behind queue has written them all
      (copy to CPU, copy out, MAC framing, pipelined SET) — GB/s and keys/s — against the raw
      client's pipelined SET of values of the same size, in batches of the same bytes; and how
      long the Store call itself took (the write-behind goes on after it returns);
    * load: ``engine.load`` of those N pages into a second engine that has none of them locally
      (pipelined GET, MAC check, landing in CPU, copy into the pool) against pipelined GET;
    * the remote path alone as the engine drives it (write-behind: copy into the framed value,
      MAC, pipelined SET; fetch: pipelined GET, MAC check), against the same raw figures;
    * Lookup of 64 keys held only by the store (one pipelined EXISTS batch): p50 / p99.
Each figure is the best of ``--rounds``; raw and kvtier alternate inside every round.

    python benchmarks/remote.py --page-kib 256 --mib 256 --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import torch

import kvtier.prefix.remote as remote_mod
from kvtier import OffloadConfig, TierEngine

MIB = 1 << 20


def start_redis(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not installed (apt-get install redis-server) and no --url given")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp,
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}"


def engine(url: str, secret: str, page: int, n: int, device: str) -> TierEngine:
    cfg = OffloadConfig(
        device=device, page_size=page, cpu_memory_gb=2 * n * page / 2**30,
        gpu_memory_gb=2 * n * page / 2**30, metrics_addr="", remote_url=url,
        remote_secret_file=secret, remote_timeout_ms=5000, remote_inflight_mb=4096,
        remote_ttl_s=600,
    )
    return TierEngine(cfg)


def raw_round(r: redis.Redis, values: list[bytes], batch: int) -> tuple[float, float]:
    keys = [b"raw:%d" % i for i in range(len(values))]
    t0 = time.perf_counter()
    for lo in range(0, len(keys), batch):
        p = r.pipeline(transaction=False)
        for k, v in zip(keys[lo : lo + batch], values[lo : lo + batch], strict=True):
            p.set(k, v, ex=600)
        p.execute()
    t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    for lo in range(0, len(keys), batch):
        p = r.pipeline(transaction=False)
        for k in keys[lo : lo + batch]:
            p.get(k)
        got = p.execute()
        assert all(len(g) == len(values[0]) for g in got)
    t_get = time.perf_counter() - t0
    r.flushdb()  # both paths write into an emptied store
    return t_set, t_get


class Pair:
    """Two engines on one store, created once (host memory touched by a warm-up round)."""

    def __init__(self, url: str, secret: str, page: int, n: int, device: str) -> None:
        self.page, self.n = page, n
        self.a, self.b = engine(url, secret, page, n, device), engine(url, secret, page, n, device)
        self.pa, self.pb = self.a.attach("bench", n), self.b.attach("bench", n)
        self.slots_a = [s for _, s in self.a.allocate(self.pa.pool_id, n)]
        self.slots_b = [s for _, s in self.b.allocate(self.pb.pool_id, n)]
        self.pa.segments[0][self.slots_a] = torch.randint(0, 256, (n, page), dtype=torch.uint8).to(
            self.pa.segments[0].device)

    def remote_only(self, tag: int) -> tuple[float, float]:
        """The remote path alone, as the engine drives it: (write-behind of N pages: copy into
        the value, MAC, pipelined SET; fetch of N pages: pipelined GET, MAC check) seconds."""
        remote, n, page = self.a.prefix._core.remote, self.n, self.page
        salted = [b"remote-only-%d-%d" % (tag, i) for i in range(n)]
        pages = self.pa.segments[0][self.slots_a].cpu().numpy()
        t0 = time.perf_counter()
        items = []
        for key, row in zip(salted, pages, strict=True):
            buf, body = remote.frame_buffer(key, page)
            body[:] = row.data
            items.append((key, buf))
        assert remote.offer(items) == n and remote.flush(600)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        step = max(1, remote_mod.MAX_FETCH_BYTES // page)  # one fetch brings a bounded window
        assert sum(len(remote.fetch(salted[lo : lo + step], page)) for lo in range(0, n, step)) == n
        return t_write, time.perf_counter() - t0

    def tune(self, fetch_threads: int, batch_mib: float) -> None:
        """The fetch's knobs for the tuning sweep (threads, pipelined batch)."""
        for engine in (self.a, self.b):
            remote = engine.prefix._core.remote
            remote._fetchers.shutdown(wait=True)
            remote._fetchers = ThreadPoolExecutor(fetch_threads, "kvtier-remote-fetch")
        remote_mod.GET_BATCH_BYTES = int(batch_mib * MIB)
        remote_mod.FETCH_THREADS = fetch_threads

    def round(self, tag: int) -> tuple[float, float, float, list[float]]:
        """(Store call, Store until written remotely, Load, 64-key Lookups) in seconds."""
        a, b, n = self.a, self.b, self.n
        keys = [b"bench-%d-%d" % (tag, i) for i in range(n)]
        remote_a = a.prefix._core.remote
        written = a.stats().remote.written_pages
        t0 = time.perf_counter()
        assert a.store(self.pa.pool_id, keys, self.slots_a) == n
        t_call = time.perf_counter() - t0
        assert remote_a.flush(600)
        t_store = time.perf_counter() - t0
        assert a.stats().remote.written_pages - written == n, a.stats().remote
        lookups = []
        for i in range(200):
            part = keys[(i * 64) % max(1, n - 64) :][:64]
            t1 = time.perf_counter()
            assert b.lookup("bench", part)
            lookups.append(time.perf_counter() - t1)
        t0 = time.perf_counter()
        assert b.load(self.pb.pool_id, keys, self.slots_b) == n
        t_load = time.perf_counter() - t0
        assert torch.equal(self.pb.segments[0][self.slots_b], self.pa.segments[0][self.slots_a])
        return t_call, t_store, t_load, lookups

    def close(self) -> None:
        self.a.close(grace=5)
        self.b.close(grace=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="", help="an existing store (default: start redis-server)")
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--mib", type=int, default=256, help="bytes stored and loaded per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cpu", help="the engines' GPU tier: cpu or cuda")
    ap.add_argument("--write-threads", type=int, default=0,
                    help="write-behind threads of the engines (default: the tier's own)")
    ap.add_argument("--tune", nargs="*", default=[],
                    help="fetch settings to compare after the rounds: threads:batch_mib")
    args = ap.parse_args()
    if args.write_threads:
        remote_mod.WRITE_THREADS = args.write_threads
    page, n = args.page_kib * 1024, args.mib * MIB // (args.page_kib * 1024)
    batch = max(1, 16 * MIB // page)  # the remote tier's pipelined batch: 16 MiB
    tmp = tempfile.mkdtemp(prefix="kvtier-remote-bench-")
    secret = os.path.join(tmp, "secret")
    with open(secret, "wb") as fh:
        fh.write(os.urandom(32))
    os.chmod(secret, 0o600)
    proc, url = (None, args.url) if args.url else start_redis(tmp)
    try:
        r = redis.Redis.from_url(url, socket_timeout=60)
        values = [os.urandom(page) for _ in range(min(n, 64))]
        values = [values[i % len(values)] for i in range(n)]
        raw, ours, lookups = [], [], []
        pair = Pair(url, secret, page, n, args.device)
        try:
            pair.round(-1)  # warm-up: first touch of host memory, connections
            r.flushdb()
            raw_round(r, values, batch)
            for k in range(args.rounds):
                raw.append(raw_round(r, values, batch))
                t_call, t_store, t_load, lk = pair.round(k)
                r.flushdb()
                t_write, t_fetch = pair.remote_only(k)
                r.flushdb()
                ours.append((t_store, t_load, t_call, t_write, t_fetch))
                lookups += lk
            tuned = [sweep_point(pair, r, values, batch, p, args.rounds) for p in args.tune]
        finally:
            pair.close()
        result = report(page, n, raw, ours, lookups)
        if tuned:
            result["fetch_tuning"] = tuned
        result["server"] = f"redis-server {r.info()['redis_version']}, 127.0.0.1"
    finally:
        if proc is not None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"remote-{args.device}-{args.page_kib}k.json"
        (Path(args.out) / name).write_text(json.dumps(result, indent=2))


def sweep_point(pair: Pair, r: redis.Redis, values: list[bytes], batch: int, point: str,
                rounds: int) -> dict:
    """Remote fetch ÷ raw GET (each round measures both) with the fetch's knobs set to
    ``point`` = "threads:batch_mib"."""
    threads, batch_mib = point.split(":")
    pair.tune(int(threads), float(batch_mib))
    raws, fetches = [], []
    for k in range(rounds):
        raws.append(raw_round(r, values, batch)[1])
        fetches.append(pair.remote_only(1000 + k)[1])
        r.flushdb()
    nbytes = pair.page * pair.n
    return {"point": point, "fetch_gbs": round(nbytes / min(fetches) / 1e9, 3),
            "raw_get_gbs": round(nbytes / min(raws) / 1e9, 3),
            "fetch_vs_raw": round(statistics.median(a / b for a, b in zip(raws, fetches,
                                                                           strict=True)), 2)}


def report(page: int, n: int, raw: list, ours: list, lookups: list[float]) -> dict:
    """Best of the rounds for every rate, the median of per-round ratios to the raw client;
    every Lookup sample for the latency quantiles."""
    nbytes = page * n

    def best(ts: list[float]) -> dict:
        t = min(ts)
        return {"GB/s": round(nbytes / t / 1e9, 3), "keys/s": round(n / t)}

    out = {
        "device": f"{os.cpu_count()} CPUs, torch {torch.__version__}, redis-py {redis.__version__}"
                  + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "page_bytes": page, "pages": n,
        "raw_set": best([x[0] for x in raw]), "raw_get": best([x[1] for x in raw]),
        "kvtier_store": best([x[0] for x in ours]), "kvtier_load": best([x[1] for x in ours]),
        "kvtier_store_call_ms": round(min(x[2] for x in ours) * 1e3, 1),
        "remote_write": best([x[3] for x in ours]), "remote_fetch": best([x[4] for x in ours]),
        "lookup64_us": {"p50": round(statistics.median(lookups) * 1e6),
                        "p99": round(statistics.quantiles(lookups, n=100)[98] * 1e6)},
    }
    # Ratios pair each round with the raw client's round just before it (the loopback store's
    # rate swings +-25% between seconds): the median of the rounds' ratios, and their range.
    # (our figure, its index in a round of ours, the raw index: 0 SET, 1 GET)
    for ours_, i, j in (("kvtier_store", 0, 0), ("kvtier_load", 1, 1), ("remote_write", 3, 0),
                        ("remote_fetch", 4, 1)):
        ratios = [r[j] / o[i] for r, o in zip(raw, ours, strict=True)]
        out[f"{ours_}_vs_raw"] = round(statistics.median(ratios), 2)
        out[f"{ours_}_vs_raw_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
    return out


if __name__ == "__main__":
    main()
