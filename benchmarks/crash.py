"""Crash benchmark: keys a real daemon finds again after kill -9 under store load, and after SIGTERM.

Each kill trial starts a daemon (small CPU tier, so stored keys cascade to disk), stores keys in
batches of 8 from one client thread, looks up every acknowledged key every ``--sample`` seconds
(a key seen on DISK is "on disk" from that sample on), kills the daemon with SIGKILL after a random
``--min-s``..``--max-s`` seconds, restarts it on the same directory and loads every acknowledged key
(plus the batch in flight) checking its bytes. Reported per trial:
    * acked: keys acknowledged by ``store`` before the kill;
    * on disk: keys seen on DISK in a sample taken >= 100 ms before the kill;
    * recovered: of those, found after the restart with exact bytes (the goal: all of them);
    * found: all keys found after the restart; wrong: pages with wrong bytes (must be 0).
The SIGTERM trial stores keys that stay in the CPU tier, stops the daemon cleanly and counts those
found after the restart. ``--baseline-src DIR`` also runs every trial with the daemon imported from
DIR (e.g. an export of an older commit), in the same run, for comparison.

    python benchmarks/crash.py --trials 3 --baseline-src /tmp/base      # CPU mode, a few minutes
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from kvtier.client import KVTierClient

from kvtier.types import Tier

PAGE = 64 * 1024
GIB = 1 << 30
WINDOW = 16


def key(i: int) -> bytes:
    return f"bench-{i}".encode()


def page(i: int) -> torch.Tensor:
    data = torch.full((PAGE,), (i * 7) % 251, dtype=torch.uint8)
    data[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
    return data


def start(tmp: Path, disk: Path, cpu_pages: int, src: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_OFFLOAD_")}
    env.update(KVCACHED_OFFLOAD_PAGE_SIZE=str(PAGE), KVCACHED_OFFLOAD_DISK_ADMISSION="always",
               KVCACHED_OFFLOAD_PINNED_CHUNK_MB="1", KVCACHED_OFFLOAD_BATCH_MB="1")
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    sock = tmp / "k.sock"
    if sock.exists():
        sock.unlink()
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"unix://{sock}",
            "--metrics-addr", "", "--device", "cpu", "--disk-path", str(disk),
            "--disk-gb", "1", "--cpu-memory-gb", repr(cpu_pages * PAGE / GIB),
            "--gpu-memory-gb", repr(64 * PAGE / GIB), "--grace", "10", "--log-level", "warning"]
    proc = subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                grpc.channel_ready_future(ch).result(timeout=1)
            return proc
        except grpc.FutureTimeoutError:
            if proc.poll() is not None:
                raise RuntimeError("daemon exited") from None
    raise RuntimeError("daemon never became ready")


def store_forever(c: KVTierClient, acked: list[int], stop: threading.Event) -> None:
    try:
        att = c.attach(8)
        assert att.tensor is not None
        while not stop.is_set():
            got = c.allocate(att, 8)
            assert got is not None
            first = acked[0]
            for n, (_, slot) in enumerate(got):
                att.tensor[slot].copy_(page(first + n))
            assert c.store(att, [key(first + n) for n in range(8)], [s for _, s in got]) == 8
            acked[0] = first + 8
            c.free(att, [p for p, _ in got])
    except Exception:  # the kill ends it
        pass


def check(c: KVTierClient, keys: list[int]) -> tuple[set[int], int]:
    """Keys found with exact bytes, and the number found with wrong bytes."""
    att = c.attach(WINDOW)
    assert att.tensor is not None
    got = c.allocate(att, WINDOW)
    assert got is not None
    slots = [s for _, s in got]
    good: set[int] = set()
    wrong = 0
    for lo in range(0, len(keys), WINDOW):
        part = keys[lo : lo + WINDOW]
        while part:
            n = c.load(att, [key(i) for i in part], slots[: len(part)])
            for j in range(n):
                if torch.equal(att.tensor[slots[j]], page(part[j])):
                    good.add(part[j])
                else:
                    wrong += 1
            part = part[n + 1 :]
    return good, wrong


@dataclass
class Kill:
    acked: int
    on_disk: int
    recovered: int
    found: int
    wrong: int


def kill_trial(tmp: Path, src: str | None, run_s: float, sample_s: float) -> Kill:
    disk = tmp / "disk"
    proc = start(tmp, disk, 16, src)
    sock = f"unix://{tmp}/k.sock"
    acked, stop = [0], threading.Event()
    loader = KVTierClient(sock, "bench")
    thread = threading.Thread(target=store_forever, args=(loader, acked, stop), daemon=True)
    thread.start()
    samples: list[tuple[float, set[int]]] = []
    t_end = time.monotonic() + run_s
    with KVTierClient(sock, "bench") as watcher:
        while time.monotonic() < t_end:
            n = acked[0]
            tiers = watcher.lookup([key(i) for i in range(n)]) if n else []
            samples.append((time.monotonic(), {i for i, t in enumerate(tiers) if t is Tier.DISK}))
            time.sleep(sample_s)
    killed_at = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stop.set()
    thread.join(10)
    loader.close()
    on_disk: set[int] = set()
    for at, seen in samples:
        if at <= killed_at - 0.1:
            on_disk |= seen
    proc = start(tmp, disk, 16, src)
    try:
        with KVTierClient(sock, "bench") as c:
            good, wrong = check(c, list(range(acked[0] + 8)))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return Kill(acked[0], len(on_disk), len(on_disk & good), len(good), wrong)


def term_trial(tmp: Path, src: str | None, n: int) -> tuple[int, int]:
    """(keys stored in the CPU tier, found after SIGTERM and a restart)."""
    disk = tmp / "disk"
    proc = start(tmp, disk, 2 * n, src)
    sock = f"unix://{tmp}/k.sock"
    with KVTierClient(sock, "bench") as c:
        att = c.attach(8)
        assert att.tensor is not None
        for lo in range(0, n, 8):
            got = c.allocate(att, 8)
            assert got is not None
            for j, (_, slot) in enumerate(got):
                att.tensor[slot].copy_(page(lo + j))
            assert c.store(att, [key(lo + j) for j in range(8)], [s for _, s in got]) == 8
            c.free(att, [p for p, _ in got])
        stored = sum(t is Tier.CPU for t in c.lookup([key(i) for i in range(n)]))
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    proc = start(tmp, disk, 2 * n, src)
    try:
        with KVTierClient(sock, "bench") as c:
            good, _ = check(c, list(range(n)))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return stored, len(good)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=3.0)
    ap.add_argument("--max-s", type=float, default=6.0)
    ap.add_argument("--sample", type=float, default=0.25)
    ap.add_argument("--term-keys", type=int, default=512)
    ap.add_argument("--baseline-src", default="")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    runs = [("this tree", None)] + ([("baseline", args.baseline_src)] if args.baseline_src else [])
    print("| daemon | trial | run s | acked | on disk >= 100 ms before kill | recovered of those "
          "| found (all) | wrong bytes |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kvtier-crash-") as tmp:
        kill_trial(Path(tmp), None, 1.0, args.sample)  # warm-up (first-run costs), not reported
    durations = [rng.uniform(args.min_s, args.max_s) for _ in range(args.trials)]
    for trial, run_s in enumerate(durations, 1):
        for name, src in runs:  # interleaved, so both see the same machine load
            with tempfile.TemporaryDirectory(prefix="kvtier-crash-") as tmp:
                k = kill_trial(Path(tmp), src, run_s, args.sample)
            print(f"| {name} | kill {trial} | {run_s:.1f} | {k.acked} | {k.on_disk} "
                  f"| {k.recovered} ({k.recovered / max(1, k.on_disk):.1%}) | {k.found} "
                  f"| {k.wrong} |", flush=True)
    for name, src in runs:
        with tempfile.TemporaryDirectory(prefix="kvtier-crash-") as tmp:
            stored, found = term_trial(Path(tmp), src, args.term_keys)
        print(f"| {name} | SIGTERM | - | {stored} (in CPU tier) | - | - "
              f"| {found} ({found / max(1, stored):.1%}) | - |", flush=True)


if __name__ == "__main__":
    main()
