"""Prefix reuse for transformers generation: ``cache.ConversationStore`` (restore and save a
conversation's KV), ``static.StaticPrefill`` (prefill over a preallocated KV buffer from CUDA
graphs) and ``pool`` (a store's blocks as pages of its own pool). Imports transformers.
"""
