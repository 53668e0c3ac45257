"""Errors raised by replicator; every message says what was wrong and the fix."""

from __future__ import annotations

__all__ = [
    "DivergentControlFlowError",
    "DivergentStateError",
    "InputExhausted",
    "MiscompileError",
    "PassError",
    "UnanalyzableStepError",
    "ReplicationError",
]


class ReplicationError(ValueError):
    """A replicated step that cannot be run correctly on every replica."""


class DivergentControlFlowError(ReplicationError):
    """A collective under a condition that may differ between replicas."""


class DivergentStateError(ReplicationError):
    """A state leaf that would stop being identical on every replica."""


class PassError(RuntimeError):
    """A rewrite pass failed; the message names it and the passes before it."""


class InputExhausted(Exception):
    """The ``input_fn`` of a worker has no more batches; catch it to end a loop.

    An ordinary exception, not a ``StopIteration``: Python turns a
    ``StopIteration`` raised inside a generator into a ``RuntimeError``
    (PEP 479), so a generator that calls ``Replicator.run`` (or an
    ``input_fn`` that draws from one) would lose it. Catch it with
    ``except rp.InputExhausted``.
    """


class UnanalyzableStepError(ReplicationError):
    """A cross-replica operation where the analysis cannot prove it is safe."""


class MiscompileError(ReplicationError):
    """Translation validation found a pass that changed what the step computes."""
