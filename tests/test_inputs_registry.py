"""The input registry: input functions that share one piece of code, and how many pieces of code it remembers."""

from __future__ import annotations

import itertools
import types
import warnings
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.runtime.inputs import InputContext, InputRegistry


def _numbered(rows: int, start: int) -> Iterator[dict]:
    """A generator of batches numbered ``start``, ``start + 1``, ...: ``x`` is the number on every row."""
    for i in itertools.count(start):
        yield {"x": np.full((rows,), i, np.float32)}


def _numbered_map(rows: int, start: int) -> Iterator[dict]:
    """The same batches from a ``map`` iterator (not a generator)."""
    return map(lambda i: {"x": np.full((rows,), i, np.float32)}, itertools.count(start))


def _step(count: jnp.ndarray, batch: dict) -> tuple:
    return count + 1, batch["x"][0]


@pytest.mark.parametrize("iterator", [_numbered, _numbered_map], ids=["generator-of-another-function", "map"])
def test_input_functions_made_by_one_factory_each_continue_their_own_data(
    n_devices: int, iterator: Callable[[int, int], Iterator[dict]]
) -> None:
    """Two input functions of the same code (a factory's lambda), both held by the caller, run in turns:
    starting the second must not drop the first's iterators, which are not generators of that code."""

    def make_input(start: int) -> Callable:
        return lambda ctx: iterator(n_devices, start)

    repl = rp.Replicator(1, n_devices)
    train, evaluate = make_input(0), make_input(100)
    count, seen = jnp.int32(0), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for training in [True, True, False, True, False, True]:  # each function held by one name, as usual
            count, first = repl.run(_step, train if training else evaluate, count)
            seen.append(float(first[0]))  # replica 0's first row
    assert seen == [0.0, 1.0, 100.0, 2.0, 101.0, 3.0]
    assert repl.input_position(train) == 4 and repl.input_position(evaluate) == 2
    assert not [w for w in caught if "input_fn" in str(w.message)]  # not taken for functions made per call


def _with_own_code(fn: Callable, i: int) -> Callable:
    """``fn`` as a function of its own code object (a distinct piece of code to the registry)."""
    return types.FunctionType(fn.__code__.replace(co_name=f"input_fn_{i}"), fn.__globals__)


def _started_one_step(registry: InputRegistry, input_fn: Callable, contexts: list) -> int:
    """Start ``input_fn``, take one batch from it; the count of one-step functions of its code before it."""
    inputs, in_a_row = registry.start(input_fn, contexts)
    inputs.take()
    return in_a_row


def test_the_input_registry_remembers_1024_pieces_of_code_then_starts_over() -> None:
    """Per-call input functions are counted by their code: the count of one code survives input functions of
    1022 other codes (1024 codes remembered), and the registry starts over once it is full (bounded memory)."""
    registry = InputRegistry()
    contexts = [InputContext(num_workers=1, worker_id=0, cores_per_worker=1)]
    held = []  # the caller's input functions, alive as in a training loop

    def per_call() -> Callable:
        return lambda ctx: iter([{"x": np.zeros(1)}])

    def start(fn: Callable) -> int:
        held.append(fn)
        return _started_one_step(registry, fn, contexts)

    template = per_call()
    assert [start(per_call()) for _ in range(2)] == [0, 1]  # one piece of code; the second after a one-step one
    assert [start(_with_own_code(template, i)) for i in range(1022)] == [0] * 1022
    assert start(per_call()) == 2  # 1023 pieces of code known, fewer than it holds: nothing forgotten
    assert start(_with_own_code(template, 1022)) == 0  # the registry is full now (1024 pieces of code)
    assert start(per_call()) == 0  # ... so it started over: the count of per_call's code is gone
