"""The byte layout of one stored block: ``[layer, k|v, kv_head, token, head_dim]``.

``KVLayout.of(config, block_size, dtype)`` reads a transformers config; ``raw_bytes`` is one
block's bytes (pages pad it to 4 KiB); ``pack`` / ``unpack`` / ``unpack_into`` convert between
``[layers, 2, kv_heads, tokens, head_dim]`` buffers and one row per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
