"""Tiny randomly initialised Llama models and a word-level tokenizer, built locally (no downloads).

``build_tiny_llama(path, shape)`` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``
and the tokenizer config under ``path`` and returns it; both transformers and vLLM load the folder.
Words ``w0 .. w{vocab-5}`` map to ids after four special tokens, so a prompt is easy to write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


@dataclass(frozen=True, slots=True)
class TinyShape:
    """One model shape; ``kv_heads < heads`` gives grouped-query attention."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    intermediate: int = 128
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def llama_config(shape: TinyShape):  # -> transformers.LlamaConfig
    """A ``LlamaConfig`` for ``shape`` with the tokenizer's special ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )


def random_llama(shape: TinyShape, *, seed: int = 0, dtype: str = "float32"):
    """A ``LlamaForCausalLM`` with seeded random weights, in eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = llama_config(shape)
    cfg.dtype = dtype
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    # Larger weights than the default init make logits spread, so greedy ties are unlikely.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def build_tokenizer(vocab: int):  # -> transformers.PreTrainedTokenizerFast
    """A whitespace word-level tokenizer: ``"w7 w9"`` → ``[11, 13]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)}
    words.update({f"w{i}": i + len(SPECIALS) for i in range(vocab - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )


def build_tiny_llama(path: str | Path, shape: TinyShape = TinyShape(), *, seed: int = 0) -> Path:
    """Write a loadable model folder for ``shape`` under ``path``; returns the folder."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    random_llama(shape, seed=seed).save_pretrained(out, safe_serialization=True)
    build_tokenizer(shape.vocab).save_pretrained(out)
    return out


def words(ids: list[int]) -> str:
    """The text that tokenizes to ``ids`` (ids must be ≥ the special tokens)."""
    return " ".join(f"w{i - len(SPECIALS)}" for i in ids)
