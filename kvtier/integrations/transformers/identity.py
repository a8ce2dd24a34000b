"""What a stored page's bytes depend on besides the tokens: the model that computed them.

Keys live in a namespace (``kvtier.client._blocks.namespace``); two stores share pages only if
their namespaces are equal, so the namespace must change whenever the KV of the same tokens would.

- :func:`model_parts(config, model, model_id)` — the namespace parts naming the model: the digest
  of its config and the digest of its weights (``model``), or the caller's ``model_id`` (a name
  the caller vouches for: one name, one set of weights), or both. Neither refuses
  (``InvalidArgument("model_id")``): a namespace of the shape alone lets two models of one shape
  read each other's KV.
- :func:`config_digest(config)` — ``config.to_dict()`` less the fields that differ between two
  loads of one model without changing its KV (paths, versions, output switches, label maps).
  RoPE settings, windows, norms, activations: everything else counts.
- :func:`weights_digest(model)` — each state-dict tensor's name, shape and dtype, and its bytes:
  whole up to ``_WHOLE`` bytes, else ``_PIECES`` pieces at evenly spaced offsets. One copy of a
  few KiB per tensor to the host, at construction: cheap for any model size. Two models that
  differ only in bytes between the samples get one namespace; weights changed after the store
  was made are not seen (make a new store).
- :func:`check_full_attention(config)` — refuse (``InvalidArgument("model_config")``) a model
  with any layer that does not attend over the whole prefix (sliding windows, chunked or linear
  attention, state-space layers): its cache holds less than the prefix, so a saved block would
  hold the KV of other positions.
- :func:`check_dtype(model, dtype)` — refuse a store whose dtype is not the model's.
- :func:`of_model(model, config, dtype, device)` — each of the last three, the model's unless
  given; none and no model refuses (``InvalidArgument`` naming it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from kvtier.errors import InvalidArgument

_VOLATILE = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_experts_implementation", "dtype", "torch_dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "id2label", "label2id",
    "problem_type", "tokenizer_class",
})
_WHOLE = 64 * 1024  # tensors up to this many bytes are hashed whole
_PIECES, _PIECE = 8, 512  # larger ones: 8 pieces of 512 bytes, evenly spaced


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config nests it)."""
    get_text = getattr(config, "get_text_config", None)
    return get_text(decoder=True) if get_text else config


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return value


def config_digest(config: Any) -> str:
    """A hex digest of ``config.to_dict()`` less the volatile fields (see the module docstring)."""
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise InvalidArgument("model_config", f"need a transformers config, got "
                                              f"{type(config).__name__}")
    text = json.dumps(_stable(to_dict()), sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _sample(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` that the digest reads (uint8, on ``t``'s device)."""
    raw = t.detach().reshape(-1)
    raw = raw.view(torch.uint8) if raw.numel() else raw.new_empty(0, dtype=torch.uint8)
    n = raw.numel()
    if n <= _WHOLE:
        return raw
    span = n - _PIECE
    return torch.cat([raw[i * span // (_PIECES - 1) :][:_PIECE] for i in range(_PIECES)])


def weights_digest(model: torch.nn.Module) -> str:
    """A hex digest of ``model``'s state dict (see the module docstring)."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgument("model", f"need a torch.nn.Module, got {type(model).__name__}")
    h = hashlib.blake2b(digest_size=16, person=b"kvtier-weights")
    samples: dict[torch.device, list[torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_meta:
            raise InvalidArgument("model", f"{name} is on the meta device (offloaded weights "
                                           "can't be read): give model_id= instead")
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\x00".encode())
        samples.setdefault(t.device, []).append(_sample(t))
    for dev in sorted(samples, key=str):  # one copy to the host per device
        h.update(torch.cat(samples[dev]).cpu().numpy().tobytes())
    return h.hexdigest()


def model_parts(config: Any, model: torch.nn.Module | None, model_id: str) -> tuple[object, ...]:
    """The namespace parts naming the model (see the module docstring)."""
    if not isinstance(model_id, str):
        raise InvalidArgument("model_id", f"need a string, got {type(model_id).__name__}")
    if model is None and not model_id:
        raise InvalidArgument("model_id", "give model= (its weights are fingerprinted) or a "
                                          "non-empty model_id naming the weights: a namespace "
                                          "of the shape alone mixes models of one shape")
    weights = None if model is None else weights_digest(model)
    return ("config", config_digest(config)), ("weights", weights), ("model_id", model_id)


def check_full_attention(config: Any) -> None:
    """Refuse a config with any layer that is not full attention (see the module docstring)."""
    text = text_config(config)
    types = getattr(text, "layer_types", None)
    if types:
        other = sorted({t for t in types if t != "full_attention"})
        if other:
            raise InvalidArgument("model_config", f"layer_types has {other}: only models "
                                  "with full attention in every layer can be stored")
        return
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) is not False:
        raise InvalidArgument("model_config", f"sliding_window={window}: only models with full "
                              "attention in every layer can be stored")
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk:
        raise InvalidArgument("model_config", f"attention_chunk_size={chunk}: only models "
                              "with full attention in every layer can be stored")


def check_dtype(model: torch.nn.Module | None, dtype: torch.dtype) -> None:
    """Refuse a store whose dtype differs from the model's (its KV's)."""
    got = getattr(model, "dtype", None)
    if isinstance(got, torch.dtype) and got.is_floating_point and got != dtype:
        raise InvalidArgument("dtype", f"the store's {dtype} differs from the model's {got}: "
                                       "KV would be cast on every save and restore")


def of_model(model: torch.nn.Module | None, config: Any, dtype: torch.dtype | None,
              device: torch.device | str | None) -> tuple[Any, torch.dtype, torch.device | str]:
    """``model_config``, ``dtype`` and ``device``, each the model's unless given."""
    if model is not None:
        config = model.config if config is None else config
        dtype = getattr(model, "dtype", None) if dtype is None else dtype
        device = getattr(model, "device", None) if device is None else device
    for name, value in (("model_config", config), ("dtype", dtype), ("device", device)):
        if value is None:
            raise InvalidArgument(name, "required (or give model=)")
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument("dtype", f"need a torch.dtype, got {dtype!r}")
    assert config is not None and device is not None
    return config, dtype, device
