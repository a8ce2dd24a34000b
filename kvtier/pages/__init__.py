"""A pool's pages, as a request sees them (below ``kvtier.engine.TierEngine``).

* ``access.py`` ``Residency``: allocate, acquire (restoring pages that are not on the GPU, and
  waiting for them), release;
* ``watermark.py`` ``Watermarks``: the background offload above the threshold and the prefetch
  below the low watermark.

Both stand on ``kvtier.core.EngineCore`` (the lock, the movers) and its ``kvtier.state``.
"""
