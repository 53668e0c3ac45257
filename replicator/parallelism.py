"""How a :class:`~replicator.Replicator` splits its devices between the axes of parallelism.

One value instead of a growing list of constructor keywords: the tensor axis (a model's matrices
split over ``T`` devices, :mod:`replicator.tensor`), pipeline stages (:mod:`replicator.stages`)
and folding (several replicas per device). The data-parallel replicas are what is left:
``num_workers * cores_per_worker / (stages * tensor)``.

>>> par = Parallelism(tensor=2, tensor_plan={"*/fc1/kernel": "column", "*/fc2/kernel": "row"})
>>> par.tensor, par.stages
(2, 1)
>>> Parallelism(tensor=0)
Traceback (most recent call last):
...
ValueError: Parallelism(tensor=0): the tensor degree must be a positive int (1: no tensor axis).

Promises:

1. Every field is checked when the value is made: a degree that is not a positive int, a tensor
   degree above 1 without a plan, a plan given without a tensor degree, and an unknown schedule
   are each a ``ValueError`` naming the field and the fix
   (``tests/tensor/test_replicator.py::test_a_parallelism_value_is_checked_when_made``).
2. ``Replicator(..., parallelism=p)`` runs as the old keywords with the same values would
   (``pipeline_stages``, ``microbatches``, ``schedule``, ``pipeline_recompute``,
   ``replicas_per_device``); giving both is a ``ValueError``
   (``tests/tensor/test_replicator.py::test_the_old_keywords_and_parallelism_are_one_setting``).
   The old keywords are deprecated: given other than their defaults, they warn
   ``DeprecationWarning`` naming the ``Parallelism`` that says the same.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from replicator.tensor.auto import Auto, as_plan
from replicator.tensor.plan import TensorPlan

__all__ = ["OLDER_KEYWORDS", "Parallelism", "check_tensor_supported", "older_keywords", "warn_older_keywords"]

SCHEDULES = ("1f1b", "gpipe", "1f1b-fused")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The axes a Replicator's devices are split between (the data axis takes the rest).

    Attributes:
      tensor: ``T``, the devices each replica's planned matrices are split over (the ``'tensor'``
        mesh axis, innermost: ``T`` consecutive devices of one worker). ``1``: none.
      tensor_plan: which state leaves are split and how: a :class:`~replicator.tensor.TensorPlan`
        or its mapping of path globs to ``"column"``, ``"row"``, ``"replicated"`` or a dimension
        (``"blocks/*/mlp/fc1/kernel": "column"``). Leaves it does not name are whole on every
        device, except an optimizer's moments, which follow their parameter. ``"auto"`` (or a
        :class:`replicator.tensor.auto.Auto`): chosen by the cost model when the step is first traced.
      memory_budget: with ``tensor_plan="auto"``, the bytes of state (parameters and optimizer state,
        not activations) one device may hold; ``None``: no budget (the least predicted step time).
      allow_gather: let the rewrite gather a split value whole where a consumer needs it (each
        gather is listed by ``explain``); otherwise such a plan is refused at trace time.
      sequence_parallel: Megatron's sequence parallelism: the dimension of the activations that is
        their sequence (``1`` for ``(batch, sequence, hidden)``). Between the tensor-parallel
        regions activations are split on it: each all-reduce of a block becomes a reduce-scatter
        there, and an all-gather of the activation before the next column-parallel matmul (weights
        are never gathered). ``None``: off.
      collective_matmul: an all-gather feeding a matmul, and a matmul whose output is reduce-scattered
        (sequence parallelism's, where the dimension gathered or scattered is a free one of the
        product), each become a ring of ``T`` partial matmuls and ``ppermute`` in the graph
        (:mod:`replicator.tensor.overlap`); ``explain`` lists them as ``ring all-gather matmul`` and
        ``ring matmul reduce-scatter``. Not with ``stages``: a stage's programs run in a branch taken by
        that stage's devices only, and a ring's ``ppermute`` there would wait for every device (a hang).
        With ``tensor_plan="auto"`` the cost model chooses the rings where this is ``False``.
      stages: pipeline stages, cut at ``rp.stage_boundary`` markers (docs/guide/pipeline.md).
      microbatches: the micro-batches of a pipelined step (default: ``stages``).
      schedule: ``'1f1b'`` (default), ``'gpipe'`` or ``'1f1b-fused'``.
      recompute: run each stage's forward again before its backward instead of keeping it.
      replicas_per_device: fold this many consecutive replicas onto each device.
    """

    tensor: int = 1
    tensor_plan: TensorPlan | Auto | Mapping[str, Any] | str | None = None
    allow_gather: bool = False
    sequence_parallel: int | None = None
    stages: int = 1
    microbatches: int | None = None
    schedule: str | None = None
    recompute: bool = False
    replicas_per_device: int = 1
    memory_budget: int | None = None
    collective_matmul: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor", "stages", "replicas_per_device"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"Parallelism({name}={value!r}): the {name.replace('_', ' ')} degree must be a positive "
                    f"int (1: no {'tensor axis' if name == 'tensor' else 'split'})."
                    if name != "replicas_per_device"
                    else f"Parallelism(replicas_per_device={value!r}): must be a positive int (1: no folding)."
                )
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"Parallelism(microbatches={self.microbatches!r}): must be a positive int or None.")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"Parallelism(schedule={self.schedule!r}): must be one of {', '.join(SCHEDULES)}.")
        if self.tensor > 1 and self.tensor_plan is None:
            raise ValueError(
                f"Parallelism(tensor={self.tensor}) needs a tensor_plan: which parameters to split, e.g. "
                "tensor_plan={'*/fc1/kernel': 'column', '*/fc2/kernel': 'row'} (docs/guide/tensor.md)."
            )
        if self.sequence_parallel is not None and (
            isinstance(self.sequence_parallel, bool) or not isinstance(self.sequence_parallel, int)
        ):
            raise ValueError(
                f"Parallelism(sequence_parallel={self.sequence_parallel!r}): give the activations' sequence "
                "dimension (1 for (batch, sequence, hidden)), or None for off."
            )
        if self.tensor == 1 and self.sequence_parallel is not None:
            raise ValueError(
                "Parallelism(sequence_parallel=...) splits activations over the tensor axis: give tensor=T."
            )
        if not isinstance(self.collective_matmul, bool):
            raise ValueError(f"Parallelism(collective_matmul={self.collective_matmul!r}): must be True or False.")
        if self.tensor == 1 and self.collective_matmul:
            raise ValueError(
                "Parallelism(collective_matmul=True) rewrites the matmuls split over the tensor axis: give tensor=T "
                "(and sequence_parallel=d, whose all-gathers and reduce-scatters it rings)."
            )
        if self.tensor == 1 and self.tensor_plan is not None:
            raise ValueError(
                "Parallelism(tensor_plan=...) without tensor=T: give the degree the plan splits over, e.g. tensor=2."
            )
        if self.tensor_plan is not None:
            object.__setattr__(self, "tensor_plan", as_plan(self.tensor_plan, self.memory_budget))
        elif self.memory_budget is not None:
            raise ValueError("Parallelism(memory_budget=...) is the budget of tensor_plan='auto': give tensor=T too.")


