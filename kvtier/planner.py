"""Cost-aware loads: how many leading blocks of a stored prefix to load rather than recompute.

Pure policy: no I/O, no engine state. The caller supplies what was measured.

Contract:
    * ``TierCost(bytes_per_s, latency_s)``: reading from a tier into the GPU costs ``latency_s``
      once per load that touches the tier plus ``bytes / bytes_per_s`` (``bytes_per_s > 0``).
    * ``PrefillModel(tokens_per_s, attention_s=0)``: computing the KV of positions ``[a, b)``
      over a cached ``[0, a)`` takes ``(b - a) / tokens_per_s + attention_s * (b*b - a*a) / 2``
      seconds (a linear part and the attention part that grows with the context).
      ``PrefillModel.fit(samples)`` fits both terms and a fixed overhead (none negative) to
      ``(tokens, seconds)`` samples of whole prefills.
    * ``plan(tiers, ...)`` returns a :class:`Plan`: ``load`` leading blocks (``0 <= load <=
      len(tiers)``) that minimise ``load_s + compute_s``, where loading ``k`` blocks costs the
      bytes of each tier among the first ``k`` at that tier's bandwidth plus each such tier's
      latency, and computing costs the prefill of positions ``[(first + k) * block_tokens,
      total_tokens)``. Blocks before ``first`` are already in place (cost nothing). A tier with
      no cost given is never loaded from. Ties go to loading more. So a plan is never slower,
      by the model, than recomputing everything (``load == 0`` is always a candidate).
      ``overhead_s``: a fixed cost of any load (``k >= 1``) beyond the tiers' own.
    * ``Plan.choice``: ``"load"`` (every block), ``"split"`` (a leading part), ``"recompute"``
      (none), ``"none"`` (no block was stored).
    * ``LoadPlanner(block_tokens, block_bytes, prefill, costs)``: ``plan`` with the block shape
      and the prefill model bound and the costs read from ``costs()`` at every call (live
      measurements), or at most every ``refresh_s`` seconds (a plan may be made under the
      engine lock, where reading the engine's statistics each time costs a millisecond);
      ``refresh()`` reads them now (a caller can do it off its critical path, after a
      request, and keep ``refresh_s`` long); ``planner(tiers, total_tokens, first)`` ->
      :class:`Plan`.
      ``observe(plan, seconds)``: a load's measured end-to-end time; what it took beyond the
      tiers' modelled cost is learnt as ``overhead_s`` (the engine's per-load work: lookups,
      hand-offs between threads), so small loads stop looking cheaper than they are; for a
      load with blocks from below the CPU tier, as ``below_s`` per such block instead (what
      the tiers' rates miss there: a read queued behind writes, a page written down to make
      room in a full CPU tier; it rises to a slower observation at once, so the next plan
      doesn't risk the same slow read), which ``plan(.., below_s=)`` adds to each such block.
    * ``default_costs(cuda)``: the costs used before anything was measured.
      ``measured_costs(rates, cuda, latencies)``: those costs with each measured rate (and
      latency) put in (``rates``: bytes/s per direction, 0 = not measured yet); a disk block
      crosses two legs (disk -> CPU, CPU -> GPU), costed as both in turn, and a load from disk
      pays once the latency of a write down (CPU -> disk): a full CPU tier makes its room
      first (on an H100 host, ~12 ms a round with the write's sync, against ~1 ms for the read).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.types import Direction, Tier


def _check(name: str, value: float, *, positive: bool) -> None:
    """A finite number, > 0 (``positive``) or >= 0; else InvalidArgument naming the field."""
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        bound = ">" if positive else ">="
        raise InvalidArgument(name, f"must be finite and {bound} 0, got {value}")


@dataclass(frozen=True, slots=True)
class TierCost:
    """What reading from one tier into the GPU costs (see the module docstring)."""

    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        _check("bytes_per_s", self.bytes_per_s, positive=True)
        _check("latency_s", self.latency_s, positive=False)


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Seconds to prefill positions ``[a, b)`` after a cached ``[0, a)``."""

    tokens_per_s: float
    attention_s: float = 0.0  # seconds per (query, key) pair, the part that grows with context

    def __post_init__(self) -> None:
        _check("tokens_per_s", self.tokens_per_s, positive=True)
        _check("attention_s", self.attention_s, positive=False)

    def seconds(self, start: int, end: int) -> float:
        if end <= start:
            return 0.0
        pairs = (end * end - start * start) / 2
        return (end - start) / self.tokens_per_s + self.attention_s * pairs

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]]) -> PrefillModel:
        """Least squares of ``seconds = overhead + n / rate + attention * n^2 / 2`` over whole
        prefills of ``n`` tokens, every term kept >= 0 (terms are dropped, attention first, until
        none is negative). The fixed overhead is paid by every plan alike (a prefill always
        runs), so the model keeps only the rate and the attention term. Needs at least one
        sample with ``n > 0, seconds > 0``."""
        pts = np.array([(n, s) for n, s in samples if n > 0 and s > 0], dtype=np.float64)
        if not len(pts):
            raise InvalidArgument("samples", "need at least one prefill of > 0 tokens and seconds")
        n, secs = pts[:, 0], pts[:, 1]
        terms = {"overhead": np.ones_like(n), "linear": n, "attention": n * n / 2}
        for drop in ((), ("attention",), ("overhead",), ("overhead", "attention")):
            names = [k for k in terms if k not in drop]
            cols = np.stack([terms[k] for k in names], 1)
            coef, _, rank, _ = np.linalg.lstsq(cols, secs, rcond=None)
            got = dict(zip(names, coef.tolist(), strict=True))
            if rank == len(names) and got["linear"] > 0 and all(v >= 0 for v in got.values()):
                return cls(1 / got["linear"], got.get("attention", 0.0))
        # Not reached: the linear-only fit of positive samples is positive.
        return cls(float(n.sum() / secs.sum()))


