"""The training benchmark's model: a GPT-style stack of pre-LN blocks (SDPA attention, GELU MLP),
each block split into an attention half and an MLP half (the activation offload's groups), and
plain GPU AdamW over bf16 working weights with fp32 master copies (the baseline optimizer)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Runner = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]  # (index, block, x) -> x

class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, h))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, run: Runner | None = None) -> torch.Tensor:
        x = self.emb(ids)
        for i, blk in enumerate(self.blocks):
            x = run(i, blk, x) if run is not None else blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, self.vocab).float(), ids.roll(-1, 1).view(-1))


class GpuMixedAdamW:
    """Plain GPU AdamW with fp32 master weights (the no-offload reference)."""

    def __init__(self, model: nn.Module) -> None:
        self.work = list(model.parameters())
        self.master = [p.detach().float() for p in self.work]
        self.opt = torch.optim.AdamW(self.master, lr=1e-4, fused=torch.cuda.is_available())

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.master, self.work, strict=True):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        self.opt.step()
        for m, p in zip(self.master, self.work, strict=True):
            m.grad = None
            p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.work:
            p.grad = None