#: ``Replicator``'s older keywords -> the :class:`Parallelism` field each spells, with the keyword's default.
OLDER_KEYWORDS: dict[str, tuple[str, Any]] = {
    "pipeline_stages": ("stages", 1),
    "microbatches": ("microbatches", None),
    "schedule": ("schedule", None),
    "pipeline_recompute": ("recompute", False),
    "replicas_per_device": ("replicas_per_device", 1),
}


def warn_older_keywords(*, stacklevel: int = 3, **given: Any) -> None:
    """A ``DeprecationWarning`` (attributed to the ``Replicator(...)`` call: ``stacklevel`` as for
    ``warnings.warn`` called here) for the older keywords given other than their defaults, naming the
    ``parallelism=rp.Parallelism(...)`` that says the same.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_older_keywords(pipeline_stages=2, microbatches=4, schedule=None)
    >>> print(caught[0].message)
    Replicator(pipeline_stages=..., microbatches=...) is deprecated: write parallelism=rp.Parallelism(stages=2, microbatches=4) (the same behaviour).
    """
    old = {name: value for name, value in given.items() if value != OLDER_KEYWORDS[name][1]}
    if old:
        fields = ", ".join(f"{OLDER_KEYWORDS[name][0]}={value!r}" for name, value in old.items())
        warnings.warn(
            f"Replicator({', '.join(f'{name}=...' for name in old)}) is deprecated: write "
            f"parallelism=rp.Parallelism({fields}) (the same behaviour).",
            DeprecationWarning,
            stacklevel=stacklevel,
        )


def older_keywords(parallelism: Parallelism | None, **given: Any) -> dict[str, Any]:
    """The values of ``Replicator``'s older keywords (:data:`OLDER_KEYWORDS`; those not ``given`` at their
    defaults): as given without ``parallelism`` (deprecated: a ``DeprecationWarning`` attributed to the
    caller's caller, the ``Replicator(...)`` line, for those given other than their defaults), else
    ``parallelism``'s, refusing a keyword given beside it.

    >>> older_keywords(Parallelism(stages=2))["pipeline_stages"]
    2
    """
    unknown = sorted(set(given) - set(OLDER_KEYWORDS))
    if unknown:
        raise TypeError(f"older_keywords: {unknown} are not older keywords of Replicator ({list(OLDER_KEYWORDS)}).")
    given = {name: given.get(name, default) for name, (_, default) in OLDER_KEYWORDS.items()}
    if parallelism is None:
        warn_older_keywords(stacklevel=4, **given)
        return given
    if not isinstance(parallelism, Parallelism):
        raise TypeError(f"parallelism= must be a replicator.Parallelism, got {type(parallelism).__name__}.")
    both = [name for name, value in given.items() if value != OLDER_KEYWORDS[name][1]]
    if both:
        raise ValueError(
            f"Replicator: {', '.join(both)} and parallelism= both say how to split the devices: put everything in "
            "parallelism= (Parallelism(stages=..., microbatches=..., schedule=..., recompute=..., "
            "replicas_per_device=...))."
        )
    return {name: getattr(parallelism, field) for name, (field, _) in OLDER_KEYWORDS.items()}


def check_tensor_supported(parallelism: Parallelism) -> None:
    """Refuse, with what to do instead, what the tensor axis does not combine with yet."""
    not_yet = [
        name
        for name, on in (
            (
                f"collective_matmul with stages={parallelism.stages}",
                parallelism.collective_matmul and parallelism.stages > 1,
            ),
        )
        if on
    ]
    if not_yet:
        raise ValueError(
            f"Parallelism(tensor={parallelism.tensor}) does not combine with {' and '.join(not_yet)} yet.\n"
            "Fix: leave it out, or run without the tensor axis (docs/guide/tensor.md says what combines today)."
        )
