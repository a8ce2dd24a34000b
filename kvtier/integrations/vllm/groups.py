"""Layer groups of a registered load: where the daemon's per-group replies fall between layers.

``layer_groups(layers, num_segments, most=LOAD_GROUPS) -> (bounds, group_of)``: ``layers[i]`` is
the range of ``BlockRows`` segments of layer ``i`` (forward order). When they tile ``[0,
num_segments)`` in order, consecutive layers are cut into at most ``most`` groups of about as
many layers each: ``bounds`` fall on layer boundaries (``0, ..., num_segments``) and
``group_of[i]`` is layer ``i``'s group (an empty layer joins the group before it, or the first
one). Otherwise, one group holds every segment and every layer is ready when the whole load is
(what ``LoadLayers`` with ``[0, num_segments]`` is: a ``Load``).

Why one group by default (``LOAD_GROUPS``; the connector's ``load_groups`` option): the daemon
is another process, and a GPU without MPS time-slices the two processes' work, so the daemon's
copies of later groups do not run beside the engine's forward. Measured on a lent H100
(``benchmarks/connector_overlap.py``, 32 layers, 256 MiB a step): a 64 MiB group landed ~1.5
ms apart while the GPU was otherwise idle but ~5.5 ms apart while the forward ran; loads cost
+8.5 ms a step as one group, +10.3 in 4 groups and +42.8 in 32 (each group also costs one
engine batch and one reply, ~1 ms). Where the daemon's copies can run beside the engine's
kernels (MPS), more groups let the first layers start early.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_GROUPS = 4096  # the daemon's cap (LoadLayers: at most 4,097 segment_bounds)
LOAD_GROUPS = 1  # groups a registered load is cut into by default (module docstring)


def layer_groups(layers: Sequence[range], num_segments: int,
                 most: int = LOAD_GROUPS) -> tuple[list[int], list[int]]:
    whole = [0, num_segments], [0] * len(layers)
    bounds, group_of = [0], []
    for r in layers:
        if r.step != 1 or r.start != bounds[-1] or r.stop < r.start:
            return whole
        if r.stop > bounds[-1]:
            bounds.append(r.stop)
        group_of.append(max(0, len(bounds) - 2))
    if bounds[-1] != num_segments or len(bounds) < 2 or len(bounds) - 1 > MAX_GROUPS:
        return whole
    return _merged(bounds, group_of, max(1, min(most, MAX_GROUPS)))


def _merged(bounds: list[int], group_of: list[int], most: int) -> tuple[list[int], list[int]]:
    """Per-layer groups joined into at most ``most`` runs of about as many groups each."""
    n = len(bounds) - 1
    if n <= most:
        return bounds, group_of
    joined = [g * most // n for g in range(n)]  # per-layer group -> its joined group
    cut = [0] + [bounds[g + 1] for g in range(n - 1) if joined[g] != joined[g + 1]]
    return [*cut, bounds[-1]], [joined[g] for g in group_of]
