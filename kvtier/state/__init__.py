"""What the movers stand on: the state of every page, pool and tier, owned in one place.

* ``table.py`` ``PageTable``: **the** state of every page (numpy columns) and the only writer of
  them, through verbs; its state codes are private;
* ``placement.py`` ``Placement``: the page table, pools, the open tiers of the chain, a policy
  per tier, the tenant ledger, and ``settle`` / ``unsettle`` / ``free_slots`` / ``release`` /
  ``drop`` / pins;
* ``pool.py`` ``Pool``: one attached engine's GPU slots, its tenant and its GPU-tier policy;
* ``events.py``: the page events a WatchEvents stream delivers;
* ``ready.py`` ``ReadyEvents``: when the engine's user last released pages on the GPU.

Nothing here imports ``kvtier.core`` or ``kvtier.moves``.
"""
