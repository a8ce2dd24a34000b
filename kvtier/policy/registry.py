"""Eviction policies by name.

``create_policy(name)`` resolves, in this order:

1. ``"package.module:ClassName"``: imports the module and takes the class;
2. a built-in name (``lru``, ``priority``, ``hybrid``, ``arc``, ``s3fifo``; case-insensitive);
3. an entry point named ``name`` in the group ``kvtier.policies`` (third-party packages).

The object found must be an ``EvictionPolicy`` subclass; it is instantiated with no arguments.
Anything else (unknown name, import failure, wrong type) raises ``ConfigError`` whose message
names ``KVCACHED_OFFLOAD_POLICY`` and, for unknown names, lists ``known_policies()``.
Entry points are looked up on every call, never cached, so nothing is read at import time.

``create_row_policy(name)`` is the engine's form: the same lookup, returning the policy itself
when it is already a ``RowPolicy`` (``lru``) and otherwise wrapping it in
``adapter.PerPagePolicy`` (its page ids become rows). Unknown names raise as above.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType

from kvtier.config import ENV_PREFIX
from kvtier.errors import ConfigError
from kvtier.policy.adapter import PerPagePolicy
from kvtier.policy.base import EvictionPolicy, RowPolicy

ENTRY_POINT_GROUP = "kvtier.policies"
_VAR = f"{ENV_PREFIX}POLICY"

# Import paths, not classes: a broken optional policy can't break ``import kvtier.policy``.
BUILTIN_POLICIES: Mapping[str, str] = MappingProxyType(
    {
        "lru": "kvtier.policy.lru:LRUPolicy",
        "priority": "kvtier.policy.priority:PriorityPolicy",
        "hybrid": "kvtier.policy.hybrid:HybridPolicy",
        "arc": "kvtier.policy.arc:ARCPolicy",
        "s3fifo": "kvtier.policy.s3fifo:S3FIFOPolicy",
    }
)


def known_policies() -> list[str]:
    """Built-in names first (in registration order), then entry-point names, sorted."""
    names = list(BUILTIN_POLICIES)
    extra = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - set(names))
    return names + extra


def create_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance for ``name``; see the module docstring for the lookup order."""
    key = name.strip()
    if ":" in key:
        return _instantiate(key, _load_path(key))
    if key.lower() in BUILTIN_POLICIES:
        return _instantiate(key, _load_path(BUILTIN_POLICIES[key.lower()]))
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=key):
        try:
            obj = ep.load()
        except Exception as exc:  # a third-party import can fail in any way
            raise ConfigError(
                f"{_VAR}={name!r}: cannot load entry point {ep.value!r}: {exc}"
            ) from exc
        return _instantiate(key, obj)
    accepted = "|".join(known_policies())
    raise ConfigError(
        f"{_VAR}={name!r} is not a known eviction policy; accepted: {accepted} or 'module:Class'"
    )


def create_row_policy(name: str) -> RowPolicy:
    """A fresh ``RowPolicy`` for ``name``: native, or the per-page policy behind the adapter."""
    policy = create_policy(name)
    return policy if isinstance(policy, RowPolicy) else PerPagePolicy(policy)


def _load_path(path: str) -> object:
    """The object named by ``"package.module:Attr"`` (dotted attributes allowed)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"{_VAR}={path!r} is invalid; accepted: a built-in name or 'module:Class'"
        )
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # ImportError or whatever the module raises while importing
        raise ConfigError(f"{_VAR}={path!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{_VAR}={path!r}: {module_name!r} has no {attr!r}") from None
    return obj


def _instantiate(name: str, obj: object) -> EvictionPolicy:
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        raise ConfigError(f"{_VAR}={name!r}: {obj!r} is not an EvictionPolicy subclass")
    try:
        return obj()
    except TypeError as exc:  # abstract methods left, or a constructor that needs arguments
        raise ConfigError(f"{_VAR}={name!r}: cannot instantiate {obj.__name__}: {exc}") from exc
