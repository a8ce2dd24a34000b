"""One daemon serving two GPUs end to end: each rank attaches or registers on its own GPU
through the real daemon, and a tensor-parallel prefix is answered across both. Skipped with
fewer than two GPUs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvtier_daemon_fixture import Daemon, free_port, serve_args

from client._backend import as_backend
from client.tp import TensorParallelPrefix
from kvtier.errors import InvalidArgument

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]
PAGE_ROWS = 8


def _args(tmp: Path, device: str) -> list[str]:
    args = serve_args(tmp, disk=tmp / "disk", metrics_port=free_port())
    args[args.index("--device") + 1] = device
    return args


def test_attach_picks_a_gpu_and_refuses_one_not_served(
    spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = spawn(args=_args(tmp_path, "cuda:0,cuda:1"))
    with d.client("ranks") as c:
        first = c.attach(4)
        assert first.tensor is not None and first.tensor.device == torch.device("cuda:0")
        second = c.attach(4, device="cuda:1")
        assert second.tensor is not None and second.tensor.device == torch.device("cuda:1")
        with pytest.raises(InvalidArgument, match="device"):
            c.attach(4, device="cuda:7")


def test_ranks_registered_on_two_gpus_share_one_prefix(
    spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = spawn(args=_args(tmp_path, "cuda"))
    with d.client("tp") as c:
        backend = as_backend(c)
        kv = [torch.zeros(PAGE_ROWS, 4096, dtype=torch.uint8, device=f"cuda:{r}")
              for r in range(2)]
        handles = [c.register([t]) for t in kv]
        for r, t in enumerate(kv):
            for s in range(PAGE_ROWS):
                t[s].fill_(r * 100 + s + 1)
            torch.cuda.synchronize(t.device)
        keys = [[f"b{i}-rank{r}".encode() for i in range(4)] for r in range(2)]
        with TensorParallelPrefix(backend, handles) as tp:
            assert tp.store(keys, [[0, 1, 2, 3], [0, 1, 2, 3]]) == 4
            for t in kv:
                t.zero_()
                torch.cuda.synchronize(t.device)
            assert tp.lookup(keys) == 4
            assert tp.load(keys, [[7, 6, 5, 4], [7, 6, 5, 4]]) == 4
        for r, t in enumerate(kv):
            for i, s in enumerate([7, 6, 5, 4]):
                assert bool((t[s] == r * 100 + i + 1).all()), (r, s)
