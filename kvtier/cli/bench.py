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
import signal
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.cli.bench_daemon import Interrupted, embedded_daemon, pool_size, stop_signals
from kvtier.cli.bench_worker import EngineResult, Worker
from kvtier.cli.status import (
    add_connection_flags,
    human_bytes,
    positive_seconds,
    read_token,
    refused,
    stats_dict,
    table,
    tenant_name,
    unreachable,
)
from kvtier.config import parse_size as config_parse_size
from kvtier.errors import ConfigError

SAMPLE_PERIOD = 0.5
GIB = 1 << 30


# --- flags -------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Sizes as the daemon reads them (``kvtier.config.parse_size``: 64KiB, 2MiB, ...)."""
    try:
        value = config_parse_size(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 65536, 64KiB, 1MiB)")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_bench_parser(sub: Any) -> None:
    """Wire ``kvtier bench`` into the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="run a synthetic multi-engine workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_connection_flags(
        p,
        address_help="daemon to load (default: start an embedded CPU-mode "
        "daemon in a temp dir and stop it afterwards)",
    )
    p.add_argument("--tenant", metavar="NAME", type=tenant_name, default=None,
                   help="run every engine as this tenant and report its own view (default: "
                   "tenants bench-0..N and the daemon-wide view)")
    p.add_argument("--tenant-token-file", metavar="FILE", default=None,
                   help="file whose first line is --tenant's token, when the daemon checks "
                   "tenant credentials (KVCACHED_OFFLOAD_TENANTS_FILE)")
    p.add_argument("--engines", type=positive_int, default=4, help="client threads (4)")
    p.add_argument("--seconds", type=positive_seconds, default=10.0, help="run time (10)")
    p.add_argument("--page-size", type=parse_size, default=64 * 1024, help="page size (64KiB)")
    p.add_argument(
        "--pages-per-engine",
        type=positive_int,
        default=256,
        help="working set per engine in pages (256); pools hold a quarter of it",
    )
    p.add_argument("--device", default="cpu", help="embedded daemon's device (cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="write latency distribution and tier occupancy plots (needs matplotlib)",
    )
    p.add_argument(
        "--json", metavar="FILE", dest="json_path", default=None, help="write the results as JSON"
    )
    p.set_defaults(func=run_bench)


# --- page contents -----------------------------------------------------------------------------
def sample_stats(
    client: Any, stop: threading.Event, out: list[tuple[float, dict[str, Any]]], t0: float
) -> None:
    from kvtier.errors import KVTierError

    while True:
        with suppress(KVTierError):
            out.append((time.monotonic() - t0, stats_dict(client.stats(whole=True))))
        if stop.wait(SAMPLE_PERIOD):
            return


def progress_bar(done: float, total: float, ops: int, width: int = 30) -> str:
    frac = min(1.0, done / total) if total > 0 else 1.0
    filled = int(frac * width)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done:5.1f}/{total:.0f}s ops={ops}"


def show_progress(
    threads: list[threading.Thread], workers: list[Worker], seconds: float, t0: float
) -> None:
    tty = sys.stderr
    while any(t.is_alive() for t in threads):
        ops = sum(w.result.ops for w in workers)
        tty.write(progress_bar(min(seconds, time.monotonic() - t0), seconds, ops))
        tty.flush()
        time.sleep(0.2)
    tty.write(progress_bar(seconds, seconds, sum(w.result.ops for w in workers)) + "\n")
    tty.flush()


# --- the run -----------------------------------------------------------------------------------
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


def run_workload(address: str, token: str | None, args: argparse.Namespace,
                 tenant_token: str | None = None) -> Run:
    from kvtier.client import KVTierClient

    def client(name: str, timeout: float) -> KVTierClient:
        return KVTierClient(address, args.tenant or name, token, timeout=timeout,
                            tenant_token=tenant_token)

    whole = args.tenant is None  # one tenant's run: that tenant's own view
    monitor = client("bench-monitor", 10.0)
    clients = [client(f"bench-{i}", 30.0) for i in range(args.engines)]
    workers = [
        Worker(
            i, c, pool_size(args.pages_per_engine), args.pages_per_engine, args.page_size, args.seed
        )
        for i, c in enumerate(clients)
    ]
    stop = threading.Event()
    sampler: threading.Thread | None = None
    try:
        before = stats_dict(monitor.stats(whole=whole))
        samples: list[tuple[float, dict[str, Any]]] = []
        t0 = time.monotonic()
        sampler = threading.Thread(
            target=sample_stats, args=(monitor, stop, samples, t0), daemon=True
        )
        sampler.start()
        threads = [
            threading.Thread(target=engine_thread, args=(w, t0 + args.seconds), daemon=True)
            for w in workers
        ]
        for t in threads:
            t.start()
        show_progress(threads, workers, args.seconds, t0)
        wall = time.monotonic() - t0
        stop.set()
        sampler.join()
        after = stats_dict(monitor.stats(whole=whole))
        return Run(workers, samples, before, after, wall)
    finally:
        stop.set()  # the sampler ends before its client closes (also when interrupted)
        if sampler is not None and sampler.is_alive():
            sampler.join()
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
        moved[name] = {
            "bytes": nbytes,
            "busy_s": busy,
            "gbps_busy": nbytes / busy / 1e9 if busy > 0 else 0.0,
            "gbps_wall": nbytes / run.wall / 1e9 if run.wall > 0 else 0.0,
        }
    ms = 1e3
    return {
        "wall_s": run.wall,
        "ops": r.ops,
        "verified_pages": r.verified,
        "mismatches": r.mismatches,
        "lost": r.lost,
        "errors": r.errors,
        "hit_rate": {t: (n / lookups if lookups else 0.0) for t, n in hits.items()},
        "hits": hits,
        "misses": misses,
        "lookups": lookups,
        "evictions": delta(run.after, run.before, "evictions"),
        "acquire_ms": {
            kind: {"count": len(v), "p50": percentile(v, 0.5) * ms, "p99": percentile(v, 0.99) * ms}
            for kind, v in (("restore", r.restore), ("resident", r.resident))
        },
        "rpc_ms": {
            m: {"count": len(v), "p50": percentile(v, 0.5) * ms, "p99": percentile(v, 0.99) * ms}
            for m, v in sorted(r.rpc.items())
        },
        "moved": moved,
        "samples": [{"t": t, "tiers": s["tiers"]} for t, s in run.samples],
    }


def fmt_ms(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def render(s: dict[str, Any]) -> str:
    hit_rows = [
        [t, str(s["hits"][t]), f"{s['hit_rate'][t]:.1%}", str(s["evictions"].get(t, 0))]
        for t in sorted(s["hits"])
    ]
    hit_rows.append(
        [
            "miss",
            str(s["misses"]),
            f"{s['misses'] / s['lookups']:.1%}" if s["lookups"] else "-",
            "-",
        ]
    )
    acq_rows = [
        [k, str(v["count"]), fmt_ms(v["p50"]), fmt_ms(v["p99"])] for k, v in s["acquire_ms"].items()
    ]
    moved_rows = [
        [
            d,
            human_bytes(m["bytes"]),
            f"{m['busy_s']:.3f}",
            f"{m['gbps_busy']:.3f}",
            f"{m['gbps_wall']:.3f}",
        ]
        for d, m in sorted(s["moved"].items())
    ]
    rpc_rows = [
        [m, str(v["count"]), fmt_ms(v["p50"]), fmt_ms(v["p99"])] for m, v in s["rpc_ms"].items()
    ]
    return "\n".join(
        [
            f"kvtier bench: {s['ops']} ops in {s['wall_s']:.1f}s, {s['verified_pages']} pages "
            f"verified, {s['mismatches']} byte mismatches, {s['lost']} lost, "
            f"{len(s['errors'])} errors",
            "",
            table(["tier", "hits", "hit rate", "evictions"], hit_rows),
            "",
            table(["acquire", "count", "p50 ms", "p99 ms"], acq_rows),
            "",
            table(["direction", "bytes", "busy s", "GB/s busy", "GB/s wall"], moved_rows),
            "",
            table(["rpc", "count", "p50 ms", "p99 ms"], rpc_rows),
        ]
    )


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
        ys = [
            next(x["ratio"] for x in s["tiers"] if x["tier"] == tier) * 100 for _, s in run.samples
        ]
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
            raise ConfigError(
                f"--plot {args.plot}: matplotlib is not installed (pip install matplotlib)"
            ) from None


def run_bench(args: argparse.Namespace) -> int:
    from kvtier.errors import DeadlineExceeded, PermissionDenied, Unauthenticated, Unavailable

    check_plot_available(args)
    if args.seconds <= 0:
        raise ConfigError(f"--seconds: must be > 0, got {args.seconds}")
    if args.tenant_token_file and not args.tenant:
        raise ConfigError("--tenant-token-file: give the tenant it belongs to with --tenant")
    token = read_token(args.token_file)
    tenant_token = read_token(args.tenant_token_file, "--tenant-token-file")
    try:
        with stop_signals():
            if args.address:
                run = run_workload(args.address, token, args, tenant_token)
            else:
                with embedded_daemon(args) as address:
                    run = run_workload(address, token, args, tenant_token)
    except Interrupted as stop:
        name = signal.Signals(stop.signum).name
        print(f"\nkvtier bench: stopped by {name}"
              + ("" if args.address else "; the embedded daemon is stopped and its files removed"),
              file=sys.stderr)
        return 128 + stop.signum
    except (Unauthenticated, PermissionDenied) as exc:
        hint = "give --tenant and --tenant-token-file when it checks tenant credentials"
        print(f"kvtier bench: {refused(exc, hint)}", file=sys.stderr)
        return 1
    except (Unavailable, DeadlineExceeded) as exc:
        print(f"kvtier bench: {unreachable(args.address or 'the embedded daemon', exc)}",
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
