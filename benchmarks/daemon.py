"""Daemon benchmark: the engine behind gRPC (unix socket) against the same engine in-process.

Measures, in one run on one device:
    * Acquire round trip of resident pages (p50/p99), one page and eight pages per call (the
      client sends these through the fast lane: ``lane_share`` is the part it answered, the rest
      fell back to gRPC), one page through gRPC only (``rtt_1_grpc``), and 4,096 pages of 16 KiB
      per call through the fast lane and through gRPC;
    * restore GB/s of 1 GiB of 2 MiB pages through the daemon vs the in-process engine;
    * pages/s with many engines (threads, one tenant and pool each) acquiring and releasing.
Writes ``daemon.md`` and ``daemon.json`` to ``--out``.

    python benchmarks/daemon.py --out results/     # CUDA if present; --device cpu for a smoke run

``--idle-watches 0,256`` measures only what open, idle WatchEvents streams cost every other caller:
Stats and a one-page gRPC Acquire (p50/p99) with that many streams open (spread over tenants
of at most ``WATCHES_PER_TENANT`` streams, one channel each), into ``daemon_watch.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from kvtier.client import KVTierClient

from kvtier import OffloadConfig, PageState, TierEngine

GIB = 1 << 30
PAGE = 2 << 20
ROUNDS = 3  # restores are timed as the best of this many, in-process and daemon alike


def q(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100)[p - 1] * 1e6


def start_daemon(tmp: Path, device: str, gpu_gb: float, cpu_gb: float) -> tuple[subprocess.Popen, str]:
    sock = f"unix://{tmp}/k.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_OFFLOAD_")}
    env.update(KVCACHED_OFFLOAD_PAGE_SIZE=str(PAGE), KVCACHED_OFFLOAD_THRESHOLD="1.0",
               KVCACHED_OFFLOAD_LOW_WATERMARK="0.99", KVCACHED_OFFLOAD_PINNED_CHUNK_MB="256")
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", sock, "--metrics-addr", "",
            "--device", device, "--gpu-memory-gb", str(gpu_gb), "--cpu-memory-gb", str(cpu_gb),
            "--log-level", "warning"]
    proc = subprocess.Popen(argv, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(sock) as ch:
                grpc.channel_ready_future(ch).result(timeout=1)
            return proc, sock
        except grpc.FutureTimeoutError:
            if proc.poll() is not None:
                raise RuntimeError("daemon exited") from None
    raise RuntimeError("daemon never became ready")


def wait_idle(client: KVTierClient) -> None:
    """Until no move is queued or in flight (the daemon-wide view: a tenant's has no queues)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        s = client.stats(whole=True)
        if s.queued_offloads == 0 and s.queued_restores == 0 and s.inflight_bytes == 0:
            return
        time.sleep(0.0005)
    raise TimeoutError("daemon transfers never drained")


def rtt(client: KVTierClient, att, ids: list[int], per_call: int, n: int = 2000) -> dict[str, float]:
    """Acquire round trips (Release untimed); with a fast lane, the part of the calls (both
    kinds) it answered."""
    lat = []
    hits = att.fast_lane.hits if att.fast_lane is not None else 0
    for i in range(n):
        sel = [ids[(i * per_call + j) % len(ids)] for j in range(per_call)]
        t0 = time.perf_counter()
        client.acquire(att, sel)
        lat.append(time.perf_counter() - t0)
        client.release(att, sel)
    out = {"p50_us": q(lat, 50), "p99_us": q(lat, 99)}
    if att.fast_lane is not None:
        out["lane_share"] = (att.fast_lane.hits - hits) / (2 * n)
    return out


def large_calls(client: KVTierClient, pages: int = 4096) -> dict[str, dict[str, float]]:
    """Acquire round trip of ``pages`` resident 16 KiB pages (the fast lane's largest call),
    through the fast lane and through gRPC: what the daemon spends per page id."""
    att = client.attach(pages, page_size=16 << 10)
    ids = [p for p, _ in client.allocate(att, pages)]
    client.release(att, ids)
    out = {"rtt_4096_lane": rtt(client, att, ids, pages, n=200),
           "rtt_4096_grpc": rtt(client, dataclasses.replace(att, fast_lane=None), ids, pages,
                                n=200)}
    client.detach(att)
    return out


def daemon_restore(client: KVTierClient, att, ids: list[int], nbytes: int) -> float:
    n = nbytes // PAGE
    victims = ids[:n]
    best = float("inf")
    for i in range(ROUNDS + 1):  # round 0 pins the host chunks and is not counted
        client.offload(att, victims)
        wait_idle(client)
        t0 = time.perf_counter()
        client.acquire(att, victims, timeout=60)
        best = min(best, time.perf_counter() - t0) if i else best
        client.release(att, victims)
    return nbytes / best / 1e9


def inproc_restore(device: str, nbytes: int) -> float:
    n = nbytes // PAGE
    cfg = OffloadConfig(device=device, page_size=PAGE, gpu_memory_gb=2 * nbytes / GIB + 0.1,
                        cpu_memory_gb=2 * nbytes / GIB, pinned_chunk_mb=256, threshold=1.0,
                        low_watermark=0.99, metrics_addr="")
    engine = TierEngine(cfg)
    try:
        pool = engine.attach("inproc", 2 * n, PAGE)
        ids = [p for p, _ in engine.allocate(pool.pool_id, 2 * n)]
        engine.release(pool.pool_id, ids)
        victims = ids[:n]
        best = float("inf")
        for i in range(ROUNDS + 1):  # measured exactly like the daemon: best of ROUNDS
            engine.offload(pool.pool_id, victims)
            engine.wait_idle()
            assert engine.page_info(pool.pool_id, victims[-1]).state is PageState.CPU
            t0 = time.perf_counter()
            engine.acquire(pool.pool_id, victims)
            best = min(best, time.perf_counter() - t0) if i else best
            engine.release(pool.pool_id, victims)
        return nbytes / best / 1e9
    finally:
        engine.close()


def many_engines(address: str, engines: int, seconds: float) -> float:
    done = [0] * engines
    stop = time.monotonic() + seconds

    def worker(k: int) -> None:
        with KVTierClient(address, f"engine-{k}") as c:
            att = c.attach(16)
            got = c.allocate(att, 16)
            ids = [p for p, _ in got]
            c.release(att, ids)
            while time.monotonic() < stop:
                c.acquire(att, ids[:4])
                c.release(att, ids[:4])
                done[k] += 4
            c.detach(att)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds


WATCHES_PER_TENANT = 8


def timed(call, n: int, budget_s: float) -> dict[str, float]:
    """p50/p99 of ``call`` over ``n`` samples, or fewer (at least 20) if ``budget_s`` runs out."""
    lat: list[float] = []
    stop = time.monotonic() + budget_s
    while len(lat) < n and (len(lat) < 20 or time.monotonic() < stop):
        t0 = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t0)
    return {"p50_us": q(lat, 50), "p99_us": q(lat, 99), "samples": len(lat)}


