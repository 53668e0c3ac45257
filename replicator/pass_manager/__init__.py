"""The pass infrastructure: the :class:`~replicator.pass_manager.contract.Pass` contract,
:class:`~replicator.pass_manager.manager.PassManager` (order checks, dumps, hooks for the
default passes and for translation validation) and the static graph checks
(:mod:`~replicator.pass_manager.verify`). It knows no concrete pass."""
