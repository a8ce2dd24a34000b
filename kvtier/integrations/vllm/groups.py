"""Layer groups of a registered load: where the daemon's per-group replies fall between layers.

``layer_groups(layers, num_segments) -> (bounds, group_of)``: ``layers[i]`` is the range of
``BlockRows`` segments of layer ``i`` (forward order). When they tile ``[0, num_segments)`` in
order, each layer is a group of its own: ``bounds`` are the layer boundaries (``0, ...,
num_segments``) and ``group_of[i] == i`` (an empty layer joins the group before it, or the first
one). Otherwise, or with more than ``MAX_GROUPS`` layers, one group holds every segment and
every layer is ready when the whole load is (what ``LoadLayers`` with ``[0, num_segments]`` is:
a ``Load``).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_GROUPS = 4096  # the daemon's cap (LoadLayers: at most 4,097 segment_bounds)


def layer_groups(layers: Sequence[range], num_segments: int) -> tuple[list[int], list[int]]:
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
    return bounds, group_of
