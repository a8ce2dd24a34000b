"""The byte layout of one stored block: ``[layer, k|v, kv_head, token, head_dim]``.

``KVLayout.of(config, block_size, dtype)`` reads a transformers config; ``raw_bytes`` is one
block's bytes (pages pad it to 4 KiB); ``pack`` / ``unpack`` / ``unpack_into`` convert between
``[layers, 2, kv_heads, tokens, head_dim]`` buffers and one row per block; ``check(kv, device)``
refuses a buffer of another shape, dtype or device (``InvalidArgument``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one page: ``layers x 2 x kv_heads x block_size x head_dim`` of ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, block_size: int, dtype: torch.dtype) -> KVLayout:
        get_text = getattr(config, "get_text_config", None)
        text = get_text(decoder=True) if get_text else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, block_size, dtype)

    @property
    def raw_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.block_size * self.head_dim * elem

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        """``[L, 2, H, n*bs, D]`` → ``[n, raw_bytes]`` uint8 (one row per block)."""
        L, two, H, T, D = kv.shape
        n = T // self.block_size
        blocks = kv.reshape(L, two, H, n, self.block_size, D).permute(3, 0, 1, 2, 4, 5)
        return blocks.contiguous().view(torch.uint8).reshape(n, self.raw_bytes)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`: ``[n, raw_bytes]`` uint8 → ``[L, 2, H, n*bs, D]``."""
        n = rows.shape[0]
        shape = (n, self.layers, 2, self.kv_heads, self.block_size, self.head_dim)
        blocks = rows.contiguous().view(self.dtype).reshape(shape)
        return blocks.permute(1, 2, 3, 0, 4, 5).reshape(
            self.layers, 2, self.kv_heads, n * self.block_size, self.head_dim)

    def unpack_into(self, kv: torch.Tensor, rows: torch.Tensor, at: int = 0) -> int:
        """Write :meth:`unpack` of ``rows`` into ``kv[:, :, :, at:at + T]`` in one copy (``rows``
        may be a strided view of wider slots); returns T."""
        n = rows.shape[0]
        T = n * self.block_size
        src = rows.view(self.dtype).reshape(
            n, self.layers, 2, self.kv_heads, self.block_size, self.head_dim)
        dst = kv[:, :, :, at : at + T].unflatten(3, (n, self.block_size))
        dst.copy_(src.permute(1, 2, 3, 0, 4, 5), non_blocking=True)
        return T

    def check(self, kv: torch.Tensor, device: torch.device, name: str = "kv") -> None:
        """Refuse ``kv`` unless it is a ``[layers, 2, kv_heads, capacity, head_dim]`` tensor of
        ``dtype`` on ``device`` (``InvalidArgument(name)``)."""
        want = f"[layers={self.layers}, 2, kv_heads={self.kv_heads}, capacity, " \
               f"head_dim={self.head_dim}] of {self.dtype} on {device}"
        if not isinstance(kv, torch.Tensor):
            raise InvalidArgument(name, f"need a {want} tensor, got {type(kv).__name__}")
        got = (*kv.shape[:3], kv.shape[-1]) if kv.dim() == 5 else tuple(kv.shape)
        same_device = kv.device.type == device.type and device.index in (None, kv.device.index)
        if got != (self.layers, 2, self.kv_heads, self.head_dim) or kv.dtype != self.dtype \
                or not same_device:
            raise InvalidArgument(name, f"need {want}, got {list(kv.shape)} of {kv.dtype} on "
                                        f"{kv.device}")
