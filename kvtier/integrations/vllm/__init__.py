"""kvtier as a vLLM v1 KV connector: ``kvtier.integrations.vllm.connector.KVTierConnector``.

Modules: ``connector`` (vLLM's hooks), ``plan`` (scheduler side: which blocks to load and store),
``steps`` (worker side: one step's loads and stores), ``identity`` (what names a block besides its
tokens), ``link`` (the daemon link: an absent cache is a miss). Only ``connector`` imports vLLM.
"""
