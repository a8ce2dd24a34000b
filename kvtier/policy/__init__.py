"""Eviction and admission policies. The contract lives in :mod:`kvtier.policy.base`."""

from __future__ import annotations

from kvtier.policy.adapter import PerPagePolicy
from kvtier.policy.admission import AlwaysAdmit, NeverAdmit, ReusedAdmit, create_admission
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy, RowMeta, RowPolicy
from kvtier.policy.hybrid import HybridPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.priority import PriorityPolicy
from kvtier.policy.registry import create_policy, create_row_policy, known_policies
from kvtier.policy.s3fifo import S3FIFOPolicy

__all__ = [
    "ARCPolicy",
    "AdmissionPolicy",
    "AlwaysAdmit",
    "EvictionPolicy",
    "HybridPolicy",
    "LRUPolicy",
    "NeverAdmit",
    "PerPagePolicy",
    "PriorityPolicy",
    "ReusedAdmit",
    "RowMeta",
    "RowPolicy",
    "S3FIFOPolicy",
    "create_admission",
    "create_policy",
    "create_row_policy",
    "known_policies",
]
