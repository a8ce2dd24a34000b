"""Tenants: who may hold how much, and what each may see.

* ``quotas.py``: per-tenant shares of each tier (parsed from the config) and the ledger of what
  each tenant holds, kept by the page table;
* ``views.py``: admitting a tenant's pool, and a tenant's own view of the stats.

This package's ``__init__`` imports nothing: ``kvtier.config`` imports ``quotas``.
"""
