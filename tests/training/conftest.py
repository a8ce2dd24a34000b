"""A tiny GPT-style model (2 layers, hidden 64, SDPA attention) and a training loop harness."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvtier.tiers.pinned import HostArena

HIDDEN, HEADS, VOCAB, SEQ = 64, 4, 97, 32
# read once at import: some tests make CUDA look available while their tensors stay on the CPU
HAS_CUDA = torch.cuda.is_available()


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Tiny(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, wrap: Callable[[int, nn.Module, torch.Tensor],
                                                         torch.Tensor] | None = None
                ) -> torch.Tensor:
        x = self.emb(ids)
        for i, blk in enumerate(self.blocks):
            x = wrap(i, blk, x) if wrap is not None else blk(x)
        logits = self.head(x).float()
        return F.cross_entropy(logits.view(-1, VOCAB), ids.roll(-1, 1).view(-1))


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny().to(dtype)


def batch(step: int, micro: int = 0, bsz: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (bsz, SEQ), generator=g)


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.float() - y.float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture
def tiny() -> SimpleNamespace:
    return SimpleNamespace(make_model=make_model, batch=batch, params_equal=params_equal,
                           max_diff=max_diff, Block=Block)


@pytest.fixture
def arena() -> Any:
    with HostArena(256 << 20, 4 << 20, pin=HAS_CUDA) as a:
        yield a
