"""What identifies a vLLM block in kvtier, without vLLM: weights, request salt, ranks, rewinds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtier.client._blocks import chain_keys

from kvtier.integrations.vllm.identity import (
    Rank,
    all_rank_keys,
    files_fingerprint,
    folder_identity,
    rank_keys,
    request_salt,
)
from kvtier.integrations.vllm.plan import BlockTransfer, LoadStorePlanner
from kvtier.integrations.vllm.steps import safe_length

BS = 4


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def cached(req_ids=(), new_block_ids=(), computed=()) -> SimpleNamespace:
    return SimpleNamespace(req_ids=list(req_ids), new_block_ids=list(new_block_ids),
                           num_computed_tokens=list(computed), resumed_req_ids=set())


def test_new_weights_at_the_same_path_change_the_fingerprint(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x01" * 300_000)
    (tmp_path / "config.json").write_text("{}")
    before = files_fingerprint(tmp_path)
    st = weights.stat()
    weights.write_bytes(b"\x01" * 150_000 + b"\x02" + b"\x01" * 149_999)  # same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    assert files_fingerprint(tmp_path) != before
    assert files_fingerprint(tmp_path / "missing") is None
    assert folder_identity("org/hub-model") == "name:org/hub-model"


def test_lora_salt_and_images_change_keys_on_both_paths(tmp_path: Path) -> None:
    tokens = list(range(12))
    lora_a = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path))
    lora_b = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "b"))
    image = SimpleNamespace(identifier="img1", mm_hash="h1", modality="image",
                            mm_position=SimpleNamespace(offset=2, length=3))
    variants = [Req("r", tokens), Req("r", tokens, lora_request=lora_a),
                Req("r", tokens, lora_request=lora_b), Req("r", tokens, cache_salt="s"),
                Req("r", tokens, mm_features=[image])]
    assert request_salt(variants[0]) == b""
    for engine_hashes in (False, True):
        p = LoadStorePlanner(lambda k: 0, BS, b"ns", use_engine_hashes=engine_hashes)
        for v in variants:
            v.block_hashes = [b"h0", b"h1", b"h2"]
        firsts = {p.keys(v, 3)[0] for v in variants}
        assert len(firsts) == len(variants), engine_hashes
    plain = LoadStorePlanner(lambda k: 0, BS, b"ns", use_engine_hashes=False)
    assert plain.keys(variants[0], 3) == chain_keys(tokens, BS, ns=b"ns")


def test_adapter_rewritten_at_its_path_changes_the_salt(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00" * 1000)
    lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path))
    before = request_salt(Req("r", [1], lora_request=lora))
    weights = tmp_path / "adapter_model.safetensors"
    mtime = weights.stat().st_mtime_ns
    weights.write_bytes(b"\x07" * 1000)  # rewritten in place: the folder's mtime stays
    os.utime(weights, ns=(mtime + 1, mtime + 1))
    assert request_salt(Req("r", [1], lora_request=lora)) != before


def test_rank_keys_differ_and_lookups_need_every_rank() -> None:
    keys = chain_keys(list(range(12)), BS)
    r0, r1 = Rank(0, 2), Rank(1, 2)
    assert not set(rank_keys(keys, r0)) & set(rank_keys(keys, r1))
    assert rank_keys(keys, Rank(0, 1)) != rank_keys(keys, r0)  # the shard layout counts too
    both = all_rank_keys(keys, 2, 1)
    assert both[0::2] == rank_keys(keys, r0) and both[1::2] == rank_keys(keys, r1)
    stored = set(rank_keys(keys, r0)) | set(rank_keys(keys[:1], r1))  # rank 1 holds block 0
    prefix = 0
    while prefix < len(both) and both[prefix] in stored:
        prefix += 1
    assert prefix // 2 == 1


def test_safe_length_stops_at_a_tainted_chain() -> None:
    t = BlockTransfer("r", [b"k"] * 3, [7, 8, 9], [5, 6])
    assert safe_length(t, set()) == 3
    assert safe_length(t, {6}) == 0  # an earlier block of the chain failed to load
    assert safe_length(t, {8}) == 1
    assert safe_length(t, {1, 2}) == 3  # other requests' blocks don't matter


def test_rewound_request_stores_its_recomputed_blocks() -> None:
    tokens = list(range(17))
    keys = chain_keys(tokens, BS, ns=b"ns")
    stored = set(keys[:3])
    p = LoadStorePlanner(lambda k: next((i for i, x in enumerate(k) if x not in stored),
                                        len(k)), BS, b"ns", use_engine_hashes=False)
    req = Req("r", tokens)
    assert p.matched_tokens(req, 0) == 12
    p.after_alloc(req, [10, 11, 12, 13, 14], 12)
    nr = SimpleNamespace(req_id="r", block_ids=([10, 11, 12, 13, 14],), num_computed_tokens=12)
    loads, stores = p.build([nr], cached(), {"r": 5}, {})
    assert loads == [BlockTransfer("r", keys[:3], [10, 11, 12])]
    assert stores == [BlockTransfer("r", keys[3:4], [13], [10, 11, 12])]
    # Block 11 failed to load: vLLM rewinds the request to 4 tokens and recomputes 4..16.
    loads, stores = p.build([], cached(["r"], [None], [4]), {"r": 13}, {})
    assert loads == [] and stores == [BlockTransfer("r", keys[1:4], [11, 12, 13], [10])]


def test_prompt_embeds_are_never_keyed_by_their_token_ids() -> None:
    """vLLM sets an embeddings prompt's token ids to 0: keyed by them, two different prompts
    shared keys and the second was served the first's KV (a probe with two random 100 x 128
    prompts, prefix caching off). Such a request is neither looked up, loaded nor stored, unless
    vLLM's own block hashes (which cover the embeddings) key it."""
    asked: list[list[bytes]] = []

    def lookup(keys: list[bytes]) -> int:
        asked.append(keys)
        return len(keys)  # everything "stored": a token-id key would hit

    embeds = Req("e", [0] * 13, prompt_embeds=object())
    p = LoadStorePlanner(lookup, BS, b"ns", use_engine_hashes=False)
    assert p.matched_tokens(embeds, 0) == 0 and asked == []
    p.after_alloc(embeds, [1, 2, 3, 4], 0)
    nr = SimpleNamespace(req_id="e", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)
    assert p.build([nr], cached(), {"e": 13}, {}) == ([], [])
    assert not p.finished("e")
    hashed = Req("h", [0] * 13, block_hashes=[b"a", b"b", b"c"], prompt_embeds=object())
    engine = LoadStorePlanner(lookup, BS, b"ns", use_engine_hashes=True)
    assert engine.matched_tokens(hashed, 0) == 12 and len(asked) == 1
