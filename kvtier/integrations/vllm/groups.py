"""Layer groups of a registered load: where the daemon's per-group replies fall between layers.

``layer_groups(layers, num_segments, most=LOAD_GROUPS) -> (bounds, group_of)``: ``layers[i]`` is
the range of ``BlockRows`` segments of layer ``i`` (forward order). When they tile ``[0,
num_segments)`` in order, consecutive layers are cut into at most ``most`` groups of about as
many layers each: ``bounds`` fall on layer boundaries (``0, ..., num_segments``) and
``group_of[i]`` is layer ``i``'s group (an empty layer joins the group before it, or the first
one). Otherwise, one group holds every segment and every layer is ready when the whole load is
(what ``LoadLayers`` with ``[0, num_segments]`` is: a ``Load``).

Why at most ``LOAD_GROUPS`` (4): each group is one engine batch and one reply, ~1 ms of fixed
cost on a lent H100 whatever its size; one group per layer (32) cost more than the whole load
(connector_overlap.py: +42.8 ms a step against +9.3 for one group), while a quarter of the
layers' forward outlasts the next quarter's copy.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_GROUPS = 4096  # the daemon's cap (LoadLayers: at most 4,097 segment_bounds)
LOAD_GROUPS = 4  # groups a registered load is cut into (see the module docstring)


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
