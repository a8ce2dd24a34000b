"""Moving pages between the tiers of the chain: the two-phase moves, in the order a page meets
them. Everything here runs under the engine lock and stands on ``kvtier.state.placement`` (the page
table, tiers, policies); nothing here imports the engine core, which composes these pieces.

    * ``starter.py`` ``Starter``: queues moves (``offload``, ``restore_cpu``, ``restore_below``,
      ``start_many``) in growing chunks, runs small urgent restores inline, takes queued moves
      back (``cancel``).
    * ``batch.py`` ``BulkMoves``: turns rows into ``Moves`` batches (``prepare``: out of the
      tier's policy, marked moving) and finishes them (``finish``: settle at the destination,
      or back at the source on failure).
    * ``demotion.py`` ``Cascade``: room in a tier below the GPU, by pushing its victims one
      step down the tier chain (or dropping them at the end of it); quotas apply.
    * ``completion.py`` ``Completion``: what the scheduler's lanes call when a batch is done.
    * ``frees.py`` ``Frees`` (source slots given back in bulk), ``landings.py`` ``Landings``
      (restores ended; the acquires waiting for them).
"""
