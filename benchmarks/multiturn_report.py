"""Multi-turn benchmark results: the measured turns and how they are summarised and shown.

``Turn`` is one measured turn; ``summarize`` gives the per-turn means per mode,
``against_recompute`` how often a mode's TTFT exceeded recompute's, ``same_tokens`` how often the
first token matched recompute's, ``markdown`` the report and ``plot`` the TTFT chart (if
matplotlib is installed). Used by ``benchmarks/multiturn.py``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Turn:
    """One measured turn: which conversation, how long its context was and how long TTFT took."""

    mode: str
    conv: int
    turn: int
    context: int
    reused: int
    ttft_s: float
    first_token: int
    restore_s: float = 0.0  # part of ttft_s spent bringing the prefix back
    choice: str = ""  # the planner's: load | split | recompute | none ("" without a planner)
    recompute_s: float | None = None  # --paired: recompute of the same prompt, just before


def summarize(rows: list[Turn], modes: list[str]) -> list[dict[str, Any]]:
    """Per turn index: mean context and mean TTFT per mode, and speedups over recompute."""
    out = []
    for t in sorted({r.turn for r in rows}):
        line: dict[str, Any] = {"turn": t + 1}
        for m in modes:
            sel = [r for r in rows if r.turn == t and r.mode == m]
            if sel:
                line["context"] = round(statistics.mean(r.context for r in sel))
                line[m] = statistics.mean(r.ttft_s for r in sel)
                line[f"{m} restore"] = statistics.mean(r.restore_s for r in sel)
            choices = Counter(r.choice for r in sel if r.choice)
            if choices:
                line[f"{m} plan"] = ", ".join(f"{k} {v}" for k, v in sorted(choices.items()))
        base = line.get("recompute")
        for m in modes:
            if base and m != "recompute" and line.get(m):
                line[f"{m} speedup"] = base / line[m]
            if base and line.get(f"{m} restore"):
                line[f"{m} restore speedup"] = base / line[f"{m} restore"]
        out.append(line)
    return out


def against_recompute(rows: list[Turn], mode: str) -> dict[str, Any] | None:
    """Whether ``mode``'s TTFT ever exceeded recompute's, per (conversation, turn) and per turn
    (mean over conversations); the worst ratio of each, and the most milliseconds a turn took
    beyond recompute's (negative: never above it)."""
    ref = {(r.conv, r.turn): r.ttft_s for r in rows if r.mode == "recompute"}
    sel = [r for r in rows if r.mode == mode and (r.conv, r.turn) in ref]
    paired = [r for r in rows if r.mode == mode and r.recompute_s is not None]
    if paired:  # each turn against the recompute of its prompt measured just before it
        ref = {(r.conv, r.turn): r.recompute_s for r in paired if r.recompute_s is not None}
        sel = paired
    if not sel:
        return None
    ratios = [r.ttft_s / ref[(r.conv, r.turn)] for r in sel]
    turns: dict[int, list[tuple[float, float]]] = {}
    for r in sel:
        turns.setdefault(r.turn, []).append((r.ttft_s, ref[(r.conv, r.turn)]))
    per_turn = [statistics.mean(a for a, _ in v) / statistics.mean(b for _, b in v)
                for v in turns.values()]
    excess = max(r.ttft_s - ref[(r.conv, r.turn)] for r in sel)
    by_choice: dict[str, list[float]] = {}  # per planner choice ("" without a planner)
    for r, x in zip(sel, ratios, strict=True):
        by_choice.setdefault(r.choice, []).append(x)
    return dict(paired=bool(paired), turns_slower=sum(x > 1 for x in ratios),
                turns=len(ratios), worst_ratio=max(ratios),
                worst_excess_ms=round(1000 * excess, 2),
                turn_means_slower=sum(x > 1 for x in per_turn),
                worst_turn_mean_ratio=max(per_turn),
                by_choice={c: dict(turns=len(v), median_ratio=round(statistics.median(v), 3),
                                   worst_ratio=round(max(v), 3))
                           for c, v in sorted(by_choice.items())})


def same_tokens(rows: list[Turn]) -> dict[str, str]:
    """Per mode: how many first tokens equal recompute's for the same conversation and turn."""
    ref = {(r.conv, r.turn): r.first_token for r in rows if r.mode == "recompute"}
    out: dict[str, str] = {}
    for m in dict.fromkeys(r.mode for r in rows if r.mode != "recompute"):
        sel = [r for r in rows if r.mode == m and (r.conv, r.turn) in ref]
        same = sum(r.first_token == ref[(r.conv, r.turn)] for r in sel)
        out[m] = f"{same}/{len(sel)}"
    return out


def markdown(summary: list[dict[str, Any]], modes: list[str], meta: dict[str, Any]) -> str:
    restoring = [m for m in modes if m.startswith("kvtier")]
    cols = ["turn", "context", *[f"{m} TTFT ms" for m in modes],
            *[f"{m} restore ms" for m in restoring],
            *[f"{m} x" for m in modes if m != "recompute"],
            *[f"{m} prefix x" for m in restoring],
            *[f"{m} plan" for m in restoring if any(f"{m} plan" in x for x in summary)]]
    lines = [f"# Multi-turn TTFT ({meta['device']}, {meta['params_m']:.0f}M params, "
             f"{meta['dtype']})", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    for s in summary:
        cells = [str(s["turn"]), str(s.get("context", ""))]
        cells += [f"{1000 * s[m]:.1f}" if m in s else "n/a" for m in modes]
        cells += [f"{1000 * s[f'{m} restore']:.1f}" for m in restoring]
        cells += [f"{s[f'{m} speedup']:.1f}" if f"{m} speedup" in s else "n/a"
                  for m in modes if m != "recompute"]
        cells += [f"{s[f'{m} restore speedup']:.1f}" if f"{m} restore speedup" in s else "n/a"
                  for m in restoring]
        cells += [s.get(f"{m} plan", "n/a") for m in restoring
                  if any(f"{m} plan" in x for x in summary)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "`x` = recompute TTFT / mode TTFT. `prefix x` = recompute TTFT / time to restore "
              "the prefix (the part kvtier owns; the rest of TTFT is the suffix prefill).",
              "", f"Restored blocks by tier: {meta.get('restored_from', {})}",
              f"First token equal to recompute's: {meta.get('same_tokens', {})}",
              f"Prefill model (cost-aware loads): {meta.get('prefill', 'off')}",
              f"Against recompute, per (conversation, turn) and per turn mean: "
              f"{meta.get('against_recompute', {})}",
              f"Races of a disk load against the recompute: {meta.get('races', {}) or 'none'}",
              f"Skipped modes: {meta.get('skipped', {}) or 'none'}", ""]
    return "\n".join(lines)


def plot(rows: list[Turn], modes: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in modes:
        pts = sorted((r.context, 1000 * r.ttft_s) for r in rows if r.mode == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=m)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
