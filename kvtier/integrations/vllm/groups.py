"""Layer groups of a registered load: where the daemon's per-group replies fall between layers.

``layer_groups(layers, num_segments, most=LOAD_GROUPS) -> (bounds, group_of)``: ``layers[i]`` is
the range of ``BlockRows`` segments of layer ``i`` (forward order). When they tile ``[0,
num_segments)`` in order, consecutive layers are cut into at most ``most`` groups of about as
many layers each: ``bounds`` fall on layer boundaries (``0, ..., num_segments``) and
``group_of[i]`` is layer ``i``'s group (an empty layer joins the group before it, or the first
one). Otherwise, one group holds every segment and every layer is ready when the whole load is
(what ``LoadLayers`` with ``[0, num_segments]`` is: a ``Load``).

How many groups (``load_groups``; the connector's option, ``"auto"`` by default): the daemon
is another process. On a GPU without MPS the two processes' work is time-sliced, so the daemon's
copies of later groups do not run beside the engine's forward: measured on a lent H100
(``benchmarks/connector_overlap.py``, 32 layers, 256 MiB a step), loads cost +8.5 ms a step as
one group and +10.0 in 4 (a 64 MiB group landed ~1.5 ms apart on an idle GPU, ~5.5 ms apart
while the forward ran). Under MPS (the engine and the daemon clients of one MPS server) the
copies run beside the forward: +9.1 as one group, +4.9 in 4 and +4.3 in 8 groups.
``auto_groups()`` is therefore ``MPS_LOAD_GROUPS`` where an MPS control daemon is running for
this process (its pid file in ``$CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``, names a
live process: CUDA then makes the user's processes MPS clients, the daemon too where it runs
with the same pipe directory), else ``LOAD_GROUPS``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

MAX_GROUPS = 4096  # the daemon's cap (LoadLayers: at most 4,097 segment_bounds)
LOAD_GROUPS = 1  # groups a registered load is cut into without MPS (module docstring)
MPS_LOAD_GROUPS = 8  # ... and under MPS
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # MPS's default when CUDA_MPS_PIPE_DIRECTORY is unset
MPS_PID_FILE = "nvidia-cuda-mps-control.pid"


def mps_running(env: Mapping[str, str] = os.environ) -> bool:
    """Whether an MPS control daemon is running for this process: the pid file it keeps in the
    pipe directory CUDA looks in names a live process (its sockets stay behind after it quits;
    a pid out of this process's sight counts as not running)."""
    pid_file = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY) / MPS_PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except PermissionError:
        return True  # it exists (another user's)
    except OSError:
        return False
    return True


def auto_groups(env: Mapping[str, str] = os.environ) -> int:
    """The layer groups of a registered load when the connector's ``load_groups`` is
    ``"auto"`` (module docstring)."""
    return MPS_LOAD_GROUPS if mps_running(env) else LOAD_GROUPS


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
