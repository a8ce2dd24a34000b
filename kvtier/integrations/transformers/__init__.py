"""Prefix reuse for transformers generation: ``cache.ConversationStore`` (restore and save a
conversation's KV), ``static.StaticPrefill`` (prefill over a preallocated KV buffer from CUDA
graphs), ``pool`` (a store's blocks as pages of its own pool), ``staged.StagedPrefill`` (that
prefill in layer groups), and two experimental variants, exact but measured slower than
``restore_into`` on an H100: ``overlap.LayerGroupStore`` (KV stored per layer group, restored
while the prefill runs) and ``race.RacedRestore`` (a slow load raced against the recompute).
Imports transformers.
"""
