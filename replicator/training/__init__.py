"""What users *train* with: optimizers, layers, mixed precision, checkpoints, the loop.

Built on the public API (collectives from :mod:`replicator.core`, the
:class:`~replicator.Replicator`); nothing in the compiler depends on it.
"""
