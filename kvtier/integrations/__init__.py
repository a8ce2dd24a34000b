"""Inference engines on kvtier, over the client's shared block machinery.

- :mod:`kvtier.integrations.vllm` — a vLLM v1 KV connector (``connector.KVTierConnector``).
- :mod:`kvtier.integrations.transformers` — multi-turn prefix reuse for transformers generation
  (``cache.ConversationStore``, ``static.StaticPrefill``).

Both speak to kvtier through ``kvtier.client._backend.Backend`` (an in-process engine or the
daemon) and share ``kvtier.client._blocks`` (chained block keys), ``kvtier.client.block_rows``
(an engine's KV tensors seen as pages) and ``kvtier.client.block_mover`` (keyed block copies).
Nothing here is imported by the daemon; each sub-package imports its engine lazily.
"""
