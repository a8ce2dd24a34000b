"""Tier stores: the GPU page pool, the pinned host arena and the disk store (see ``base``)."""
