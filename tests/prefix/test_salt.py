"""kvtier/prefix/salt.py: the tenant salt (persisted in disk records: must never change)."""

from __future__ import annotations

import hashlib
import os

from kvtier.prefix.salt import Salted, _tenant_key, salt_key, salt_keys


def test_salt_key_is_the_keyed_blake2b_of_the_block_key() -> None:
    for tenant in ("a", "tenant-b", ""):
        for key in (b"", b"x", os.urandom(32), os.urandom(200)):
            want = hashlib.blake2b(key, key=_tenant_key(tenant), digest_size=16).digest()
            assert salt_key(tenant, key) == want
    assert salt_key("a", b"k") != salt_key("b", b"k")


def test_salt_keys_and_salted_spans_give_each_keys_salt() -> None:
    keys = [os.urandom(32) for _ in range(50)] + [b"x", b"x"]
    want = [salt_key("t", k) for k in keys]
    assert salt_keys("t", keys) == want and salt_keys("t", []) == []
    assert salt_keys("u", keys) != want
    salted = Salted("t", keys)
    assert salted.span(10, 20) == want[10:20]  # salts 0..19 once
    assert salted.span(0, 5) == want[:5]
    assert salted.span(40, 999) == want[40:]  # clipped to the keys
