"""Input pipelines: one ``input_fn(ctx)`` per worker, batches split over cores.

``input_fn`` is called once per worker with an :class:`InputContext` and
returns an iterable of that worker's batches (pytrees of arrays). Every leaf's
leading axis is split over the worker's cores in order: core ``c`` of worker
``w`` (replica ``w * cores_per_worker + c``) gets rows
``[c * B/C, (c + 1) * B/C)`` of a leaf of ``B`` rows in worker ``w``'s batch.
Leaves may have different numbers of rows (``B`` of one, ``C`` of another: one
entry per replica, such as a PRNG key each), as long as each divides evenly.

The iterators of an ``input_fn`` live as long as the function itself
(:class:`InputRegistry`): a function made for one call and dropped takes its
iterators with it.

Promises:

1. ``InputContext`` numbers this worker's replicas ``w * C .. w * C + C - 1`` and answers to the
   ``tf.distribute`` names (its doctest, tests/test_docs.py::test_docstring_examples_run;
   tests/test_inputs.py::test_the_tf_distribute_names_of_an_input_context_are_numbers,
   tests/test_run.py::TestSemantics::test_input_context); a global batch size that the replicas do not divide
   is a ``ValueError``, not a floored size
   (tests/test_inputs.py::test_a_worker_batch_that_divides_by_the_workers_but_not_the_replicas_is_refused).
2. Replica ``w * C + c`` gets rows ``[c * B/C, (c + 1) * B/C)`` of each leaf of worker ``w``'s batch
   (tests/test_run.py::TestSemantics::test_without_state_outputs_are_stacked_in_replica_order); leaves with
   other numbers of rows (one per replica next to many) are each split the same way
   (tests/test_porting_inputs.py::test_one_typed_key_per_replica_next_to_rows_given_as_a_batch).
3. A leaf of any numeric or boolean dtype, narrow ones too (bool, int8, float16, bfloat16), is accepted exactly
   when it has rows and they split evenly over the cores; otherwise a ``ValueError`` names the worker and the
   leaf (tests/test_inputs.py::test_a_leaf_is_accepted_exactly_when_it_has_rows_that_split_evenly_over_the_cores,
   tests/test_bad_input.py::test_a_batch_with_no_rows_is_an_error,
   tests/test_run.py::TestBadInput::test_a_leaf_whose_rows_do_not_divide_is_named).
4. A batch with no leaves, a 0-d leaf, a Python list of numbers, a leaf of strings or one NumPy cannot convert is
   refused, naming the leaf (tests/test_inputs.py::test_an_empty_batch_and_a_string_leaf_are_refused,
   tests/test_run.py::TestBadInput::test_scalar_batch_leaf,
   tests/test_bad_input.py::test_a_list_in_the_batch_is_named_as_the_culprit,
   tests/test_run.py::TestBadInput::test_non_numeric_batch_leaf,
   tests/test_inputs_unconvertible_leaves.py::test_a_leaf_numpy_cannot_convert_is_a_type_error_naming_the_leaf_and_why).
5. A batch given to ``run`` is split over this process's local workers in order, as views; with one local worker
   it is the batch itself; rows that the process's replicas do not divide are a ``ValueError``
   (tests/test_inputs.py::test_a_process_batch_is_split_over_its_local_workers_in_order_as_views,
   tests/test_inputs_per_call.py::TestGivenDirectly::test_a_batch_is_split_over_the_replicas_in_order,
   tests/test_inputs_per_call.py::TestGivenDirectly::test_rows_not_divisible_by_the_replicas_of_the_process_are_named).
6. An ``input_fn`` that is not callable, or returns no iterable, is a ``TypeError`` that says what to pass
   (tests/test_run.py::TestBadInput::test_input_fn_must_be_callable_returning_iterable).
7. Batch signatures are equal exactly when the structure and each leaf's per-replica shape and dtype are
   (tests/test_inputs.py::test_batch_signatures_of_different_batches_are_equal_when_shapes_and_dtypes_are).
8. Workers whose batches differ in structure are a ``ValueError``, at the first step or a later one
   (tests/test_inputs.py::test_workers_yielding_batches_of_different_structures_is_an_error,
   tests/test_inputs.py::test_a_later_step_where_one_worker_changes_structure_is_an_error_on_a_fresh_replicator);
   a ``jax.ShapeDtypeStruct`` leaf given to ``run`` is a ``TypeError``
   (tests/test_host_path.py::test_a_shape_dtype_struct_batch_leaf_given_to_run_is_a_clear_error).
9. A batch of NumPy or JAX arrays is checked once per signature (a batch of other leaves every time), and the
   checker remembers at most ``MAX_CHECKED_SIGNATURES`` signatures
   (tests/test_inputs.py::test_a_batch_signature_is_checked_once_and_the_checker_remembers_a_bounded_number).
10. A worker's iterator that ends is ``InputExhausted`` naming that worker and the batches drawn, and stays so
    (tests/test_run.py::TestSemantics::test_input_fn_is_continued_across_calls,
    tests/test_run.py::TestSemantics::test_input_exhausted_propagates_out_of_generators); an ``InputExhausted``
    the iterator raises itself passes unchanged
    (tests/test_inputs.py::test_the_worker_whose_iterator_ended_is_named_and_an_input_exhausted_of_its_own_passes_unchanged).
11. A batch drawn ahead (prefetch) whose draw failed raises its error, or its batch's check error, at its own
    step, and the end of the input at the step after the last batch; steps count only batches taken
    (tests/test_prefetch.py::test_an_error_of_input_fn_is_raised_by_the_step_whose_batch_it_was_drawing,
    tests/test_prefetch.py::test_a_bad_batch_is_reported_at_its_step_with_the_same_message,
    tests/test_prefetch.py::test_exhaustion_is_raised_at_the_step_after_the_last_batch,
    tests/test_prefetch.py::test_the_trainer_counts_only_batches_steps_took_and_resumes_exactly).
12. An ``input_fn`` is continued across calls for as long as it lives (a bound method for as long as its
    object), and ``forget_input`` starts it over, prefetched batches dropped
    (tests/test_run.py::TestSemantics::test_input_fn_is_continued_across_calls,
    tests/test_inputs_per_call.py::test_a_function_held_by_the_caller_is_continued_a_bound_method_too,
    tests/test_run.py::TestSemantics::test_forget_input_starts_over,
    tests/test_prefetch.py::test_forget_input_drops_the_prefetched_batch); functions of one factory each continue
    their own data (tests/test_inputs_registry.py::test_input_functions_made_by_one_factory_each_continue_their_own_data).
13. The iterators of a dropped ``input_fn`` (a generator function made on every call too) are not kept
    (tests/test_inputs_per_call.py::test_iterators_of_input_functions_that_no_longer_exist_are_not_kept,
    tests/test_inputs_per_call.py::test_a_generator_function_made_every_call_is_not_kept), and the registry
    remembers at most ``MAX_LINEAGES`` pieces of code
    (tests/test_inputs_registry.py::test_the_input_registry_remembers_1024_pieces_of_code_then_starts_over).
14. A new ``input_fn`` on every call warns once, at the third call in a row that each ran one step, naming
    the call site and the fix; one per epoch does not warn
    (tests/test_inputs.py::test_a_new_input_function_every_call_warns_at_the_third_call,
    tests/test_inputs_per_call.py::test_a_new_input_function_every_call_warns_once_naming_the_call_site_and_the_fix,
    tests/test_inputs_per_call.py::test_a_new_input_function_per_epoch_does_not_warn).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import operator
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from replicator.core.tracing import leaf_signature
from replicator.errors import InputExhausted

__all__ = [
    "Batch",
    "BatchChecker",
    "BatchSignature",
    "InputContext",
    "InputRegistry",
    "WorkerInputs",
    "check_input_fn",
    "check_worker_batch",
    "split_process_batch",
]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an ``input_fn`` needs to know to read its worker's share of data.

    There is one input pipeline per worker (as in TF-Replicator): ``input_fn``
    is called once per worker and reads shard ``worker_id`` of
    ``num_workers``. The ``tf.distribute.InputContext`` names
    ``input_pipeline_id`` and ``num_input_pipelines`` equal them.

    >>> ctx = rp.InputContext(num_workers=2, worker_id=1, cores_per_worker=4)
    >>> ctx.num_input_pipelines, ctx.input_pipeline_id, list(ctx.replica_ids)
    (2, 1, [4, 5, 6, 7])
    >>> ctx.worker_batch_size(64), ctx.get_per_replica_batch_size(64)
    (32, 8)

    Attributes:
      num_workers: workers in the job (input pipelines).
      worker_id: this worker, ``0 <= worker_id < num_workers``.
      cores_per_worker: replicas per worker; this worker's batch is split
        over them along the leading axis.
      num_replicas: ``num_workers * cores_per_worker``.
      num_input_pipelines: ``num_workers`` (``tf.distribute`` name).
      input_pipeline_id: ``worker_id`` (``tf.distribute`` name).
    """

    num_workers: int
    worker_id: int
    cores_per_worker: int

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.cores_per_worker

    @property
    def replica_ids(self) -> range:
        """Replica ids fed by this worker, in the order its batch is split."""
        start = self.worker_id * self.cores_per_worker
        return range(start, start + self.cores_per_worker)

    # tf.distribute.InputContext names, for users coming from TF-Replicator: one pipeline per worker.
    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines: one per worker, so ``num_workers``."""
        return self.num_workers

    @property
    def input_pipeline_id(self) -> int:
        """This input pipeline, ``0 <= input_pipeline_id < num_input_pipelines``: ``worker_id``."""
        return self.worker_id

    def worker_batch_size(self, global_batch_size: int) -> int:
        """This worker's share of a global batch (must divide evenly)."""
        if global_batch_size % self.num_replicas:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas} replicas; use a multiple of {self.num_replicas}."
            )
        return global_batch_size // self.num_workers

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Rows each replica sees (``tf.distribute`` name)."""
        return self.worker_batch_size(global_batch_size) // self.cores_per_worker


def check_worker_batch(batch: PyTree, cores_per_worker: int, worker_id: int) -> list[np.ndarray | jax.Array]:
    """Validate one worker's batch; return its leaves.

    Raises a clear error for leaves that are not numeric arrays, leaves without
    a leading axis or with no rows, and a leaf whose leading size is not
    divisible by the cores. Leaves may have different leading sizes: each is
    split evenly over the cores (a leaf with one row per replica, e.g. a PRNG
    key each, next to leaves with many).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise ValueError(f"input_fn of worker {worker_id} yielded an empty batch {batch!r}; yield a pytree of arrays.")
    leaves = []
    for path, leaf in flat:
        name = "batch" + jax.tree_util.keystr(path)
        if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            try:
                leaf = np.asarray(leaf)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"{name} is a {type(leaf).__name__}, not an array.") from e
            if not (jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_):
                raise TypeError(
                    f"{name} is not a numeric array (dtype {leaf.dtype}); yield arrays of numbers or booleans."
                )
        if leaf.ndim == 0 and any(isinstance(k, jax.tree_util.SequenceKey) for k in path):
            first = next(i for i, k in enumerate(path) if isinstance(k, jax.tree_util.SequenceKey))
            container = "batch" + jax.tree_util.keystr(path[:first])
            raise ValueError(
                f"{container} is a Python list or tuple of numbers, so each number became a separate leaf "
                f"({name} is a scalar). Make it an array in input_fn, e.g. with np.asarray."
            )
        if leaf.ndim == 0:
            raise ValueError(
                f"{name} is a scalar, but every batch leaf is split along its leading axis over "
                f"the {cores_per_worker} cores of a worker; give it a leading batch axis."
            )
        rows = leaf.shape[0]
        if rows == 0:
            raise ValueError(
                f"worker {worker_id}'s batch has 0 rows ({name} has shape {leaf.shape}); every "
                f"replica needs at least one row (means over no rows are NaN). Skip empty batches in input_fn."
            )
        if rows % cores_per_worker:
            raise ValueError(
                f"worker {worker_id}'s batch leaf {name} has {rows} rows, not divisible by cores_per_worker="
                f"{cores_per_worker}; every leaf is split evenly over the cores: give it a multiple of "
                f"{cores_per_worker} rows (e.g. {max(cores_per_worker, rows - rows % cores_per_worker)}), or one "
                f"row per replica ({cores_per_worker})."
            )
        leaves.append(leaf)
    return leaves


