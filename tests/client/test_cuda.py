"""CUDA mode end to end: the client maps the daemon's pool through CUDA IPC and registers its own
CUDA memory. Skipped without a GPU."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvtier_daemon_fixture import PAGE, Daemon, free_port, serve_args

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _cuda_args(tmp: Path) -> list[str]:
    args = serve_args(tmp, disk=tmp / "disk", metrics_port=free_port())
    args[args.index("--device") + 1] = "cuda:0"
    return args


def test_attach_maps_the_pool_over_cuda_ipc(spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    d = spawn(args=_cuda_args(tmp_path))
    with d.client("gpu") as c:
        att = c.attach(8)
        assert att.tensor is not None and att.tensor.is_cuda
        written = {}
        for i in range(3):  # 24 pages through an 8-slot pool: offload to CPU and disk
            got = c.allocate(att, 8)
            assert got is not None
            for page, slot in got:
                att.tensor[slot].fill_((page * 3 + i) % 251)
                written[page] = (page * 3 + i) % 251
            torch.cuda.synchronize()
            c.release(att, [p for p, _ in got])
        for page, value in written.items():
            slots = c.acquire(att, [page])
            assert slots is not None
            assert bool((att.tensor[slots[0]] == value).all()), page
            c.release(att, [page])
        moved = {m.direction: m.pages for m in c.stats().moved}
        assert moved["gpu_to_cpu"] > 0 and moved["cpu_to_gpu"] > 0


def test_register_cuda_memory(spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    d = spawn(args=_cuda_args(tmp_path))
    kv = torch.zeros(2, 4, PAGE, dtype=torch.uint8, device="cuda:0")
    segs = [kv[0, :, : PAGE // 2], kv[1, :, : PAGE // 2]]
    with d.client("gpu-reg") as c:
        att = c.register(segs)
        for s in range(4):
            segs[0][s].fill_(s + 1)
            segs[1][s].fill_(s + 51)
        torch.cuda.synchronize()
        keys = [f"k{i}".encode() for i in range(4)]
        assert c.store(att, keys, [0, 1, 2, 3]) == 4
        kv.zero_()
        torch.cuda.synchronize()
        assert c.load(att, keys, [3, 2, 1, 0]) == 4
        for i, s in enumerate([3, 2, 1, 0]):
            assert bool((segs[0][s] == i + 1).all()) and bool((segs[1][s] == i + 51).all())
        c.detach(att)
    assert d.stop(signal.SIGTERM) == 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(pytest.main([__file__, "-q"]))
