"""Prefix reuse for transformers generation: ``cache.ConversationStore`` (restore and save a
conversation's KV; ``restore_layered`` copies a borrowed prefix layer group by layer group,
``layered``), ``static.StaticPrefill`` (prefill over a preallocated KV buffer from CUDA graphs),
``staged.StagedPrefill`` (that prefill in layer groups, each waiting for its own group), ``pool``
(a store's blocks as pages of its own pool), and two experimental variants, exact but measured
slower on an H100: ``overlap.LayerGroupStore`` (KV stored per layer group under keys of its own)
and ``race.RacedRestore`` (a slow load raced against the recompute). ``identity`` names the model
behind a store's keys (config and weights' fingerprint), ``staging`` is the pool a store copies
through, ``tokens`` takes token ids as callers give them. Imports transformers.
"""
