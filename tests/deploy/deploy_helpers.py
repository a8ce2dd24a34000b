"""Loads deploy/checks.py and deploy/gen_env.py (deploy/ is not a package) for these tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


checks = _load("kvtier_deploy_checks", ROOT / "deploy" / "checks.py")
gen_env = _load("kvtier_deploy_gen_env", ROOT / "deploy" / "gen_env.py")


def run_check(fn: Callable[..., list[str]], *args: object) -> list[str]:
    """Run one check; skip the test with the reason when its tool is not installed."""
    try:
        return fn(*args)
    except checks.ToolMissing as exc:
        pytest.skip(str(exc))