OVERHEAD_WEIGHT = 0.5  # of the newest observed load in ``LoadPlanner.overhead_s``
LATE = 1.5  # a block not in the CPU tier by this many times its modelled time is late


@dataclass(frozen=True, slots=True)
class Plan:
    """One decision and the modelled seconds behind it."""

    load: int  # leading blocks to load (after the ``first`` already in place)
    blocks: int  # blocks that could have been loaded
    load_s: float  # modelled seconds of that load
    compute_s: float  # modelled seconds of the prefill that follows
    recompute_s: float  # modelled seconds of recomputing every block instead
    overhead_s: float = 0.0  # the fixed cost of a load counted in ``load_s`` (when load > 0)
    below: int = 0  # of the blocks loaded, those read from below the CPU tier (disk, remote)
    below_s: float = 0.0  # the learnt extra seconds per such block counted in ``load_s``
    ready: tuple[float, ...] = ()  # modelled seconds after the load began that block j+1 is in
    worth: tuple[float, ...] = ()  # seconds saved by lending j leading blocks (j = 0..load)

    def patience(self, landed: int) -> float:
        """How long after the load began it still pays to wait for more of its blocks, with the
        first ``landed`` of them already in the CPU tier: as long as stopping then and
        recomputing the rest costs no more than recomputing them all (``worth``), or the next
        block is not yet late (``LATE`` times its modelled time, ``ready``). A disk read slower
        than anything seen costs at most that one block's lateness beyond the recompute."""
        if landed >= self.load:
            return math.inf
        worth = self.worth[landed] if landed < len(self.worth) else 0.0
        due = LATE * self.ready[landed] if landed < len(self.ready) else 0.0
        return max(worth, due)

    @property
    def choice(self) -> str:
        if self.load == 0:
            return "recompute" if self.blocks else "none"
        return "load" if self.load == self.blocks else "split"


