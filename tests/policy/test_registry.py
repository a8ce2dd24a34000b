"""Policy lookup: built-in names, `module:Class` paths, the `kvtier.policies` entry points."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.registry import BUILTIN_POLICIES, create_policy, known_policies

_PLUGIN = """
from __future__ import annotations

from kvtier.policy.lru import LRUPolicy


class FancyPolicy(LRUPolicy):
    name = "fancy"


class NotAPolicy:
    pass
"""


def _write_module(root: Path, source: str) -> str:
    """A uniquely named module under ``root`` (so module caches can't leak between tests)."""
    module = f"plugin_{uuid.uuid4().hex}"
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    return module


def _write_distribution(root: Path, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution: what ``pip install`` would leave in site-packages."""
    dist = root / "kvtier_fancy_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvtier-fancy-plugin\nVersion: 1.0\n"
    )
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[kvtier.policies]\n{lines}")


def test_builtins_are_known_and_created_by_name() -> None:
    names = known_policies()
    assert names[: len(BUILTIN_POLICIES)] == list(BUILTIN_POLICIES)
    for name in BUILTIN_POLICIES:
        policy = create_policy(name)
        assert isinstance(policy, EvictionPolicy)
        assert policy.name == name
    assert isinstance(create_policy(" LRU "), LRUPolicy)


def test_each_call_returns_a_fresh_instance() -> None:
    assert create_policy("lru") is not create_policy("lru")


def test_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _write_module(tmp_path, _PLUGIN)
    policy = create_policy(f"{module}:FancyPolicy")
    assert type(policy).__name__ == "FancyPolicy"
    assert type(policy).__module__ == module
    sys.modules.pop(module, None)


@pytest.mark.parametrize("attr", ["NotAPolicy", "Missing"])
def test_module_path_to_a_non_policy_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attr: str
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _write_module(tmp_path, _PLUGIN)
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_POLICY"):
        create_policy(f"{module}:{attr}")
    sys.modules.pop(module, None)


@pytest.mark.parametrize(
    "path",
    [
        "no_such_module_kvtier:Policy",
        ":LRUPolicy",
        "kvtier.policy.lru:",
        "kvtier.policy.base:EvictionPolicy",
    ],
)
def test_bad_module_paths_are_config_errors(path: str) -> None:
    with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_POLICY"):
        create_policy(path)


def test_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _write_module(tmp_path, _PLUGIN)
    _write_distribution(
        tmp_path, {"fancy": f"{module}:FancyPolicy", "bogus": f"{module}:NotAPolicy"}
    )
    assert "fancy" in known_policies()
    assert known_policies().index("fancy") >= len(BUILTIN_POLICIES)
    assert type(create_policy("fancy")).__name__ == "FancyPolicy"
    with pytest.raises(ConfigError, match="not an EvictionPolicy"):
        create_policy("bogus")
    sys.modules.pop(module, None)


def test_entry_point_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_distribution(tmp_path, {"broken": "no_such_module_kvtier:Policy"})
    with pytest.raises(ConfigError, match="cannot load entry point"):
        create_policy("broken")


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        create_policy("mru")
    message = str(info.value)
    assert "KVCACHED_OFFLOAD_POLICY" in message
    assert "'mru'" in message
    for name in known_policies():
        assert name in message
