"""Block keys: remembered chains (``KeyChains``) give exactly ``chain_keys``' keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.client._blocks import KeyChains, chain_keys


@settings(max_examples=80, deadline=None)
@given(turns=st.lists(st.lists(st.integers(0, 9), max_size=40), min_size=1, max_size=6),
       edits=st.lists(st.integers(0, 200), max_size=3))
def test_key_chains_equal_chain_keys(turns: list[list[int]], edits: list[int]) -> None:
    """Growing conversations, histories edited inside a remembered block, several
    conversations sharing a first block, and a capacity smaller than the conversations."""
    chains = KeyChains(4, ns=b"n", capacity=2)
    history: list[int] = []
    for i, turn in enumerate(turns):
        history = history + turn
        if i % 2:
            for e in edits:
                if e < len(history):
                    history = [*history[:e], history[e] + 1, *history[e + 1 :]]
        for toks in (history, [t + 1 for t in history], history[: len(history) // 2],
                     history[:4] + [7] * 9):
            assert chains.keys(toks) == chain_keys(toks, 4, ns=b"n")


def test_key_chains_namespace_and_bad_block_size() -> None:
    toks = list(range(12))
    assert KeyChains(4, ns=b"a").keys(toks) != KeyChains(4, ns=b"b").keys(toks)
    assert KeyChains(4).keys(toks[:3]) == []
    with pytest.raises(ValueError, match="block_size"):
        KeyChains(0)