def plan(
    tiers: Sequence[Tier],
    *,
    block_tokens: int,
    block_bytes: int,
    total_tokens: int,
    costs: Mapping[Tier, TierCost],
    prefill: PrefillModel,
    first: int = 0,
    overhead_s: float = 0.0,
    below_s: float = 0.0,
) -> Plan:
    """The cheapest number of leading blocks of ``tiers`` to load (module docstring)."""
    _check("overhead_s", overhead_s, positive=False)
    _check("below_s", below_s, positive=False)
    if block_tokens <= 0 or block_bytes <= 0:
        raise InvalidArgument("block_tokens", "block_tokens and block_bytes must be > 0")
    if first < 0:
        raise InvalidArgument("first", f"must be >= 0, got {first}")
    end = (first + len(tiers)) * block_tokens
    if total_tokens < end:
        raise InvalidArgument("total_tokens", f"{total_tokens} < the {end} tokens of the blocks")
    start = first * block_tokens
    recompute = prefill.seconds(start, total_tokens)
    # One pass over the blocks in plain Python: a prefix is tens to hundreds of blocks, where
    # numpy's per-call costs (~50 us a plan) outweigh the arithmetic. Loads stop at the first
    # block of a tier with no cost; a tier's latency is paid once, at its first block.
    per_block = {int(t): block_bytes / c.bytes_per_s for t, c in costs.items()}
    latency = {int(t): c.latency_s for t, c in costs.items()}
    cpu, tps, att = int(Tier.CPU), prefill.tokens_per_s, prefill.attention_s
    sq, summed, n_below, end = total_tokens * total_tokens, 0.0, 0, start
    best = (recompute, 0, 0.0, 0)  # (total seconds, blocks, load seconds, blocks below CPU)
    ready: list[float] = []
    for code in map(int, tiers):
        step = per_block.get(code)
        if step is None:
            break
        if code > cpu:
            step += below_s
            n_below += 1
        if code in latency:
            step += latency.pop(code)
        summed += step
        end += block_tokens
        load_s = overhead_s + summed
        ready.append(load_s)
        total = load_s  # + the prefill of what follows (``PrefillModel.seconds``, inlined)
        if end < total_tokens:
            total += (total_tokens - end) / tps + att * ((sq - end * end) / 2)
        if total <= best[0]:  # ties go to loading more
            best = (total, end // block_tokens - first, load_s, n_below)
    total, k, loaded, below = best
    cpu_cost = costs.get(Tier.CPU)
    worth = _worth(prefill, start, block_tokens, k,
                   (block_bytes / cpu_cost.bytes_per_s, cpu_cost.latency_s) if cpu_cost else None)
    return Plan(k, len(tiers), loaded, total - loaded, recompute, overhead_s if k else 0.0,
                below, below_s, tuple(ready[:k]), worth)


def _worth(prefill: PrefillModel, start: int, block_tokens: int, k: int,
           cpu: tuple[float, float] | None) -> tuple[float, ...]:
    """Seconds saved by lending ``j`` leading blocks from the CPU tier (``j = 0..k``) against
    recomputing them: their prefill less their copy (``cpu``: seconds a block, latency);
    nothing where the CPU tier has no cost (never loaded from)."""
    if cpu is None:
        return (0.0,) * (k + 1)
    step, latency = cpu
    return tuple(prefill.seconds(start, start + j * block_tokens) - (j * step + latency) * (j > 0)
                 for j in range(k + 1))


@dataclass(slots=True)
class LoadPlanner:
    """``plan`` with the block shape and prefill model bound; costs read at every call; the
    fixed overhead of a load learnt from ``observe`` (see the module docstring)."""

    block_tokens: int
    block_bytes: int
    prefill: PrefillModel
    costs: Callable[[], Mapping[Tier, TierCost]]
    overhead_s: float = 0.0
    below_s: float = 0.0  # learnt extra seconds per block read from below the CPU tier
    refresh_s: float = 0.0  # read ``costs()`` at most this often (0: at every call)
    _read: tuple[float, Mapping[Tier, TierCost]] | None = field(default=None, init=False,
                                                                repr=False)

    def __post_init__(self) -> None:
        _check("refresh_s", self.refresh_s, positive=False)

    def current_costs(self) -> Mapping[Tier, TierCost]:
        if self._read is None or time.monotonic() - self._read[0] >= self.refresh_s:
            self.refresh()
        assert self._read is not None
        return self._read[1]

    def refresh(self) -> None:
        """Read ``costs()`` now (see the module docstring)."""
        self._read = (time.monotonic(), self.costs())

    def observe(self, chosen: Plan, seconds: float) -> None:
        """A load of ``chosen`` took ``seconds`` end to end: what it took beyond the modelled
        ``load_s`` (a moving average, newest weighted ``OVERHEAD_WEIGHT``) joins the fixed
        overhead, or, when blocks came from below the CPU tier, the extra per such block
        (``below_s``: reads queued behind writes, room made in a full CPU tier; a higher
        observation replaces it at once, a lower one moves it half way)."""
        if chosen.load > 0 and math.isfinite(seconds) and seconds >= 0:
            learnt = chosen.overhead_s + chosen.below * chosen.below_s
            extra = max(0.0, seconds - (chosen.load_s - learnt))
            if chosen.below:  # up at once, down by halves: a slow disk read is not risked twice
                per = max(0.0, extra - self.overhead_s) / chosen.below
                self.below_s = max(per, self.below_s + OVERHEAD_WEIGHT * (per - self.below_s))
            else:
                self.overhead_s += OVERHEAD_WEIGHT * (extra - self.overhead_s)

    def __call__(self, tiers: Sequence[Tier], total_tokens: int, first: int = 0) -> Plan:
        return plan(
            tiers,
            block_tokens=self.block_tokens,
            block_bytes=self.block_bytes,
            total_tokens=total_tokens,
            costs=self.current_costs(),
            prefill=self.prefill,
            first=first,
            overhead_s=self.overhead_s,
            below_s=self.below_s,
        )


def default_costs(cuda: bool) -> dict[Tier, TierCost]:
    """Costs before any transfer was measured: a pinned PCIe copy well under its peak, a disk
    well under an NVMe's, and a network store below both (CPU mode: memory copies)."""
    host = TierCost(20e9 if cuda else 5e9, 0.2e-3)
    return {
        Tier.GPU: TierCost(1e12, 0.0),
        Tier.CPU: host,
        Tier.DISK: TierCost(1e9, 1e-3),
        Tier.REMOTE: TierCost(0.5e9, 2e-3),
    }


def measured_costs(
    rates: Mapping[Direction, float],
    cuda: bool,
    latencies: Mapping[Direction, float] | None = None,
) -> dict[Tier, TierCost]:
    """``default_costs`` with the measured rates (and fixed latencies) put in (see the module
    docstring); a rate of 0 is not measured yet."""
    costs = default_costs(cuda)
    lat = latencies or {}

    def leg(d: Direction, default: TierCost) -> TierCost:
        rate = rates.get(d, 0.0)
        return TierCost(rate, lat.get(d, 0.0)) if rate > 0 else default

    up = costs[Tier.CPU] = leg(Direction.CPU_TO_GPU, costs[Tier.CPU])
    disk = leg(Direction.DISK_TO_CPU, costs[Tier.DISK])
    room = leg(Direction.CPU_TO_DISK, costs[Tier.DISK])  # a write down, for room in the CPU tier
    both = 1 / (1 / disk.bytes_per_s + 1 / up.bytes_per_s)
    costs[Tier.DISK] = TierCost(both, disk.latency_s + up.latency_s + room.latency_s)
    return costs
