"""What users *train* with: optimizers, layers, mixed precision, checkpoints.

Built on the collectives of :mod:`replicator.core`; nothing in the compiler depends on
it. The training loop that drives a :class:`~replicator.Replicator` sits above it, in
:mod:`replicator.loop`.
"""
