"""The remote value format: a value verifies only as exactly what was framed, for that key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.frame import KEY_PREFIX, Framer

SECRET = b"a-cluster-secret-of-32-bytes-...."
F = Framer(SECRET)
KEY = bytes(range(16))


@given(st.binary(min_size=0, max_size=4096))
def test_roundtrip_returns_exactly_the_payload(payload: bytes) -> None:
    got = F.unframe(KEY, F.frame(KEY, payload), len(payload))
    assert isinstance(got, memoryview) and bytes(got) == payload


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_flipped_bit_or_cut_is_refused(payload: bytes, data: st.DataObject) -> None:
    value = bytearray(F.frame(KEY, payload))
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    assert isinstance(F.unframe(KEY, bytes(value), len(payload)), str)
    cut = data.draw(st.integers(0, len(value) - 1))
    assert isinstance(F.unframe(KEY, F.frame(KEY, payload)[:cut], len(payload)), str)


def test_other_secret_other_key_other_length_are_refused() -> None:
    value = F.frame(KEY, b"x" * 100)
    assert Framer(b"another-secret-of-16+bytes").unframe(KEY, value, 100) == "mac"
    assert F.unframe(bytes(16), value, 100) == "key"
    assert F.unframe(KEY, value, 99) == "length"
    assert F.unframe(KEY, b"junk" * 40, 100) == "header"


def test_store_keys_hide_the_block_key_and_depend_on_the_secret() -> None:
    k = F.store_key(KEY)
    assert k.startswith(KEY_PREFIX) and KEY.hex().encode() not in k
    assert Framer(b"another-secret-of-16+bytes").store_key(KEY) != k
    assert F.store_key(bytes(16)) != k
