"""The pass infrastructure: the :class:`~replicator.pipeline.contract.Pass` contract,
:class:`~replicator.pipeline.pipeline.Pipeline` (order checks, dumps, hooks for the
default passes and for translation validation) and the static graph checks
(:mod:`~replicator.pipeline.verify`). It knows no concrete pass."""
