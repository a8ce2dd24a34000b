"""Zero-copy kernels over pinned host memory vs the handlers' staging + DMA (a design probe).

A pinned, mapped host chunk (``cudaHostRegister``, as the CPU tier's chunks are) is wrapped as
a CUDA tensor through ``__cuda_array_interface__``, so one ``index_select`` / ``index_copy_``
kernel reads or writes host memory over PCIe: no staging buffer, no copy call per run. Compared
with what the CUDA handlers do (gather into device staging, one DMA; or DMA then scatter), for
1 GiB of every-other-slot pages in 64 MiB batches: GB/s and CPU time per batch launch. The
round trip through the host is checked byte for byte.

    python benchmarks/zero_copy.py --out results/   # needs CUDA
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from collections.abc import Callable
from pathlib import Path

import torch

GIB = 1 << 30


class _Interface:
    """Just enough ``__cuda_array_interface__`` for ``torch.as_tensor`` to wrap a pointer."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def pinned_chunk(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    mm = mmap.mmap(-1, nbytes)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 3)  # portable | mapped
    assert int(rc) == 0, f"cudaHostRegister failed: {rc}"
    return mm, host


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, thread CPU seconds spent launching)."""
    torch.cuda.synchronize()
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    cpu = time.thread_time() - cpu
    torch.cuda.synchronize()
    return time.perf_counter() - wall, cpu


def raw_copies(dev: torch.device) -> dict[str, float]:
    """One contiguous pinned copy each way: the hardware figure of the same run."""
    gpu = torch.empty(GIB, dtype=torch.uint8, device=dev)
    pinned = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    out = {}
    for _ in range(2):  # warm-up, then measure
        out["raw_d2h"] = GIB / timed(lambda: pinned.copy_(gpu, non_blocking=True))[0] / 1e9
        out["raw_h2d"] = GIB / timed(lambda: gpu.copy_(pinned, non_blocking=True))[0] / 1e9
    return out


def page_case(page: int, host: torch.Tensor, mapped: torch.Tensor, dev: torch.device) -> dict:
    n, batch = GIB // page, max(1, (64 << 20) // page)
    pool = torch.randint(0, 255, (2 * n, page), dtype=torch.uint8, device=dev)
    wide, width = pool.view(torch.int64), page // 8
    hw = mapped[:GIB].view(torch.int64).view(n, width)  # the host, as the kernels see it
    hd = host[:GIB].view(n, page)  # the host, as the DMA sees it
    staging = torch.empty(batch, width, dtype=torch.int64, device=dev)
    index = torch.arange(0, 2 * n, 2).pin_memory()
    spans = [(lo, min(n, lo + batch)) for lo in range(0, n, batch)]

    def idx(lo: int, hi: int) -> torch.Tensor:
        return index[lo:hi].to(dev, non_blocking=True)

    def off_kernel() -> None:
        for lo, hi in spans:
            torch.index_select(wide, 0, idx(lo, hi), out=hw[lo:hi])

    def res_kernel() -> None:
        for lo, hi in spans:
            wide.index_copy_(0, idx(lo, hi), hw[lo:hi])

    def off_dma() -> None:
        for lo, hi in spans:
            torch.index_select(wide, 0, idx(lo, hi), out=staging[: hi - lo])
            hd[lo:hi].copy_(staging[: hi - lo].view(torch.uint8), non_blocking=True)

    def res_dma() -> None:
        for lo, hi in spans:
            staging[: hi - lo].view(torch.uint8).copy_(hd[lo:hi], non_blocking=True)
            wide.index_copy_(0, idx(lo, hi), staging[: hi - lo])

    out: dict[str, float] = {}
    cases = {"offload_kernel": off_kernel, "restore_kernel": res_kernel,
             "offload_dma": off_dma, "restore_dma": res_dma}
    for name, fn in cases.items():
        wall, cpu = min(timed(fn) for _ in range(3))
        out[name] = round(GIB / wall / 1e9, 2)
        out[name + "_cpu_us_per_batch"] = round(cpu / len(spans) * 1e6, 1)
    ids = torch.arange(0, 2 * n, 2, device=dev)
    want = pool[0::2].clone()
    torch.index_select(wide, 0, ids, out=hw)
    pool[0::2] = 0
    wide.index_copy_(0, ids, hw)
    torch.cuda.synchronize()
    assert torch.equal(pool[0::2], want), "bytes differ after the round trip through the host"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    _mm, host = pinned_chunk(GIB)
    mapped = torch.as_tensor(_Interface(host.data_ptr(), host.numel()), device=dev)
    result: dict = {"device": torch.cuda.get_device_name(dev), **raw_copies(dev)}
    for label, page in (("16K", 16 << 10), ("64K", 64 << 10), ("256K", 256 << 10)):
        result[label] = page_case(page, host, mapped, dev)
        print(label, json.dumps(result[label]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero_copy.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
