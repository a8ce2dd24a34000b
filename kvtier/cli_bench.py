"""``kvtier bench``: a bounded synthetic multi-engine workload against a daemon.

N engine threads each attach a pool smaller than their working set, then loop: allocate + write
pages, release them, re-acquire random ones (verifying every byte), free some, offload some, and
store/lookup/load prefix keys. Without ``--address`` a CPU-mode daemon is started in a temp dir and
stopped afterwards. Exit 0 when every byte read back matched, 1 on any mismatch or unexpected error,
2 on bad flags (or ``--plot`` without matplotlib).

An acquire counts as a *restore* when the page was offloaded by us since its last pin or came back
in a different slot than it was released from; otherwise as *resident*.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cli_status import (
    add_connection_flags,
    human_bytes,
    read_token,
    stats_dict,
    table,
)
from kvtier.errors import ConfigError

SAMPLE_PERIOD = 0.5
GIB = 1 << 30
UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1 << 20, "mb": 10**6,
         "mib": 1 << 20, "g": GIB, "gb": 10**9, "gib": GIB}


# --- flags -------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 65536, 64KiB, 1MiB)")
    return int(m.group(1)) * UNITS[m.group(2).lower()]


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_bench_parser(sub: Any) -> None:
    """Wire ``kvtier bench`` into the CLI's subparsers."""
    p = sub.add_parser("bench", help="run a synthetic multi-engine workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_flags(p, address_help="daemon to load (default: start an embedded CPU-mode "
                         "daemon in a temp dir and stop it afterwards)")
    p.add_argument("--engines", type=positive_int, default=4, help="client threads (4)")
    p.add_argument("--seconds", type=float, default=10.0, help="run time (10)")
    p.add_argument("--page-size", type=parse_size, default=64 * 1024, help="page size (64KiB)")
    p.add_argument("--pages-per-engine", type=positive_int, default=256,
                   help="working set per engine in pages (256); pools hold a quarter of it")
    p.add_argument("--device", default="cpu", help="embedded daemon's device (cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write latency distribution and tier occupancy plots (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", dest="json_path", default=None,
                   help="write the results as JSON")
    p.set_defaults(func=run_bench)


# --- page contents -----------------------------------------------------------------------------
def pattern(page_size: int, tag: int) -> Any:
    """Deterministic page bytes for ``tag``: a header with the tag, then a fill byte."""
    import torch

    row = torch.full((page_size,), tag % 251, dtype=torch.uint8)
    head = struct.pack("<Q", tag)[: min(8, page_size)]
    row[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return row


# --- per-engine results ------------------------------------------------------------------------
@dataclass
class EngineResult:
    rpc: dict[str, list[float]] = field(default_factory=dict)
    restore: list[float] = field(default_factory=list)
    resident: list[float] = field(default_factory=list)
    ops: int = 0
    verified: int = 0
    mismatches: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Page:
    slot: int
    tag: int
    offloaded: bool = False


class Worker:
    """One synthetic engine: its own client, tenant and pool."""

    def __init__(self, index: int, client: Any, pool_pages: int, pages: int, page_size: int,
                 seed: int) -> None:
        self.index, self.client, self.page_size, self.pages = index, client, page_size, pages
        self.pool_pages = pool_pages
        self.rng = random.Random(seed * 1000 + index)
        self.result = EngineResult()
        self.released: dict[int, Page] = {}
        self.keys: list[tuple[bytes, int]] = []
        self.next_tag = index << 40
        self.att: Any = None

    def call(self, method: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.result.rpc.setdefault(method, []).append(time.perf_counter() - start)

    def tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    def tensor(self) -> Any:
        return self.att.tensor

    def run(self, deadline: float) -> None:
        from kvtier.errors import KVTierError

        self.att = self.call("Attach", self.client.attach, self.pool_pages,
                             page_size=self.page_size)
        steps = [(self.step_allocate, 3), (self.step_acquire, 4), (self.step_free, 1),
                 (self.step_offload, 1), (self.step_prefix, 1)]
        funcs, weights = zip(*steps, strict=True)
        while time.monotonic() < deadline:
            try:
                self.rng.choices(funcs, weights)[0]()
            except KVTierError as exc:
                self.note_error(exc)
            self.result.ops += 1

    def note_error(self, exc: Exception) -> None:
        from kvtier.errors import NotFound, PageLost

        if isinstance(exc, (PageLost, NotFound)):
            self.result.lost += 1
        elif len(self.result.errors) < 20:
            self.result.errors.append(f"{type(exc).__name__}: {exc}")
        else:
            self.result.errors.append("...")

    def step_allocate(self) -> None:
        if len(self.released) >= self.pages:
            return self.step_free()
        got = self.call("Allocate", self.client.allocate, self.att, self.rng.randint(1, 4))
        if not got:
            return None
        t = self.tensor()
        for page_id, slot in got:
            tag = self.tag()
            t[slot].copy_(pattern(self.page_size, tag))
            self.released[page_id] = Page(slot, tag)
        self.call("Release", self.client.release, self.att, [p for p, _ in got])
        return None

    def pick(self, n: int) -> list[int]:
        ids = list(self.released)
        return self.rng.sample(ids, min(n, len(ids)))

    def step_acquire(self) -> None:
        ids = self.pick(self.rng.randint(1, 4))
        if not ids:
            return
        start = time.perf_counter()
        try:
            slots = self.call("Acquire", self.client.acquire, self.att, ids)
        except Exception:
            self.forget_lost(ids)
            raise
        took = time.perf_counter() - start
        if slots is None:
            return
        restored = any(self.released[p].offloaded or self.released[p].slot != s
                       for p, s in zip(ids, slots, strict=True))
        (self.result.restore if restored else self.result.resident).append(took)
        self.verify(ids, slots)
        self.call("Release", self.client.release, self.att, ids)

    def forget_lost(self, ids: list[int]) -> None:
        """After a failed acquire, free the pages (some may be lost) and stop tracking them."""
        from kvtier.errors import KVTierError

        for p in ids:
            self.released.pop(p, None)
        with suppress(KVTierError):
            self.call("Free", self.client.free, self.att, ids)

    def verify(self, ids: list[int], slots: list[int]) -> None:
        import torch

        t = self.tensor()
        for p, s in zip(ids, slots, strict=True):
            page = self.released[p]
            self.result.verified += 1
            if not torch.equal(t[s], pattern(self.page_size, page.tag)):
                self.result.mismatches += 1
            page.slot, page.offloaded = s, False

    def step_free(self) -> None:
        ids = self.pick(self.rng.randint(1, 8))
        if ids:
            for p in ids:
                del self.released[p]
            self.call("Free", self.client.free, self.att, ids)

    def step_offload(self) -> None:
        ids = self.pick(self.rng.randint(1, 4))
        if ids and self.call("Offload", self.client.offload, self.att, ids):
            for p in ids:
                self.released[p].offloaded = True

    def step_prefix(self) -> None:
        if self.keys and self.rng.random() < 0.6:
            return self.reuse_prefix()
        got = self.call("Allocate", self.client.allocate, self.att, 1)
        if not got:
            return None
        page_id, slot = got[0]
        tag = self.tag()
        self.tensor()[slot].copy_(pattern(self.page_size, tag))
        key = f"bench-{self.index}-{tag}".encode()
        if self.call("Store", self.client.store, self.att, [key], [slot]):
            self.keys.append((key, tag))
        self.call("Free", self.client.free, self.att, [page_id])
        return None

    def reuse_prefix(self) -> None:
        key, tag = self.rng.choice(self.keys)
        if not self.call("Lookup", self.client.lookup, [key]):
            self.keys.remove((key, tag))
            return
        got = self.call("Allocate", self.client.allocate, self.att, 1)
        if not got:
            return
        page_id, slot = got[0]
        try:
            if self.call("Load", self.client.load, self.att, [key], [slot]) == 1:
                self.result.verified += 1
                if not bool((self.tensor()[slot] == pattern(self.page_size, tag)).all()):
                    self.result.mismatches += 1
        finally:
            self.call("Free", self.client.free, self.att, [page_id])


# --- embedded daemon ---------------------------------------------------------------------------
def daemon_argv(tmp: Path, args: argparse.Namespace) -> list[str]:
    page = args.page_size
    pool_pages = pool_size(args.pages_per_engine)
    gpu = args.engines * pool_pages * 2 * page
    cpu = args.engines * max(8, args.pages_per_engine // 4) * page
    disk = args.engines * args.pages_per_engine * 4 * page
    return [
        sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"unix://{tmp}/kvtier.sock",
        "--metrics-addr", "", "--device", args.device, "--disk-path", str(tmp / "disk"),
        "--disk-gb", repr(disk / GIB), "--cpu-memory-gb", repr(cpu / GIB),
        "--gpu-memory-gb", repr(gpu / GIB), "--grace", "5", "--log-level", "warning",
    ]


def daemon_env(page_size: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVCACHED_OFFLOAD_") and k != "NOTIFY_SOCKET"}
    env.update(KVCACHED_OFFLOAD_PAGE_SIZE=str(page_size), KVCACHED_OFFLOAD_DISK_ADMISSION="always",
               KVCACHED_OFFLOAD_PINNED_CHUNK_MB="1", KVCACHED_OFFLOAD_BATCH_MB="1",
               KVCACHED_OFFLOAD_MAX_INFLIGHT_MB="8")
    return env


def wait_serving(proc: subprocess.Popen[bytes], address: str, log: Path,
                 timeout: float = 60.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded daemon exited {proc.returncode}:\n"
                               f"{log.read_text(errors='replace')}")
        with grpc.insecure_channel(address) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"embedded daemon not serving after {timeout:.0f}s")


@contextmanager
def embedded_daemon(args: argparse.Namespace) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "disk").mkdir()
        argv = daemon_argv(tmp, args)
        log = tmp / "daemon.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                    env=daemon_env(args.page_size))
        try:
            address = argv[argv.index("--listen") + 1]
            wait_serving(proc, address, log)
            yield address
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- sampling and progress ---------------------------------------------------------------------
def sample_stats(client: Any, stop: threading.Event, out: list[tuple[float, dict[str, Any]]],
                 t0: float) -> None:
    from kvtier.errors import KVTierError

    while True:
        with suppress(KVTierError):
            out.append((time.monotonic() - t0, stats_dict(client.stats())))
        if stop.wait(SAMPLE_PERIOD):
            return


def progress_bar(done: float, total: float, ops: int, width: int = 30) -> str:
    frac = min(1.0, done / total) if total > 0 else 1.0
    filled = int(frac * width)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done:5.1f}/{total:.0f}s ops={ops}"


def show_progress(threads: list[threading.Thread], workers: list[Worker], seconds: float,
                  t0: float) -> None:
    tty = sys.stderr
    while any(t.is_alive() for t in threads):
        ops = sum(w.result.ops for w in workers)
        tty.write(progress_bar(min(seconds, time.monotonic() - t0), seconds, ops))
        tty.flush()
        time.sleep(0.2)
    tty.write(progress_bar(seconds, seconds, sum(w.result.ops for w in workers)) + "\n")
    tty.flush()


# --- the run -----------------------------------------------------------------------------------
def pool_size(pages_per_engine: int) -> int:
    return max(4, pages_per_engine // 4)


@dataclass
class Run:
    workers: list[Worker]
    samples: list[tuple[float, dict[str, Any]]]
    before: dict[str, Any]
    after: dict[str, Any]
    wall: float


def engine_thread(worker: Worker, deadline: float) -> None:
    try:
        worker.run(deadline)
    except Exception as exc:  # reported as an error, never silently lost
        worker.result.errors.append(f"engine {worker.index} stopped: {type(exc).__name__}: {exc}")


def run_workload(address: str, token: str | None, args: argparse.Namespace) -> Run:
    from kvtier.client import KVTierClient

    monitor = KVTierClient(address, "bench-monitor", token, timeout=10.0)
    clients = [KVTierClient(address, f"bench-{i}", token, timeout=30.0)
               for i in range(args.engines)]
    workers = [Worker(i, c, pool_size(args.pages_per_engine), args.pages_per_engine,
                      args.page_size, args.seed) for i, c in enumerate(clients)]
    try:
        before = stats_dict(monitor.stats())
        samples: list[tuple[float, dict[str, Any]]] = []
        stop = threading.Event()
        t0 = time.monotonic()
        sampler = threading.Thread(target=sample_stats, args=(monitor, stop, samples, t0),
                                   daemon=True)
        sampler.start()
        threads = [threading.Thread(target=engine_thread, args=(w, t0 + args.seconds),
                                    daemon=True) for w in workers]
        for t in threads:
            t.start()
        show_progress(threads, workers, args.seconds, t0)
        wall = time.monotonic() - t0
        stop.set()
        sampler.join()
        after = stats_dict(monitor.stats())
        return Run(workers, samples, before, after, wall)
    finally:
        for c in [monitor, *clients]:
            c.close()


# --- the report --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def merged(workers: list[Worker]) -> EngineResult:
    total = EngineResult()
    for w in workers:
        r = w.result
        for method, lat in r.rpc.items():
            total.rpc.setdefault(method, []).extend(lat)
        total.restore += r.restore
        total.resident += r.resident
        total.ops += r.ops
        total.verified += r.verified
        total.mismatches += r.mismatches
        total.lost += r.lost
        total.errors += r.errors
    return total


def delta(after: dict[str, Any], before: dict[str, Any], section: str) -> dict[str, int]:
    return {k: v - before[section].get(k, 0) for k, v in after[section].items()}


def summarize(run: Run) -> dict[str, Any]:
    r = merged(run.workers)
    hits = delta(run.after, run.before, "hits")
    misses = run.after["misses"] - run.before["misses"]
    lookups = sum(hits.values()) + misses
    moved = {}
    for name, m in run.after["moved"].items():
        b = run.before["moved"].get(name, {"bytes": 0, "seconds": 0.0})
        nbytes, busy = m["bytes"] - b["bytes"], m["seconds"] - b["seconds"]
        moved[name] = {"bytes": nbytes, "busy_s": busy,
                       "gbps_busy": nbytes / busy / 1e9 if busy > 0 else 0.0,
                       "gbps_wall": nbytes / run.wall / 1e9 if run.wall > 0 else 0.0}
    ms = 1e3
    return {
        "wall_s": run.wall, "ops": r.ops, "verified_pages": r.verified,
        "mismatches": r.mismatches, "lost": r.lost, "errors": r.errors,
        "hit_rate": {t: (n / lookups if lookups else 0.0) for t, n in hits.items()},
        "hits": hits, "misses": misses, "lookups": lookups,
        "evictions": delta(run.after, run.before, "evictions"),
        "acquire_ms": {kind: {"count": len(v), "p50": percentile(v, 0.5) * ms,
                              "p99": percentile(v, 0.99) * ms}
                       for kind, v in (("restore", r.restore), ("resident", r.resident))},
        "rpc_ms": {m: {"count": len(v), "p50": percentile(v, 0.5) * ms,
                       "p99": percentile(v, 0.99) * ms} for m, v in sorted(r.rpc.items())},
        "moved": moved,
        "samples": [{"t": t, "tiers": s["tiers"]} for t, s in run.samples],
    }


def fmt_ms(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def render(s: dict[str, Any]) -> str:
    hit_rows = [[t, str(s["hits"][t]), f"{s['hit_rate'][t]:.1%}", str(s["evictions"].get(t, 0))]
                for t in sorted(s["hits"])]
    hit_rows.append(["miss", str(s["misses"]),
                     f"{s['misses'] / s['lookups']:.1%}" if s["lookups"] else "-", "-"])
    acq_rows = [[k, str(v["count"]), fmt_ms(v["p50"]), fmt_ms(v["p99"])]
                for k, v in s["acquire_ms"].items()]
    moved_rows = [[d, human_bytes(m["bytes"]), f"{m['busy_s']:.3f}", f"{m['gbps_busy']:.3f}",
                   f"{m['gbps_wall']:.3f}"] for d, m in sorted(s["moved"].items())]
    rpc_rows = [[m, str(v["count"]), fmt_ms(v["p50"]), fmt_ms(v["p99"])]
                for m, v in s["rpc_ms"].items()]
    return "\n".join([
        f"kvtier bench: {s['ops']} ops in {s['wall_s']:.1f}s, {s['verified_pages']} pages "
        f"verified, {s['mismatches']} byte mismatches, {s['lost']} lost, "
        f"{len(s['errors'])} errors",
        "", table(["tier", "hits", "hit rate", "evictions"], hit_rows),
        "", table(["acquire", "count", "p50 ms", "p99 ms"], acq_rows),
        "", table(["direction", "bytes", "busy s", "GB/s busy", "GB/s wall"], moved_rows),
        "", table(["rpc", "count", "p50 ms", "p99 ms"], rpc_rows),
    ])


def plot(run: Run, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = merged(run.workers)
    fig, (lat, occ) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, values in (("resident", r.resident), ("restore", r.restore)):
        if values:
            lat.hist([v * 1e3 for v in values], bins=50, alpha=0.6, label=label)
    lat.set(title="acquire latency", xlabel="ms", ylabel="count", yscale="log")
    lat.legend()
    for tier in [t["tier"] for t in (run.samples[0][1]["tiers"] if run.samples else [])]:
        xs = [t for t, _ in run.samples]
        ys = [next(x["ratio"] for x in s["tiers"] if x["tier"] == tier) * 100
              for _, s in run.samples]
        occ.plot(xs, ys, label=tier)
    occ.set(title="tier occupancy", xlabel="s", ylabel="% used", ylim=(0, 105))
    occ.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def check_plot_available(args: argparse.Namespace) -> None:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(f"--plot {args.plot}: matplotlib is not installed "
                              "(pip install matplotlib)") from None


def run_bench(args: argparse.Namespace) -> int:
    from kvtier.errors import DeadlineExceeded, Unavailable

    check_plot_available(args)
    if args.seconds <= 0:
        raise ConfigError(f"--seconds: must be > 0, got {args.seconds}")
    token = read_token(args.token_file)
    try:
        if args.address:
            run = run_workload(args.address, token, args)
        else:
            with embedded_daemon(args) as address:
                run = run_workload(address, token, args)
    except (Unavailable, DeadlineExceeded):
        print(f"kvtier bench: no kvtier daemon at {args.address}: is `kvtier serve` running?",
              file=sys.stderr)
        return 1
    return report(run, args)


def report(run: Run, args: argparse.Namespace) -> int:
    s = summarize(run)
    print(render(s))
    for err in s["errors"]:
        print(f"error: {err}", file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(s, indent=2, default=str))
    if args.plot:
        plot(run, args.plot)
    return 1 if s["mismatches"] or s["errors"] else 0
