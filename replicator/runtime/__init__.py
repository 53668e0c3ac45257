"""How a step *runs*: the device mesh, inputs, execution, state placement, processes.

Takes the lowered graph from :mod:`replicator.passes` and runs it under
``jit(shard_map(...))`` on the local devices, or on every process of a
multi-host job (:mod:`replicator.runtime.distributed`, the worker side; the
supervisor that starts the workers is :mod:`replicator.launch`).
"""
