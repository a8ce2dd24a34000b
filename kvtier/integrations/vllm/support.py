"""Which engines the connector can serve without ever serving wrong KV.

``unsupported(kv_cache_config) -> str | None``: why the connector must stay off for this KV cache,
or None. The connector moves one block-id list per request, the same ids in every layer's
tensor, for blocks that stay the request's while it runs. That holds for one KV cache group of
full attention (MLA and sink attention included; a full-attention group whose layers use a
window keeps every block). It does not hold for a sliding-window or chunked-local group (vLLM
frees a running request's blocks outside the window and hands them to other requests, and puts
its null block in their place: a store read another request's bytes, 4 of 20 prompts of a
sliding-window model came out different), for Mamba state, or for several groups (hybrid
models: another group's blocks have other ids). Without a ``kv_cache_config`` (older vLLM) nothing
can be told, and the connector stays on.
"""

from __future__ import annotations

from typing import Any


def unsupported(kv_cache_config: Any) -> str | None:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return None
    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        return f"{len(groups)} KV cache groups ({kinds}): a hybrid model"
    spec = groups[0].kv_cache_spec
    if not _full_attention(spec):
        return f"its KV cache is {type(spec).__name__}, not full attention"
    return None


def _full_attention(spec: Any) -> bool:
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError:  # no vLLM: only its specs reach here
        return type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec",
                                       "SinkFullAttentionSpec")
    return isinstance(spec, FullAttentionSpec)
