"""Buckets of parameters and the flat byte layout their host/device copies share.

``make_buckets(params, bucket_bytes)`` groups parameters (same dtype and device, at most
``bucket_bytes`` each unless one parameter alone is larger) in *reverse* order, because gradients
arrive in reverse order of the forward pass: bucket 0 is the first one whose gradients are complete.

``FlatLayout`` places one region per name (``"master"``, ``"exp_avg"``, ``"grad"``, ...) in one
flat uint8 buffer, each region 64-byte aligned and holding the bucket's parameters back to back.
The same layout is used in every tier (host arena buffer, disk slot, device staging buffer), so a
bucket moves with one copy per direction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.training.base import align


def make_buckets(params: Iterable[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Reverse-order buckets of same-dtype, same-device parameters."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        same = not current or (current[0].dtype == p.dtype and current[0].device == p.device)
        if current and (not same or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass(slots=True)
class FlatLayout:
    """Regions ``name -> (byte offset, dtype)``; every region holds all ``shapes`` back to back."""

    shapes: list[torch.Size]
    regions: dict[str, tuple[int, torch.dtype]] = field(default_factory=dict)
    nbytes: int = 0

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], names: Sequence[tuple[str, torch.dtype]]
              ) -> FlatLayout:
        layout = cls(list(shapes))
        for name, dtype in names:
            layout.add(name, dtype)
        return layout

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    def add(self, name: str, dtype: torch.dtype) -> None:
        assert name not in self.regions, name
        offset = align(self.nbytes)
        self.regions[name] = (offset, dtype)
        self.nbytes = offset + self.numel * torch.empty((), dtype=dtype).element_size()

    def flat(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """The region ``name`` of ``buf`` as one 1-D typed tensor."""
        offset, dtype = self.regions[name]
        nbytes = self.numel * torch.empty((), dtype=dtype).element_size()
        return buf[offset : offset + nbytes].view(dtype)

    def views(self, buf: torch.Tensor, name: str) -> list[torch.Tensor]:
        """One view per parameter (its shape) inside region ``name``."""
        flat = self.flat(buf, name)
        out, start = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(flat[start : start + n].view(shape))
            start += n
        return out
