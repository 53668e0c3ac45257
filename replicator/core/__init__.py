"""What a step *is*: the replica context, the placeholder primitives, tracing, the step graph.

Nothing here runs anything: ``trace_step`` turns ``step_fn`` into a
:class:`~replicator.core.graph.StepGraph` whose cross-replica calls are
placeholders, which :mod:`replicator.passes` then rewrites.
"""