def idle_watch_costs(address: str, counts: list[int], n: int = 500) -> dict[str, dict]:
    """Other calls' latency with ``count`` idle WatchEvents streams open (nothing moves)."""
    from kvtier.v1 import kvtier_pb2 as pb
    from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

    out: dict[str, dict] = {}
    with KVTierClient(address, "bench", timeout=60) as client:
        att = client.attach(4)
        ids = [p for p, _ in client.allocate(att, 1)]
        client.release(att, ids)
        grpc_only = dataclasses.replace(att, fast_lane=None)
        for count in counts:
            channels = [grpc.insecure_channel(address)
                        for _ in range(-(-count // WATCHES_PER_TENANT))]
            streams = [pb_grpc.KVTierStub(channels[i // WATCHES_PER_TENANT]).WatchEvents(
                pb.WatchRequest(tenant=f"watcher-{i // WATCHES_PER_TENANT}")) for i in range(count)]
            time.sleep(2.0)  # every stream open on the daemon
            alive = sum(1 for s in streams if not s.done())

            def acquire() -> None:
                client.acquire(grpc_only, ids)
                client.release(grpc_only, ids)

            out[str(count)] = {"open": alive, "stats": timed(client.stats, n, 30.0),
                               "acquire_release": timed(acquire, n, 30.0)}
            print(json.dumps({count: out[str(count)]}), flush=True)
            for st in streams:
                st.cancel()
            for ch in channels:
                ch.close()
            time.sleep(1.0)
        client.detach(att)
    return out


def watch_main(args: argparse.Namespace) -> None:
    counts = [int(c) for c in args.idle_watches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_daemon(Path(tmp), args.device, 0.1, 0.1)
        try:
            res = idle_watch_costs(address, counts)
        finally:
            proc.terminate()
            proc.wait(30)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon_watch.json").write_text(json.dumps(res, indent=2))
    md = [f"Device: {args.device}; unix socket; one caller, gRPC only (no fast lane)", "",
          "| idle WatchEvents streams | Stats p50 / p99 | Acquire+Release (1 page, gRPC) p50 / p99 |",
          "|---|---|---|"]
    for count, r in res.items():
        s, a = r["stats"], r["acquire_release"]
        md.append(f"| {count} (open: {r['open']}) | {s['p50_us']:.0f} / {s['p99_us']:.0f} us "
                  f"({s['samples']} calls) | {a['p50_us']:.0f} / {a['p99_us']:.0f} us "
                  f"({a['samples']} calls) |")
    (args.out / "daemon_watch.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--idle-watches", default="", metavar="N,N,...",
                    help="only measure other calls with this many idle WatchEvents streams open")
    args = ap.parse_args()
    if args.idle_watches:
        watch_main(args)
        return
    nbytes = int(args.gib * GIB)
    res: dict[str, object] = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    res["inproc_restore_gbs"] = inproc_restore(args.device, nbytes)
    print(json.dumps(res), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_daemon(Path(tmp), args.device, 2 * args.gib + 1, 2 * args.gib + 0.5)
        try:
            with KVTierClient(address, "bench", timeout=60) as client:
                att = client.attach(2 * (nbytes // PAGE))
                got = client.allocate(att, 2 * (nbytes // PAGE))
                ids = [p for p, _ in got]
                client.release(att, ids)
                res["rtt_1"] = rtt(client, att, ids, 1)
                res["rtt_8"] = rtt(client, att, ids, 8)
                res["rtt_1_grpc"] = rtt(client, dataclasses.replace(att, fast_lane=None), ids, 1)
                res["daemon_restore_gbs"] = daemon_restore(client, att, ids, nbytes)
                client.detach(att)
                res.update(large_calls(client))
            print(json.dumps(res), flush=True)
            res["pages_per_s"] = many_engines(address, args.engines, args.seconds)
        finally:
            proc.terminate()
            proc.wait(30)
    res["restore_ratio"] = res["daemon_restore_gbs"] / res["inproc_restore_gbs"]  # type: ignore[operator]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon.json").write_text(json.dumps(res, indent=2))
    r1, r8, g1 = res["rtt_1"], res["rtt_8"], res["rtt_1_grpc"]
    lane = f"fast lane ({r1.get('lane_share', 0):.0%} of calls)"  # type: ignore[attr-defined]
    md = [f"Device: {res['device']}; unix socket; 2 MiB pages", "",
          "| measure | value |", "|---|---|",
          f"| Acquire round trip, 1 resident page, {lane}: p50 / p99 | {r1['p50_us']:.0f} / {r1['p99_us']:.0f} us |",  # type: ignore[index]
          f"| Acquire round trip, 8 resident pages, fast lane: p50 / p99 | {r8['p50_us']:.0f} / {r8['p99_us']:.0f} us |",  # type: ignore[index]
          f"| Acquire round trip, 1 resident page, gRPC only: p50 / p99 | {g1['p50_us']:.0f} / {g1['p99_us']:.0f} us |",  # type: ignore[index]
          f"| Acquire round trip, 4096 resident 16 KiB pages, fast lane / gRPC: p50 | {res['rtt_4096_lane']['p50_us']:.0f} / {res['rtt_4096_grpc']['p50_us']:.0f} us |",  # type: ignore[index]
          f"| restore of {args.gib} GiB through the daemon | {res['daemon_restore_gbs']:.1f} GB/s |",
          f"| same restore in-process | {res['inproc_restore_gbs']:.1f} GB/s |",
          f"| daemon / in-process | {res['restore_ratio']:.2f} |",
          f"| acquire+release pages/s, {args.engines} engines | {res['pages_per_s']:.0f} |"]
    (args.out / "daemon.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
