"""Eviction and admission policies. The contract lives in :mod:`kvtier.policy.base`."""

from __future__ import annotations

from kvtier.policy.admission import AlwaysAdmit, NeverAdmit, ReusedAdmit, create_admission
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.registry import create_policy, known_policies

__all__ = [
    "AdmissionPolicy",
    "AlwaysAdmit",
    "EvictionPolicy",
    "LRUPolicy",
    "NeverAdmit",
    "ReusedAdmit",
    "create_admission",
    "create_policy",
    "known_policies",
]
