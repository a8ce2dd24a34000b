"""What identifies a vLLM KV block in kvtier, besides its tokens (no vLLM import; unit-testable).

Primitives:

- :func:`files_fingerprint` — a digest of a model or adapter folder's files: names, sizes, mtimes
  and 64 KiB samples of each weight file's content (head, tail, evenly spaced middle). New weights
  written at the same path give a new fingerprint; a path that is not a local folder (a hub id not
  resolved locally) gives ``None`` and the caller falls back to its name and revision.
- :func:`engine_namespace` — the digest every key of one engine is rooted in: the weights'
  fingerprint, the model config, dtype, KV cache dtype, block size, the KV cache layout (per-group
  specs: heads, head size, dtype), tensor/pipeline sizes and the vLLM version.
- :func:`request_salt` — what changes a request's KV for the same tokens: its LoRA adapter (name,
  path and files' fingerprint), ``cache_salt`` and multimodal inputs (hash and placement). Empty
  for a plain request, so plain requests of every engine with the same namespace share blocks.
- :class:`Rank` and :func:`rank_keys` / :func:`all_rank_keys` — each worker stores its own shard
  under its own keys (rank and shard layout mixed in); the scheduler asks for the keys of every
  rank interleaved, so the longest stored prefix divided by the number of ranks is the number of
  blocks that *every* rank holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvtier.client._blocks import KEY_BYTES, namespace

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_SAMPLE = 64 * 1024
_MIDDLE_SAMPLES = 14


def _sample_file(path: Path, size: int) -> bytes:
    """blake2b of 64 KiB at the head, the tail and evenly spaced offsets of the file."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    offsets = {0, max(0, size - _SAMPLE)}
    offsets.update(size * (i + 1) // (_MIDDLE_SAMPLES + 1) for i in range(_MIDDLE_SAMPLES))
    with open(path, "rb") as fh:
        for off in sorted(offsets):
            fh.seek(off)
            h.update(off.to_bytes(8, "little"))
            h.update(fh.read(_SAMPLE))
    return h.digest()


def files_fingerprint(folder: str | os.PathLike[str]) -> str | None:
    """Digest of ``folder``'s files (recursively), or ``None`` if it is not a local folder."""
    root = Path(folder)
    if not root.is_dir():
        return None
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-files")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        rel = path.relative_to(root).as_posix()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if path.name.endswith(_WEIGHT_SUFFIXES) or path.suffix == ".json":
            h.update(_sample_file(path, st.st_size))
    return h.hexdigest()


@lru_cache(maxsize=64)
def _cached_fingerprint(folder: str, stamp: tuple[int, int]) -> str | None:
    return files_fingerprint(folder)


def _stamp(root: Path) -> tuple[int, int]:
    """(file count, newest mtime) of a folder's files: changes when any file is rewritten."""
    newest, count = root.stat().st_mtime_ns, 0
    for p in root.rglob("*"):
        if p.is_file():
            count += 1
            newest = max(newest, p.stat().st_mtime_ns)
    return count, newest


def folder_identity(path: str) -> str:
    """A folder's fingerprint (cached while no file in it changes), else the path string.

    An adapter rewritten in place gets a new identity at once; vLLM itself keeps serving an
    adapter it already loaded until it reloads it (``load_inplace``), so give a new version a
    new LoRA name or id.
    """
    root = Path(path)
    if not root.is_dir():
        return f"name:{path}"
    fp = _cached_fingerprint(path, _stamp(root))
    return f"files:{fp}" if fp is not None else f"name:{path}"


def _hub_snapshot(model: str, revision: str | None) -> str | None:
    """The local snapshot folder of a hub model id, if the hub library has it cached."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def weights_identity(model: str, revision: str | None) -> str:
    """The weights' fingerprint: of the local folder, else of the hub cache's snapshot of it."""
    if Path(model).is_dir():
        return folder_identity(model)
    snap = _hub_snapshot(model, revision)
    if snap is not None:
        return folder_identity(snap)
    return f"name:{model}@{revision}"


def _spec_repr(spec: Any) -> str:
    fields = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode",
              "sliding_window", "attention_chunk_size", "page_size_padded")
    return repr((type(spec).__name__, [(f, repr(getattr(spec, f, None))) for f in fields]))


def kv_layout(kv_cache_config: Any) -> str:
    """The KV cache layout of every group (layers, per-rank heads, head size, dtype)."""
    if kv_cache_config is None:
        return ""
    groups = [(list(g.layer_names), _spec_repr(g.kv_cache_spec))
              for g in getattr(kv_cache_config, "kv_cache_groups", [])]
    return repr((groups, getattr(kv_cache_config, "kv_cache_layout", None)))


def engine_namespace(vllm_config: Any, kv_cache_config: Any) -> bytes:
    """What every page's bytes of this engine depend on besides the tokens (see module doc)."""
    import vllm

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    hf = getattr(mc, "hf_config", None)
    to_json = getattr(hf, "to_json_string", None)
    hf_text = to_json(use_diff=False) if to_json is not None else repr(hf)
    return namespace(
        "vllm-v2", vllm.__version__, weights_identity(mc.model, getattr(mc, "revision", None)),
        hf_text, str(mc.dtype), getattr(mc, "quantization", None), cc.cache_dtype,
        cc.block_size, mc.get_num_layers(pc), mc.get_total_num_kv_heads(), mc.get_head_size(),
        pc.tensor_parallel_size, pc.pipeline_parallel_size, kv_layout(kv_cache_config))


def request_salt(request: Any) -> bytes:
    """A digest of what changes this request's KV for the same tokens; ``b""`` when nothing."""
    parts: list[object] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
        parts.append(("lora", lora.lora_name, path, folder_identity(path) if path else ""))
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("salt", str(salt)))
    for f in getattr(request, "mm_features", None) or []:
        pos = getattr(f, "mm_position", None)
        parts.append(("mm", getattr(f, "identifier", None), getattr(f, "mm_hash", None),
                      getattr(f, "modality", None), getattr(pos, "offset", None),
                      getattr(pos, "length", None)))
    if not parts:
        return b""
    return namespace("request", json.dumps(parts, default=repr, sort_keys=True))


@dataclass(frozen=True, slots=True)
class Rank:
    """One worker's place in the shard layout."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    def salt(self) -> bytes:
        return namespace("rank", self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)


def rank_keys(keys: list[bytes], rank: Rank) -> list[bytes]:
    """The keys under which ``rank`` stores its shard of the blocks ``keys``."""
    salt = rank.salt()
    return [hashlib.blake2b(salt + k, digest_size=KEY_BYTES, person=b"kvtier-rank").digest()
            for k in keys]


def all_ranks(tp_size: int, pp_size: int) -> list[Rank]:
    return [Rank(t, tp_size, p, pp_size) for p in range(pp_size) for t in range(tp_size)]


def all_rank_keys(keys: list[bytes], tp_size: int, pp_size: int) -> list[bytes]:
    """Every rank's key of block 0, then of block 1, ... (``len(keys) * world`` keys)."""
    per_rank = [rank_keys(keys, r) for r in all_ranks(tp_size, pp_size)]
    return [k for block in zip(*per_rank, strict=True) for k in block]
