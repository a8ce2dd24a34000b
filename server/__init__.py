"""The kvtier daemon: a gRPC front end (``kvtier.v1.KVTier``) over one in-process TierEngine.

``app.create_server`` builds the server; ``main.run`` is what ``kvtier serve`` runs.
"""
