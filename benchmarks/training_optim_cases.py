"""The optimizer benchmark's shapes and variants (see ``training_optim.py``).

Shapes: ``mlp`` (10 blocks of LayerNorm + 4096->14336->4096 MLP, fp32, batch 4 x 1024: a few large
matrices), ``small`` (96 blocks of LayerNorm + 1024->2048->1024 MLP, fp32, batch 8 x 1024: many
small parameters), ``mixed`` (the mlp shape with bf16 working weights and fp32 master weights),
``disk`` (2 mlp blocks, fp32: small enough that the states' disk tier can be timed per step).

Variants: ``plain`` (fused GPU AdamW; fp32 master weights on the GPU for ``mixed``), ``torchao``
and ``torchao_og`` (torchao's ``CPUOffloadOptimizer``, ``offload_gradients=False``/``True``; for
``mixed`` it steps its bf16 CPU copies: torchao keeps no fp32 master), ``kvtier_cpu`` (the
default: bucket steps during backward), ``kvtier_cpu_bf16`` (``master_weights=False``: host
copies and states in the working dtype, torchao's arithmetic for ``mixed``),
``kvtier_cpu_deferred`` (``step_in_backward=False``),
``kvtier_gpu_stream``, ``kvtier_disk`` (cpu step, states on disk) and ``raw_disk`` (the disk's
own O_DIRECT bandwidth, no model).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LR = 1e-4


@dataclass(frozen=True)
class Shape:
    blocks: int
    hidden: int
    ffn: int
    batch: int
    seq: int
    dtype: torch.dtype


SHAPES: dict[str, Shape] = {
    "mlp": Shape(10, 4096, 14336, 4, 1024, torch.float32),
    "small": Shape(96, 1024, 2048, 8, 1024, torch.float32),
    "mixed": Shape(10, 4096, 14336, 4, 1024, torch.bfloat16),
    "disk": Shape(2, 4096, 14336, 4, 1024, torch.float32),
}
VARIANTS = ("plain", "torchao", "torchao_og", "kvtier_cpu", "kvtier_cpu_bf16", "kvtier_cpu_deferred",
            "kvtier_gpu_stream", "kvtier_disk")


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def build(shape: Shape, device: str) -> tuple[nn.Module, torch.Tensor]:
    """The model (initialised on ``device`` in the shape's dtype) and its input, seeded."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(shape.dtype)
    try:
        with torch.device(device):
            model = nn.Sequential(*(Block(shape.hidden, shape.ffn) for _ in range(shape.blocks)))
            x = torch.randn(shape.batch, shape.seq, shape.hidden)
    finally:
        torch.set_default_dtype(old)
    return model, x


class GpuAdamW:
    """Fused GPU AdamW; fp32 master weights on the GPU when the model is not fp32."""

    def __init__(self, model: nn.Module) -> None:
        self.work = list(model.parameters())
        mixed = self.work[0].dtype != torch.float32
        self.master = [p.detach().float() for p in self.work] if mixed else self.work
        self.opt = torch.optim.AdamW(self.master, lr=LR, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        if self.master is not self.work:
            for m, p in zip(self.master, self.work, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        self.opt.step()
        if self.master is not self.work:
            for m, p in zip(self.master, self.work, strict=True):
                m.grad = None
                p.copy_(m)

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        for p in self.work:
            p.grad = None

    def close(self) -> None:
        pass


def optimizer(variant: str, model: nn.Module, disk_dir: str) -> Any:
    from kvtier.training import OffloadedOptimizer

    params = model.parameters()
    if variant == "plain":
        return GpuAdamW(model)
    if variant.startswith("torchao"):
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(params, torch.optim.AdamW,
                                   offload_gradients=variant == "torchao_og", lr=LR)
    kw: dict[str, Any] = {"lr": LR}
    if variant == "kvtier_cpu_deferred":
        kw["step_in_backward"] = False
    if variant == "kvtier_cpu_bf16":
        kw["master_weights"] = False
    if variant == "kvtier_gpu_stream":
        kw["mode"] = "gpu_stream"
    if variant == "kvtier_disk":
        kw.update(state_tier="disk", disk_path=disk_dir)
    return OffloadedOptimizer(params, torch.optim.AdamW, **kw)


def raw_disk_gbs(directory: str, nbytes: int = 4 << 30, block: int = 4 << 20,
                 threads: int = 2) -> dict[str, float]:
    """O_DIRECT write (then fdatasync) and read of ``nbytes`` in ``block``-byte requests spread
    over ``threads`` threads (the disk tier's own page size and I/O threads): GB/s each way."""
    path = os.path.join(directory, "raw.dat")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        os.ftruncate(fd, nbytes)
        bufs = [mmap.mmap(-1, block) for _ in range(threads)]
        for b in bufs:
            b.write(os.urandom(block))

        def io(t: int, write: bool) -> None:
            for off in range(t * block, nbytes, threads * block):
                if write:
                    os.pwritev(fd, [bufs[t]], off)
                else:
                    os.preadv(fd, [bufs[t]], off)

        out = {}
        for name, write in (("write_gbs", True), ("read_gbs", False)):
            t0 = time.perf_counter()
            ts = [threading.Thread(target=io, args=(t, write)) for t in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if write:
                os.fdatasync(fd)
            out[name] = nbytes / (time.perf_counter() - t0) / 1e9
        return out
    finally:
        os.close(fd)
        os.unlink(path)


def disk_dir() -> str:
    return tempfile.mkdtemp(prefix="kvtier-optim-")
