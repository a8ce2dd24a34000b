"""The integrations' old import paths give the very modules of ``kvtier.integrations``."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_old_transformers_paths_are_the_new_modules() -> None:
    pytest.importorskip("transformers")
    import kvtier.client.hf_cache as old_cache
    import kvtier.client.hf_static as old_static

    from kvtier.integrations.transformers import cache, static

    assert old_cache is cache and old_static is static
    from kvtier.client.hf_cache import ConversationStore

    assert ConversationStore is cache.ConversationStore


def test_old_vllm_connector_path_is_the_new_module() -> None:
    pytest.importorskip("vllm")
    old = importlib.import_module("kvtier.client.vllm_connector")  # what vLLM's factory does
    new = importlib.import_module("kvtier.integrations.vllm.connector")
    assert old is new and old.KVTierConnector.__module__ == new.__name__


def test_client_import_pulls_in_no_engine() -> None:
    code = ("import sys, kvtier.client; "
            "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_names_are_still_missing() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvtier.client.no_such_module")