def split_process_batch(batch: PyTree, contexts: list[InputContext]) -> list[PyTree]:
    """One step's batch of this process, as ``Replicator.run`` takes it directly: one batch per local worker.

    With one local worker (the usual) that is ``[batch]``; with ``W`` local workers every leaf's rows are
    split into ``W`` equal parts in order (views, no copy), so that replica ``r`` of this process gets the
    ``r``-th of ``W x C`` equal parts of each leaf.
    """
    if len(contexts) == 1:
        return [batch]
    workers, cores = len(contexts), contexts[0].cores_per_worker
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    parts: list[list[Any]] = [[] for _ in contexts]
    for path, leaf in flat:
        rows = np.shape(leaf)[0] if np.ndim(leaf) else None
        if rows is not None and rows % (workers * cores):
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has {rows} rows, not divisible by the {workers * cores} "
                f"replicas of this process ({workers} workers x {cores} cores), over which a batch given to run "
                f"is split; give it a multiple of {workers * cores} rows."
            )
        for w in range(workers):  # a scalar or empty leaf goes to every worker, whose checks name it
            parts[w].append(leaf if not rows else leaf[w * rows // workers : (w + 1) * rows // workers])
    return [treedef.unflatten(p) for p in parts]


def check_input_fn(input_fn: object) -> None:
    if not callable(input_fn):
        raise TypeError(
            f"input_fn must be a callable taking an InputContext and returning an iterable of "
            f"batches, got {type(input_fn).__name__}."
        )


class BatchSignature:
    """What the compiled step depends on in a batch: its tree structure and each leaf's per-replica shape
    and canonical dtype. Its hash is computed once (it is part of the compile-cache key of every step).

    Attributes:
      treedef: the batch's tree structure.
      replica_leaves: ``(shape, dtype)`` of each leaf's per-replica slice, in tree order.
      nbytes: bytes of the batch of every local worker together (0 when unknown).
    """

    __slots__ = ("_hash", "nbytes", "replica_leaves", "treedef")

    def __init__(self, treedef: Any, replica_leaves: tuple, nbytes: int = 0):
        self.treedef, self.replica_leaves, self.nbytes = treedef, replica_leaves, nbytes
        self._hash = hash((treedef, replica_leaves))

    @classmethod
    def of(cls, batch: PyTree, cores_per_worker: int, nbytes: int = 0) -> BatchSignature:
        """The signature of one worker's ``batch`` (arrays or ``jax.ShapeDtypeStruct``)."""
        leaves, treedef = jax.tree.flatten(batch)
        replica_leaves = []
        for leaf in leaves:
            shape, dtype = leaf_signature(leaf)
            replica_leaves.append(((shape[0] // cores_per_worker, *shape[1:]), dtype))
        return cls(treedef, tuple(replica_leaves), nbytes)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, BatchSignature)
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.replica_leaves == other.replica_leaves
        )

    def __repr__(self) -> str:
        return f"BatchSignature({self.treedef}, {self.replica_leaves})"


#: Batch signatures a :class:`BatchChecker` remembers (it starts over when full).
MAX_CHECKED_SIGNATURES = 1024


def _fast_leaf(x: Any) -> bool:
    return type(x) is np.ndarray or isinstance(x, jax.Array)


#: The types of leaves found to be :func:`_fast_leaf`: a batch of only these is checked without a Python call
#: per leaf (it grows by the JAX array types met).
_FAST_TYPES: set[type] = {np.ndarray}
#: ``(shape, dtype)`` of an array, in C.
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


def _all_fast(leaves: list[Any]) -> bool:
    """Whether every leaf is a NumPy or JAX array (:func:`_fast_leaf`); a set of types seen before is answered
    without looking at each leaf in Python."""
    types = set(map(type, leaves))
    if types <= _FAST_TYPES:
        return True
    if all(map(_fast_leaf, leaves)):
        _FAST_TYPES.update(types)
        return True
    return False


class BatchChecker:
    """The checks of a step's batches (:func:`check_worker_batch`, the same structure on every worker),
    run once per batch signature.

    Every check depends only on the tree structure and on each leaf's type, shape and dtype, so a batch of
    NumPy or JAX arrays whose structure, shapes and dtypes were checked before (on every local worker alike)
    is not checked again. Any other batch is checked in full every time.
    """

    def __init__(self, cores_per_worker: int):
        self.cores_per_worker = cores_per_worker
        self._known: dict[tuple, BatchSignature] = {}

    def check(self, batches: list[PyTree], contexts: list[InputContext]) -> tuple[BatchSignature, list[list[Any]]]:
        """``(signature, leaves of each worker)`` of one batch per local worker, or the error of the first
        check that fails (the same error, in the same order, as checking every time)."""
        if len(batches) == 1:  # one local worker (the usual): the shortest path, no Python call per leaf
            leaves, treedef = jax.tree_util.tree_flatten(batches[0])
            if set(map(type, leaves)) <= _FAST_TYPES or _all_fast(leaves):
                known = self._known.get((treedef, tuple(map(_SHAPE_DTYPE, leaves))))
                if known is not None:
                    return known, [leaves]
        flat = [jax.tree.flatten(b) for b in batches]
        raw = _raw_signature(*flat[0])
        if raw is not None and all(_raw_signature(*f) == raw for f in flat[1:]):
            known = self._known.get(raw)
            if known is not None:
                return known, [leaves for leaves, _ in flat]
        structures = {jax.tree.structure(b) for b in batches}
        if len(structures) > 1:
            raise ValueError(f"workers yielded batches of different structures: {structures}.")
        for (leaves, _), ctx in zip(flat, contexts, strict=True):
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, jax.ShapeDtypeStruct):
                    raise TypeError(
                        f"batch leaf {i} of worker {ctx.worker_id} is a jax.ShapeDtypeStruct {leaf.shape} "
                        f"{leaf.dtype}: run needs the data. A ShapeDtypeStruct describes a batch for "
                        "Replicator.lower or explain, which trace without running."
                    )
        worker_leaves = [
            check_worker_batch(b, self.cores_per_worker, ctx.worker_id)
            for b, ctx in zip(batches, contexts, strict=True)
        ]
        nbytes = sum(int(getattr(leaf, "nbytes", 0)) for leaves in worker_leaves for leaf in leaves)
        signature = BatchSignature.of(batches[0], self.cores_per_worker, nbytes)
        if raw is not None and all(_raw_signature(*f) == raw for f in flat[1:]):
            if len(self._known) >= MAX_CHECKED_SIGNATURES:
                self._known.clear()
            self._known[raw] = signature
        return signature, worker_leaves


def _raw_signature(leaves: list[Any], treedef: Any) -> tuple | None:
    """``(treedef, (shape, dtype) of each leaf)`` if every leaf is a NumPy or JAX array, else None."""
    if not _all_fast(leaves):
        return None
    return (treedef, tuple(map(_SHAPE_DTYPE, leaves)))


@dataclasses.dataclass(eq=False)
class Batch:
    """One step's batch: what every local worker's iterator gave, checked and placed when it is known.

    A batch drawn ahead of its step (prefetched) whose draw failed holds the ``error`` to raise at its step.
    """

    batches: list[PyTree] | None
    error: Exception | None = None
    signature: BatchSignature | None = None
    leaves: list[list[Any]] | None = None
    placed: list[jax.Array] | None = None


class WorkerInputs:
    """The live iterators of one ``input_fn``, one per local worker, and its batches drawn ahead.

    Attributes:
      steps: batches drawn from every iterator so far (prefetched ones included).
      taken: batches steps have taken so far (prefetched ones not included).
      pending: batches drawn ahead of their step, oldest first.
    """

    def __init__(self, input_fn: Callable[[InputContext], Any], contexts: list[InputContext]):
        check_input_fn(input_fn)
        self.contexts = contexts
        self.iterators: list[Iterator] = []
        for ctx in contexts:
            iterable = input_fn(ctx)
            try:
                self.iterators.append(iter(iterable))
            except TypeError as e:
                raise TypeError(
                    f"input_fn(ctx) must return an iterable of batches (e.g. a generator), got "
                    f"{type(iterable).__name__}."
                ) from e
        self.steps = 0
        self.taken = 0
        self.pending: collections.deque[Batch] = collections.deque()

    def take(self) -> Batch:
        """The next step's batch: the oldest prefetched one (raising its draw's error), or one drawn now."""
        if self.pending:
            batch = self.pending.popleft()
            if batch.error is not None:
                error, batch.error = batch.error, None
                raise error
        else:
            batch = Batch(self.next_batches())
        self.taken += 1
        return batch

    def draw_ahead(self) -> Batch:
        """Draw the batch of a later step now; an error of ``input_fn`` is kept for that step."""
        try:
            batch = Batch(self.next_batches())
        except Exception as e:  # noqa: BLE001 - raised again, unchanged, by take()
            batch = Batch(None, error=e)
        self.pending.append(batch)
        return batch

    def next_batches(self) -> list[PyTree]:
        """One batch from every local worker, in worker order.

        Raises:
          InputExhausted: a worker's iterator ended (an ``InputExhausted``
            raised by the iterator itself passes through unchanged).
        """
        batches = []
        for ctx, it in zip(self.contexts, self.iterators, strict=True):
            try:
                batches.append(next(it))
            except StopIteration:
                raise self.exhausted(ctx) from None
        self.steps += 1
        return batches

    def exhausted(self, ctx: InputContext) -> InputExhausted:
        """The error for worker ``ctx``'s iterator having ended."""
        return InputExhausted(
            f"input_fn of worker {ctx.worker_id} is exhausted after {self.steps} batches. "
            f"Stop the loop there (catch replicator.InputExhausted), make input_fn yield more "
            f"(e.g. loop over epochs), or pass a fresh input_fn to start over."
        )


def _code_of(fn: Any) -> Any:
    """The code object a function (or a ``functools.partial`` of one) runs, or None."""
    return getattr(fn, "__code__", None) or getattr(getattr(fn, "func", None), "__code__", None)


def _weak_key(fn: Any, callback: Callable | None = None) -> Any:
    """A weak reference keying ``fn``, or ``fn`` itself if it takes none.

    A bound method is a new object at every attribute access (``run(step, loader.batches)``): it is keyed by
    its object and function (``weakref.WeakMethod``), alive as long as the object.
    """
    try:
        if type(fn) is types.MethodType:
            return weakref.WeakMethod(fn, callback)
        return weakref.ref(fn, callback)
    except TypeError:
        return fn


class _Lineage:
    """The input functions made from one piece of code (one ``def`` or ``lambda``), newest last."""

    __slots__ = ("last", "last_taken", "one_step_in_a_row")

    def __init__(self) -> None:
        self.last: weakref.ref | None = None  # the newest one's WorkerInputs
        self.last_taken: int | None = None  # its batches taken, saved when it was dropped
        self.one_step_in_a_row = 0  # functions in a row, before the newest, that ran one step each

    def taken(self) -> int | None:
        inputs = self.last() if self.last is not None else None
        return inputs.taken if inputs is not None else self.last_taken


#: Lineages an :class:`InputRegistry` remembers (it starts over when full).
MAX_LINEAGES = 1024


class InputRegistry:
    """The live iterators (:class:`WorkerInputs`) of every ``input_fn`` a Replicator has run.

    Each is held only as long as its ``input_fn``: the registry refers to the function weakly, so a function
    made for one call and dropped (``run(step, lambda ctx: gen(), state)`` in a loop) takes its iterators and
    prefetched batches with it. A callable that takes no weak reference is held for good. A generator
    function's own generators refer to the function: when a new function of the same code starts, an older
    one that nothing but its generators holds any more is dropped too.

    It also counts, for each piece of code, how many new functions in a row each ran a single step: the sign
    of an input function made anew on every call, whose data starts over at every step.
    """

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[WorkerInputs, Any]] = {}  # weak key -> (inputs, code)
        self._lineages: dict[Any, _Lineage] = {}

    def get(self, input_fn: Callable) -> WorkerInputs | None:
        # A plain function (the usual, looked up at every step) takes a weak reference: no call to _weak_key.
        key = weakref.ref(input_fn) if type(input_fn) is types.FunctionType else _weak_key(input_fn)
        entry = self._entries.get(key)
        return entry[0] if entry is not None else None

    def __contains__(self, input_fn: Callable) -> bool:
        return _weak_key(input_fn) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def forget(self, input_fn: Callable) -> None:
        self._drop(_weak_key(input_fn))

    def start(self, input_fn: Callable, contexts: list[InputContext]) -> tuple[WorkerInputs, int]:
        """New iterators of ``input_fn``; returns them with the number of functions of the same code in a row,
        before this one, that each ran one step (0 if there are none or ``input_fn`` has no code)."""
        code = _code_of(input_fn)
        inputs = WorkerInputs(input_fn, contexts)
        in_a_row = 0
        if code is not None:
            self._drop_held_only_by_their_generators(code)
            if len(self._lineages) >= MAX_LINEAGES:
                self._lineages.clear()
            lineage = self._lineages.setdefault(code, _Lineage())
            if lineage.last is not None:
                lineage.one_step_in_a_row = lineage.one_step_in_a_row + 1 if lineage.taken() == 1 else 0
            in_a_row = lineage.one_step_in_a_row
            lineage.last, lineage.last_taken = weakref.ref(inputs), None
        self._entries[_weak_key(input_fn, self._drop)] = (inputs, code)
        return inputs, in_a_row

    def _drop(self, key: Any) -> None:
        """Forget an entry (its function was dropped, or forgotten); its lineage keeps its count of steps."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        inputs, code = entry
        lineage = self._lineages.get(code)
        if lineage is not None and lineage.last is not None and lineage.last() is inputs:
            lineage.last_taken = inputs.taken

    def _drop_held_only_by_their_generators(self, code: Any) -> None:
        """Drop the entries of ``code`` whose function only their own unfinished generators still refer to.

        CPython only (reference counts); where the count says anything else refers to it, it is kept.
        """
        getrefcount = getattr(sys, "getrefcount", None)
        if getrefcount is None:
            return
        for key, (inputs, entry_code) in list(self._entries.items()):
            if entry_code is not code or not isinstance(key, weakref.ref) or isinstance(key, weakref.WeakMethod):
                continue
            fn = key()
            if fn is None:
                continue
            own = sum(
                1
                for it in inputs.iterators
                if inspect.isgenerator(it) and it.gi_frame is not None and it.gi_code is code
            )
            # getrefcount's argument and the local name ``fn`` are the two other references counted.
            if own and getrefcount(fn) <= own + 2:
                del fn
                self._drop(key)
