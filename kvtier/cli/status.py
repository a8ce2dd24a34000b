"""``kvtier status``: one Stats call against a running daemon, printed as a table or JSON.

Without ``--tenant`` it shows the daemon-wide view (when the daemon checks tenant credentials,
that needs the admin token in ``--tenant-token-file``); with ``--tenant NAME`` that tenant's own
view (its token in ``--tenant-token-file``). Exit 0 on success, 1 when no daemon answers at the
address (the message names it) or it refuses the credentials, 2 on an unreadable token file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from kvtier.config_rules import listen_ok
from kvtier.errors import InvalidArgument
from kvtier.validate import check_name

DEFAULT_TIMEOUT = 5.0
STATUS_TENANT = "kvtier-status"


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def daemon_address(text: str) -> str:
    """``unix:///absolute/path`` or ``host:port``, as ``kvtier serve --listen`` takes them."""
    if not listen_ok(text):
        raise argparse.ArgumentTypeError(
            f"expected unix:///absolute/path or host:port, got {text!r}")
    return text


def tenant_name(text: str) -> str:
    """A tenant name as the daemon accepts it (``kvtier.validate.check_name``)."""
    try:
        return check_name("tenant", text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_address() -> str:
    """The daemon's default unix socket, resolved exactly as ``kvtier serve`` resolves it."""
    from kvtier.server.app import SOCKET_NAME, default_socket_dir

    return f"unix://{os.path.join(default_socket_dir(), SOCKET_NAME)}"


def read_token(path: str | None, flag: str = "--token-file") -> str | None:
    """The token file's first line (as the daemon reads it), or None without a file."""
    if not path:
        return None
    from kvtier.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline().strip() or None
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path!r}: {exc}") from exc


def add_connection_flags(p: argparse.ArgumentParser, *, address_help: str = "") -> None:
    p.add_argument("--address", metavar="ADDR", default=None, type=daemon_address,
                   help=address_help or "daemon address: unix:///path or host:port "
                   "(default: the daemon's default unix socket, as `kvtier serve` uses)")
    p.add_argument("--token-file", metavar="FILE", default=None,
                   help="file whose first line is the bearer token (TCP addresses)")


def add_status_flags(p: argparse.ArgumentParser) -> None:
    add_connection_flags(p)
    p.add_argument("--tenant", metavar="NAME", type=tenant_name, default=None,
                   help="show this tenant's own view (default: the daemon-wide view)")
    p.add_argument("--tenant-token-file", metavar="FILE", default=None,
                   help="file whose first line is the tenant's token (or the admin token "
                   "for the daemon-wide view) when the daemon checks tenant credentials")
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT,
                   help=argparse.SUPPRESS)


def not_running(address: str) -> str:
    return f"no kvtier daemon at {address}: is `kvtier serve` running?"


def unreachable(address: str, exc: Exception, timeout: float | None = None) -> str:
    """Why a daemon did not serve a call: not there, shutting down, or there but silent."""
    from kvtier.errors import DeadlineExceeded

    if isinstance(exc, DeadlineExceeded):
        within = "in time" if timeout is None else f"within {timeout:g} s"
        return (f"the kvtier daemon at {address} did not answer {within} "
                "(stopped, hung or overloaded?)")
    if "draining" in str(exc):
        return f"the kvtier daemon at {address} is shutting down; retry once it is back"
    return not_running(address)


def refused(exc: Exception, tenant_hint: str = "see --tenant-token-file") -> str:
    """A refusal, pointing at the flag its credential comes from: the TCP bearer token's, or
    (``tenant_hint``) the tenant's."""
    hint = "see --token-file" if "bearer token" in str(exc) else tenant_hint
    return f"the daemon refused the credentials: {exc} ({hint})"


def fetch_stats(address: str, token: str | None, timeout: float, *, tenant: str | None = None,
                tenant_token: str | None = None) -> Any:
    """One Stats reply (``tenant``'s view, else the daemon's); raises
    ``kvtier.client.errors.Unavailable`` when nobody answers."""
    from kvtier.client import KVTierClient

    with KVTierClient(address, tenant or STATUS_TENANT, token, timeout=timeout,
                      tenant_token=tenant_token) as client:
        return client.stats(whole=tenant is None)


def stats_dict(reply: Any) -> dict[str, Any]:
    """A StatsReply as plain JSON-able data (ints stay ints)."""
    from kvtier.types import Tier

    tiers = [
        {"tier": Tier(t.tier).name.lower(), "used_bytes": t.used_bytes,
         "capacity_bytes": t.capacity_bytes, "pages": t.pages,
         "ratio": t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0}
        for t in reply.tiers
    ]
    moved = {
        m.direction: {"bytes": m.bytes, "pages": m.pages, "batches": m.batches,
                      "seconds": m.seconds, "failures": m.failures}
        for m in reply.moved
    }
    return {
        "version": reply.version, "instance": reply.instance, "tiers": tiers,
        "pools": reply.pools, "tenants": reply.tenants,
        "queues": {"restores": reply.queued_restores, "offloads": reply.queued_offloads,
                   "inflight_bytes": reply.inflight_bytes},
        "pinned_pages": reply.pinned_pages, "keyed_pages": reply.keyed_pages,
        "moved": moved, "evictions": dict(reply.evictions), "drops": dict(reply.drops),
        "hits": dict(reply.hits), "misses": reply.misses,
        "checksum_failures": reply.checksum_failures,
        "remote": _remote_dict(reply.remote) if reply.HasField("remote") else None,
    }


