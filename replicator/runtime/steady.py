"""The steady state of a training loop: a ``Replicator.run`` call like the last one, run with the fewest
Python calls.

``state, out = repl.run(step, input_fn, state)`` in a loop calls the same step with the same ``input_fn``,
the state the last call returned and a batch of the same shapes, step after step. Each such call needs
neither the compile cache, nor the batch checks (they depend only on the structure, shapes and dtypes,
checked already), nor placement (the state is on the mesh already; NumPy leaves go to the compiled step as
they are). :class:`SteadyStep` records, after a call of the general path, what makes the next call the
same, and runs it when it is: every condition it does not check by identity or equality is one it
records only when it holds (one local worker, one process, no prefetch, no per-replica state, no static
state leaves, a NumPy batch under the host-memory check's size). Anything else (a new shape, another
state, an exhausted or prefetched input) goes back to the general path, which checks everything and
records the step again.

The cost this saves is host time per step, against a hand-written ``jit(shard_map)`` call
(``benchmarks/host_overhead.py``); ``tests/test_host_path.py`` counts its Python calls.

Promises:

1. A call like the last one runs the recorded step with at most a few Python calls more than a hand-written
   ``jit(shard_map)`` call, through the jitted function's C++ fast path, for an ``input_fn`` and for a batch
   given to ``run`` again
   (tests/test_host_path.py::test_a_repeated_step_makes_few_python_calls_beyond_the_hand_written_call,
   tests/test_host_path.py::test_a_batch_given_to_run_again_makes_few_python_calls_beyond_the_hand_written_call,
   tests/test_host_path.py::test_a_repeated_step_takes_the_jitted_functions_cpp_fast_path).
2. Every batch runs once, at its own step, in order: one the steady check drew and found different is run by
   the general path, counted once in the input position; the input's end is ``InputExhausted`` after the
   number of batches it gave
   (tests/test_host_path.py::test_steady_steps_run_each_batch_once_in_order_across_a_change_of_shape).
3. A batch of another shape, of the same shapes in another structure, or of another dtype (int8, bool) is
   checked and traced for it, not run by the recorded step
   (tests/test_host_path.py::test_a_batch_of_a_new_shape_after_repeated_steps_is_checked_and_compiled,
   tests/test_host_path.py::test_a_batch_of_the_same_shapes_in_another_structure_is_traced_for_it,
   tests/test_host_path.py::test_a_batch_of_another_dtype_after_steady_steps_is_traced_for_it).
4. A leaf that is not a NumPy array goes through every check: a Python float is refused as a scalar
   (tests/test_host_path.py::test_a_float_leaf_after_repeated_numpy_batches_is_refused), a JAX array on one
   device is placed by replica
   (tests/test_host_path.py::test_a_device_array_batch_after_steady_numpy_steps_is_placed_by_replica);
   a bad batch gets the batch checks' own error
   (tests/test_host_path.py::test_a_bad_batch_after_steady_steps_gets_the_batch_checks_error).
5. A state other than the one the last call returned (another value, an earlier state, the same arrays in
   another structure, another shape) is placed and used, traced for where it differs
   (tests/test_host_path.py::test_a_state_that_is_not_the_returned_one_is_placed_and_used,
   tests/test_host_path.py::test_the_returned_arrays_in_another_structure_are_traced_for_it,
   tests/test_host_path.py::test_a_state_of_another_shape_after_steady_steps_is_traced_for_its_shape).
6. Another step function, pass manager or input in turn each runs its own step and continues its own data
   (tests/test_host_path.py::test_alternating_step_functions_each_run_their_own_step,
   tests/test_host_path.py::test_a_new_pass_manager_between_calls_compiles_the_step_again,
   tests/test_host_path.py::test_two_input_functions_alternating_each_continue_their_own_iterator,
   tests/test_host_path.py::test_given_batches_input_functions_and_iterators_in_turn_each_run_their_own_data).
7. The record holds the ``input_fn`` and its iterators weakly: a dropped ``input_fn`` takes its iterator with
   it (tests/test_host_path.py::test_a_dropped_input_function_takes_its_iterator_with_it_after_steady_steps), and
   ``forget_input`` starts the input over
   (tests/test_host_path.py::test_forget_input_after_steady_steps_starts_the_input_over).
8. What the general path does on every step still happens: prefetch draws ahead once turned on
   (tests/test_host_path.py::test_prefetch_turned_on_after_steady_steps_draws_ahead), a batch over the host-memory
   threshold is checked at every step
   (tests/test_host_path.py::test_a_batch_over_the_host_memory_threshold_is_checked_at_every_step), and
   ``check_state_every`` runs (tests/test_host_path.py::test_steady_steps_check_the_replicas_agree_every_k_steps).
9. With several local workers every step draws one batch from each worker's iterator and gives each worker's
   rows to its own replicas
   (tests/test_host_path.py::test_two_local_workers_each_run_their_own_batches_in_order_step_after_step).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import jax

from replicator.runtime.execution import _NUMPY_ONLY, MEMORY_CHECK_BYTES
from replicator.runtime.inputs import _SHAPE_DTYPE, Batch, WorkerInputs

__all__ = ["SteadyStep"]

#: ``ref()`` of a weak reference, in C (``map`` over it makes no Python call per leaf).
_deref = weakref.ref.__call__
_flatten = jax.tree_util.tree_flatten


class SteadyStep:
    """What makes a call the same as the last one, and what it runs.

    Attributes:
      step_fn: the step (held as the compile cache holds it).
      input_fn: a weak reference to the ``input_fn``, or None for a batch given to ``run`` itself.
      inputs: a weak reference to its iterators (dropped with the function), or None.
      passes: the pass manager the step was compiled with.
      compiled: the compiled step (``executable``, ``traced``, ``runs``).
      returned: the record of the state the last call returned (its arrays held weakly).
      batch_key: ``(treedef, ((shape, dtype) of each leaf))`` of the batch.
    """

    __slots__ = ("batch_key", "compiled", "input_fn", "inputs", "passes", "returned", "step_fn")

    def __init__(
        self,
        step_fn: Callable,
        input_fn: Callable | None,
        inputs: WorkerInputs | None,
        passes: Any,
        compiled: Any,
        returned: Any,
        batch_leaves: list,
        batch_treedef: Any,
    ) -> None:
        self.step_fn, self.passes, self.compiled, self.returned = step_fn, passes, compiled, returned
        # None: the batch was given to run itself (and is then expected so again).
        self.input_fn = weakref.ref(input_fn) if input_fn is not None else None
        self.inputs = weakref.ref(inputs) if inputs is not None else None
        self.batch_key = (batch_treedef, tuple(map(_SHAPE_DTYPE, batch_leaves)))

    @classmethod
    def after(
        cls,
        step_fn: Callable,
        data: Any,
        inputs: WorkerInputs | None,
        passes: Any,
        compiled: Any,
        returned: Any,
        batch: Any,
    ) -> SteadyStep | None:
        """The record of a general-path call whose next call may run steady (its state reusable, no prefetch,
        no per-replica state, no static leaves: checked by the caller), or None where its batch is not one
        worker's host leaves given to the step as they were, under the host-memory check's size."""
        if not (
            len(batch.leaves) == 1
            and len(batch.placed) == len(batch.leaves[0])
            and all(map(operator.is_, batch.placed, batch.leaves[0]))  # host leaves, as they were
            and batch.signature.nbytes < MEMORY_CHECK_BYTES
        ):
            return None
        input_fn = data if inputs is not None else None
        treedef = jax.tree_util.tree_structure(batch.batches[0])
        return cls(step_fn, input_fn, inputs, passes, compiled, returned, batch.leaves[0], treedef)

    def take(self, state: Any, data: Any) -> tuple[list, list] | None:
        """``(state leaves, batch leaves)`` if this call, given ``state`` and ``data`` (``run``'s
        ``input_fn`` argument), is the steady one, else None (a batch drawn from an ``input_fn`` is then left
        first in line for the general path, as a prefetched one)."""
        if self.input_fn is None:  # a batch given to run expected (JAX would warn on flattening an iterator)
            if callable(data) or hasattr(data, "__next__"):  # an input_fn, an iterator
                return None
        elif self.input_fn() is not data:
            return None
        leaves, treedef = _flatten(state)
        returned = self.returned
        # The same structure (so as many leaves: a steady step has no static ones) and the same arrays.
        if treedef != returned.treedef or not all(map(operator.is_, map(_deref, returned.arrays), leaves)):
            return None
        if self.inputs is None:  # the batch itself
            inputs = None
            batch_leaves, batch_def = _flatten(data)
        else:
            inputs = self.inputs()  # none pending: a steady step is recorded only after a call without prefetch
            if inputs is None:
                return None
            try:  # inputs.next_batches(), inline: one local worker
                drawn = next(inputs.iterators[0])
            except StopIteration:
                raise inputs.exhausted(inputs.contexts[0]) from None
            inputs.steps += 1
            batch_leaves, batch_def = _flatten(drawn)
        key = self.batch_key  # NumPy arrays of the recorded structure, shapes and dtypes
        if (
            set(map(type, batch_leaves)) <= _NUMPY_ONLY
            and batch_def == key[0]
            and tuple(map(_SHAPE_DTYPE, batch_leaves)) == key[1]
        ):
            if inputs is not None:
                inputs.taken += 1
            return leaves, batch_leaves
        if inputs is not None:  # drawn: the general path takes it, checks it
            inputs.pending.appendleft(Batch([drawn]))
        return None
