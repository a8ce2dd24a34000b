"""Tiny randomly initialised Llama models and a word-level tokenizer, built locally (no downloads).

``build_tiny_llama(path, shape)`` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``
and the tokenizer config under ``path`` and returns it; both transformers and vLLM load the folder.
Words ``w0 .. w{vocab-5}`` map to ids after four special tokens, so a prompt is easy to write.
"""

from __future__ import annotations

import json
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


def build_tiny_mistral(path: str | Path, shape: TinyShape = TinyShape(), *, window: int,
                       seed: int = 0) -> Path:
    """A Mistral-style model (every layer attends over a sliding window of ``window`` tokens)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    base = llama_config(shape).to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    cfg = MistralConfig(**{k: base[k] for k in keep}, sliding_window=window,
                        head_dim=shape.head_dim)
    torch.manual_seed(seed)
    model = MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    build_tokenizer(shape.vocab).save_pretrained(out)
    return out


def words(ids: list[int]) -> str:
    """The text that tokenizes to ``ids`` (ids must be ≥ the special tokens)."""
    return " ".join(f"w{i - len(SPECIALS)}" for i in ids)


def build_tiny_lora(path: str | Path, shape: TinyShape = TinyShape(), *, seed: int = 1,
                    rank: int = 8) -> Path:
    """A PEFT-format LoRA adapter (attention q/k/v/o, random A and B) for ``shape``'s model.

    It changes the keys and values, so the same tokens give other KV under it than without it.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    kv = shape.kv_heads * shape.head_dim
    dims = {"q_proj": (shape.hidden, shape.hidden), "k_proj": (shape.hidden, kv),
            "v_proj": (shape.hidden, kv), "o_proj": (shape.hidden, shape.hidden)}
    tensors = {}
    for layer in range(shape.layers):
        for mod, (d_in, d_out) in dims.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.2
            tensors[f"{pre}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.2
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "target_modules": list(dims), "bias": "none", "task_type": "CAUSAL_LM",
              "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": None}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` token ids in ``[4, vocab)`` (past the special tokens), reproducible from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def next_token(model, ids: list[int]) -> int:  # model: a transformers causal LM
    """The greedy next token after ``ids`` from a plain forward (no cache)."""
    import torch

    with torch.no_grad():
        return int(model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].argmax())