def _remote_dict(r: Any) -> dict[str, Any]:
    return {"reachable": r.reachable, "written_pages": r.written_pages,
            "written_bytes": r.written_bytes, "read_pages": r.read_pages,
            "read_bytes": r.read_bytes, "queued_bytes": r.queued_bytes,
            "dropped": dict(r.dropped), "rejected": dict(r.rejected), "errors": dict(r.errors)}


def _remote_lines(r: dict[str, Any] | None) -> list[str]:
    if r is None:
        return ["remote: off"]
    return [
        f"remote: {'reachable' if r['reachable'] else 'UNREACHABLE'}; "
        f"written {human_bytes(r['written_bytes'])} ({r['written_pages']} pages), "
        f"read {human_bytes(r['read_bytes'])} ({r['read_pages']} pages), "
        f"queued {human_bytes(r['queued_bytes'])}",
        "  " + _counts("errors", r["errors"]) + "; " + _counts("dropped writes", r["dropped"])
        + "; " + _counts("refused values", r["rejected"]),
    ]


def human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, i = float(n), 0
    while abs(value) >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{int(value)} B" if i == 0 else f"{value:.1f} {units[i]}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _tier_rows(d: dict[str, Any]) -> list[list[str]]:
    return [[t["tier"], human_bytes(t["used_bytes"]), human_bytes(t["capacity_bytes"]),
             str(t["pages"]), f"{t['ratio']:.1%}", str(d["hits"].get(t["tier"], 0)),
             str(d["evictions"].get(t["tier"], 0))] for t in d["tiers"]]


def _moved_rows(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, m in sorted(d["moved"].items()):
        rate = m["bytes"] / m["seconds"] / 1e9 if m["seconds"] > 0 else 0.0
        rows.append([name, human_bytes(m["bytes"]), str(m["pages"]), str(m["batches"]),
                     f"{rate:.2f}", str(m["failures"])])
    return rows


def _counts(title: str, counts: dict[str, int]) -> str:
    body = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
    return f"{title}: {body}"


def render(d: dict[str, Any], address: str) -> str:
    q = d["queues"]
    parts = [
        f"kvtier {d['version']} at {address} (instance {d['instance']})",
        f"engines: {d['tenants']} tenants, {d['pools']} pools attached; "
        f"pinned pages {d['pinned_pages']}, keyed pages {d['keyed_pages']}",
        "",
        table(["tier", "used", "capacity", "pages", "ratio", "hits", "evictions"],
              _tier_rows(d)),
        "",
        f"queues: restores={q['restores']} offloads={q['offloads']} "
        f"inflight={human_bytes(q['inflight_bytes'])}",
        "",
        table(["direction", "bytes", "pages", "batches", "GB/s", "failures"], _moved_rows(d)),
        "",
        _counts("hits", d["hits"]) + f"; misses={d['misses']}",
        _counts("evictions", d["evictions"]),
        _counts("drops", d["drops"]),
        f"checksum failures: {d['checksum_failures']}",
        *_remote_lines(d.get("remote")),
    ]
    return "\n".join(parts)


def run_status(args: argparse.Namespace) -> int:
    from kvtier.client.errors import Unauthenticated  # PERMISSION_DENIED too
    from kvtier.errors import DeadlineExceeded, Unavailable

    address = args.address or default_address()
    token = read_token(args.token_file)
    tenant_token = read_token(args.tenant_token_file, "--tenant-token-file")
    try:
        reply = fetch_stats(address, token, args.timeout, tenant=args.tenant,
                            tenant_token=tenant_token)
    except (Unavailable, DeadlineExceeded) as exc:
        print(f"kvtier status: {unreachable(address, exc, args.timeout)}", file=sys.stderr)
        return 1
    except Unauthenticated as exc:
        print(f"kvtier status: {refused(exc)}", file=sys.stderr)
        return 1
    d = stats_dict(reply)
    if args.json:
        print(json.dumps({"address": address, **d}, indent=2, sort_keys=True))
    else:
        print(render(d, address))
    return 0


def add_status_parser(sub: Any) -> None:
    """Wire ``kvtier status`` into the CLI's subparsers."""
    p = sub.add_parser("status", help="show a running daemon's state",
                       description="Show a running daemon's tiers, queues and counters.")
    add_status_flags(p)
    p.set_defaults(func=run_status)
