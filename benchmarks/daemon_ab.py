"""A/B of ``benchmarks/daemon.py`` between two source trees, runs interleaved.

    python benchmarks/daemon_ab.py --base /tmp/kvtier-base --runs 5 -- --device cuda --gib 1 --seconds 3

Each run is the tree's own ``benchmarks/daemon.py``, started in that tree's root by that tree's
interpreter (``--base-python``/``--head-python``, else ``<tree>/.venv/bin/python`` where there
is one, else this one), so the client and the ``python -m kvtier.cli serve`` daemon it starts are that tree's
code; the interpreter is checked to import ``kvtier`` and ``kvtier.client`` from inside the tree.
Runs alternate base, head, base, head, ... so both see the same drift of the machine. Prints, and
writes to ``--out`` as ``daemon_ab.{md,json}``, every figure's median over the runs and each
run's value; a figure one tree's benchmark does not measure shows as ``-``.

A tree for an older commit: ``git worktree add /tmp/kvtier-base <commit>``, then in it
``python3 -m venv --system-site-packages .venv && .venv/bin/pip install -q --no-deps -e .``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Figures shown first, in this order (the rest of daemon.json follows, sorted).
SHOWN = ("rtt_1.p50_us", "rtt_1.p99_us", "rtt_8.p50_us", "rtt_8.p99_us", "rtt_1_grpc.p50_us",
         "rtt_1_grpc.p99_us", "rtt_4096_lane.p50_us", "rtt_4096_grpc.p50_us", "pages_per_s")


def interpreter(tree: Path, given: str | None) -> str:
    """The tree's Python, checked to import kvtier (and kvtier.client) from inside the tree."""
    venv = tree / ".venv" / "bin" / "python"
    python = given or (str(venv) if venv.exists() else sys.executable)
    probe = "import kvtier, kvtier.client; print(kvtier.__file__); print(kvtier.client.__file__)"
    try:
        got = subprocess.run([python, "-c", probe], cwd=tree, capture_output=True, text=True,
                             timeout=300, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"{tree}: cannot run {python} ({exc}); give --base-python/--head-python") from None
    root = str(tree.resolve())
    if len(got) != 2 or not all(Path(f).resolve().is_relative_to(root) for f in got):
        raise SystemExit(f"{python} imports kvtier from {got}, not from {root}: install the tree "
                         "into it (pip install --no-deps -e .) or give --base-python/--head-python") from None
    return python


def flatten(res: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of daemon.json, as ``a.b`` names."""
    out: dict[str, float] = {}
    for key, value in res.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def one_run(tree: Path, python: str, extra: list[str], out: Path) -> dict[str, float]:
    argv = [python, "benchmarks/daemon.py", "--out", str(out), *extra]
    done = subprocess.run(argv, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: daemon.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return flatten(json.loads((out / "daemon.json").read_text()))


def table(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    names = sorted({k for rs in runs.values() for r in rs for k in r},
                   key=lambda k: (SHOWN.index(k) if k in SHOWN else len(SHOWN), k))
    md = ["| figure | " + " | ".join(f"{t} median (runs)" for t in runs) + " |",
          "|---|" + "---|" * len(runs)]
    for name in names:
        cells = []
        for rs in runs.values():
            vals = [r[name] for r in rs if name in r]
            cells.append(f"{statistics.median(vals):.4g} ({', '.join(f'{v:.4g}' for v in vals)})"
                         if vals else "-")
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the tree to compare against")
    ap.add_argument("--head", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--base-python")
    ap.add_argument("--head-python")
    ap.add_argument("--runs", type=int, default=5, help="runs of each tree (interleaved)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then daemon.py's own arguments")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs: must be at least 1")
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    trees = {"base": (args.base, interpreter(args.base, args.base_python)),
             "head": (args.head, interpreter(args.head, args.head_python))}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, (tree, python) in trees.items():
                runs[name].append(one_run(tree, python, extra, Path(tmp) / f"{name}-{i}"))
                print(f"{name} run {i + 1}/{args.runs}: rtt_1 p50 "
                      f"{runs[name][-1].get('rtt_1.p50_us', float('nan')):.0f} us", flush=True)
    head = [f"daemon.py {' '.join(extra)}; {args.runs} runs each, interleaved base/head; "
            f"base {args.base}, head {args.head}", ""]
    md = head + table(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon_ab.json").write_text(json.dumps(runs, indent=2))
    (args.out / "daemon_ab.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
