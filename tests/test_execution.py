"""runtime/execution.py: placement of batches and state on the mesh (the cases mutation testing found untested first).

The paths of a mesh that spans processes are run in this one process by making ``spans_processes`` say so
(every device is still this process's, so the global arrays can be checked against NumPy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.core.context import REPLICA_AXES
from replicator.runtime import execution
from replicator.runtime.execution import place_batch, place_state, sharded, spans_processes


class _FakeDevice:
    def __init__(self, process_index: int):
        self.process_index = process_index


class _FakeMesh:
    """Only what ``spans_processes`` reads: ``devices`` (hashable by identity, as its cache needs)."""

    def __init__(self, process_indices: list[int]):
        self.devices = np.array([_FakeDevice(p) for p in process_indices], dtype=object)


@pytest.mark.parametrize(
    ("process_count", "device_processes", "expected"),
    [
        (1, [0, 0, 0, 0], False),
        (2, [0, 0, 0, 0], False),  # a mesh of this process's devices alone, in a job of two
        (2, [0, 0, 1, 1], True),
        (3, [0, 1, 2, 2], True),
    ],
)
def test_spans_processes_only_with_devices_of_several_processes(
    monkeypatch: pytest.MonkeyPatch, process_count: int, device_processes: list[int], expected: bool
) -> None:
    monkeypatch.setattr(jax, "process_count", lambda: process_count)
    assert spans_processes(_FakeMesh(device_processes)) is expected


def test_a_batch_leaf_already_laid_out_by_replica_is_used_as_it_is(repl2d: rp.Replicator) -> None:
    rows = np.arange(repl2d.num_replicas * 3, dtype=np.float32).reshape(repl2d.num_replicas, 3)
    laid_out = jax.device_put(rows, sharded(repl2d.mesh))
    (placed,) = place_batch([[laid_out]], repl2d.mesh)
    assert placed is laid_out


def _one_gib_leaf() -> np.ndarray:
    """A leaf that says it is 1 GiB (the size at which the free-memory check starts) without the memory."""
    leaf = np.zeros((8, 2), np.float32)
    return np.lib.stride_tricks.as_strided(leaf, shape=(8, (1 << 30) // 32), strides=(8, 0))


def test_a_small_batch_is_not_checked_against_the_free_memory(
    repl: rp.Replicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execution, "available_host_memory", lambda: 1)  # would refuse any batch
    rows = np.arange(repl.num_replicas, dtype=np.float32)
    (placed,) = place_batch([[rows]], repl.mesh)
    np.testing.assert_array_equal(np.asarray(placed), rows)


def test_a_batch_larger_than_the_free_memory_is_a_memory_error_naming_the_fix(
    repl: rp.Replicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execution, "available_host_memory", lambda: 1 << 29)
    with pytest.raises(MemoryError, match=r"needs 1\.0 GiB .* only 0\.5 GiB .* Yield smaller batches"):
        execution._check_host_memory([[_one_gib_leaf()]], repl.mesh)


def test_a_large_batch_is_placed_when_the_free_memory_is_unknown(
    repl: rp.Replicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execution, "available_host_memory", lambda: None)  # no /proc/meminfo
    execution._check_host_memory([[_one_gib_leaf()]], repl.mesh)  # no error


@pytest.fixture
def as_if_multiprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the placement paths of a mesh that spans processes (each process passes its own workers' rows)."""
    monkeypatch.setattr(execution, "spans_processes", lambda mesh: True)


@pytest.mark.parametrize("num_workers", [None, 2])
def test_process_local_rows_become_one_global_batch_in_worker_order(
    repl2d: rp.Replicator, as_if_multiprocess: None, num_workers: int | None
) -> None:
    workers, cores = repl2d.mesh.devices.shape
    per_worker = [np.arange(cores * 3, dtype=np.float32).reshape(cores, 3) + 100 * w for w in range(workers)]
    (placed,) = place_batch([[x] for x in per_worker], repl2d.mesh, workers if num_workers else None)
    assert placed.shape == (workers * cores, 3)
    assert placed.sharding.is_equivalent_to(NamedSharding(repl2d.mesh, P(REPLICA_AXES)), 2)
    np.testing.assert_array_equal(np.asarray(placed), np.concatenate(per_worker))


def test_folded_workers_rows_become_one_global_batch(n_devices: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four workers on a mesh of two device rows (two replicas per device): the batch has every worker's rows."""
    monkeypatch.setattr(execution, "spans_processes", lambda mesh: True)
    repl = rp.Replicator(4, n_devices // 2, parallelism=rp.Parallelism(replicas_per_device=2))
    rows = n_devices // 2
    per_worker = [np.full((rows, 2), w, np.int32) for w in range(4)]
    (placed,) = place_batch([[x] for x in per_worker], repl.mesh, 4)
    np.testing.assert_array_equal(np.asarray(placed), np.concatenate(per_worker))


def test_process_local_typed_keys_become_global_typed_keys(repl2d: rp.Replicator, as_if_multiprocess: None) -> None:
    keys = jax.random.split(jax.random.key(7), repl2d.num_replicas)
    workers = repl2d.mesh.devices.shape[0]
    (placed,) = place_batch([[k] for k in jnp.split(keys, workers)], repl2d.mesh)
    assert jax.dtypes.issubdtype(placed.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(placed) == jax.random.key_impl(keys)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(placed)), np.asarray(jax.random.key_data(keys)))
    assert placed.sharding.is_equivalent_to(NamedSharding(repl2d.mesh, P(REPLICA_AXES)), 1)


def test_state_on_this_process_devices_takes_process_0s_values(
    repl: rp.Replicator, as_if_multiprocess: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank-0 semantics on a mesh that spans processes: a device array of this process (not yet on the mesh)
    is replaced by process 0's value like a host one, not kept as this process built it."""
    from jax.experimental import multihost_utils

    process_0 = [np.full((3,), 5.0, np.float32), np.full((2,), 6.0, np.float32)]
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda leaves: process_0)
    mine = [jax.device_put(jnp.zeros((3,), jnp.float32), jax.devices()[0]), np.zeros((2,), np.float32)]
    placed = place_state(mine, repl.mesh)
    for got, want in zip(placed, process_0, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.is_fully_replicated and got.sharding.mesh == repl.mesh


@pytest.mark.parametrize("state_comes_out_batched", [False, True])
def test_a_folded_step_trains_like_one_device_in_either_form_of_its_state(
    state_comes_out_batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folded step's replicated state leaves vmap unbatched; where JAX says one came out batched (its
    ``out_axes=None`` error, met on the block's trace), the step takes replica 0's copy instead: both forms
    train to one device's numbers."""
    if state_comes_out_batched:
        make_jaxpr = jax.make_jaxpr

        def batched(fn, *args, **kwargs):
            if "_folded" in getattr(fn, "__qualname__", ""):  # the trace of the folded block only
                traced = make_jaxpr(fn, *args, **kwargs)

                def refuse(*a, **k):
                    traced(*a, **k)
                    raise ValueError("vmap has mapped output but out_axes is None")

                return refuse
            return make_jaxpr(fn, *args, **kwargs)

        monkeypatch.setattr(execution.jax, "make_jaxpr", batched)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32)
    w0 = np.zeros((3, 1), np.float32)

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def step(w, batch):
        return w - 0.1 * rp.all_mean(jax.grad(loss)(w, *batch)), rp.all_mean(loss(w, *batch))

    repl = rp.Replicator(2, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(replicas_per_device=2))
    w, want = w0, w0
    for _ in range(3):
        w, _ = repl.run(step, (x, y), w)
        want = want - 0.1 * jax.grad(loss)(want, x, y)
    np.testing.assert_allclose(np.asarray(w), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_steps_closing_over_same_shaped_arrays_of_other_values_get_other_fingerprints(repl: rp.Replicator) -> None:
    """The same-program check sees a closed-over constant's bytes, not only its dtype and shape."""
    batch = {"x": np.ones((repl.num_replicas, 3), np.float32)}
    ones, zeros, also_ones = jnp.ones(3, jnp.float32), jnp.zeros(3, jnp.float32), jnp.ones(3, jnp.float32)

    def fingerprint(const: jax.Array) -> str:
        graph = repl.lower(lambda b: {"y": b["x"] * const}, batch).final
        assert graph.jaxpr.consts, "the step should close over its array as a constant"
        return execution.program_fingerprint(graph)

    assert fingerprint(ones) != fingerprint(zeros)
    assert fingerprint(ones) == fingerprint(also_ones)


def test_two_local_workers_yielding_different_dtypes_is_a_type_error(repl2d: rp.Replicator) -> None:
    """Two workers of one process whose leaves differ in dtype: an error naming both, not a silent widening."""
    workers, cores = repl2d.mesh.devices.shape
    if workers < 2:
        pytest.skip("needs two workers")
    for other in (np.float64, np.int32):
        per_worker = [np.zeros((cores, 2), np.float32), np.zeros((cores, 2), other)]
        names = sorted(["float32", np.dtype(other).name])
        with pytest.raises(TypeError, match=rf"different dtypes \['{names[0]}', '{names[1]}'\]"):
            place_batch([[x] for x in per_worker], repl2d.mesh, workers)


# -- the promises of runtime/execution.py no other test checks ---------------------------------------------------


def test_state_on_the_mesh_is_used_as_it_is_and_other_leaves_are_placed_replicated_or_split(
    repl: rp.Replicator,
) -> None:
    from replicator.core.graph import ShardedState

    mesh, n = repl.mesh, repl.num_replicas
    on_mesh = jax.device_put(np.arange(3, dtype=np.float32), NamedSharding(mesh, P()))
    weak = jax.device_put(jnp.asarray(2.0), NamedSharding(mesh, P()))  # on the mesh, but weakly typed
    assert weak.weak_type  # placed again, strong: a Python float's weak type must not retrace later
    leaves = [on_mesh, weak, np.int8(-3), np.ones((2, n), jnp.bfloat16), np.array([True, False])]
    placed = place_state(leaves, mesh, ShardedState({3: 1}))  # leaf 3 split along its axis 1 (ZeRO)
    assert placed[0] is on_mesh
    assert not placed[1].weak_type and placed[1].dtype == jnp.float32
    assert placed[2].shape == () and placed[2].dtype == jnp.int8 and int(placed[2]) == -3
    assert placed[3].dtype == jnp.bfloat16 and placed[3].sharding.spec == P(None, REPLICA_AXES)
    assert {s.data.shape for s in placed[3].addressable_shards} == {(2, 1)}
    for leaf in (placed[1], placed[2], placed[4]):
        assert leaf.sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(np.asarray(placed[4]), [True, False])


def test_a_constant_or_0d_output_comes_back_one_row_per_replica(repl: rp.Replicator) -> None:
    """Outputs get a leading replica axis, in replica order, whatever the rewrite left (a literal too)."""
    n = repl.num_replicas
    out = repl.run(lambda b: {"c": 1.5, "k": jnp.int8(3), "rid": rp.replica_id()}, {"x": np.zeros((n, 1), np.float32)})
    assert out["c"].shape == (n,) and out["k"].shape == (n,) and out["k"].dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(out["c"]), np.full(n, 1.5))
    np.testing.assert_array_equal(np.asarray(out["rid"]), np.arange(n))


def test_a_step_may_close_over_an_earlier_runs_output_on_the_mesh(repl: rp.Replicator) -> None:
    """An array on the mesh (the state a run returned) cannot enter shard_map as a constant; its value can."""
    n = repl.num_replicas
    batch = {"x": np.ones((n, 3), np.float32)}
    w, _ = repl.run(lambda s, b: (s + rp.all_mean(b["x"][0]), {}), batch, jnp.zeros(3))
    assert w.sharding.mesh == repl.mesh and len(w.sharding.device_set) == n
    out = repl.run(lambda b: {"y": b["x"][0] * w}, batch)
    np.testing.assert_array_equal(np.asarray(out["y"]), np.ones((n, 3)))


# -- the promises of every runtime module ---------------------------------------------------------------------

_RUNTIME_MODULES = [
    *("consistency", "execution", "gc_pause", "inputs", "memory", "mesh", "state", "steady"),
    *(f"distributed.{m}" for m in ("agreement", "bootstrap", "outputs", "progress", "startup", "status")),
    "distributed",
]


@pytest.mark.parametrize("name", _RUNTIME_MODULES)
def test_every_promise_of_a_runtime_module_cites_tests_that_exist(name: str) -> None:
    """Each module's docstring ends with "Promises:", a numbered list whose every item names its tests."""
    import ast
    import importlib
    import re
    from pathlib import Path

    doc = importlib.import_module(f"replicator.runtime.{name}").__doc__
    assert "\nPromises:\n" in doc, f"{name} has no Promises: section"
    items = re.split(r"\n(?=\d+\. )", doc.split("\nPromises:\n", 1)[1].strip())
    assert [int(item.split(".", 1)[0]) for item in items] == list(range(1, len(items) + 1))
    root = Path(__file__).resolve().parent.parent
    for item in items:
        cited = re.findall(r"(tests/[\w/]+\.py)::([\w:]+)", item)
        assert cited, f"{name}: promise {item[:60]!r} cites no test"
        for file, test in cited:
            scope = ast.parse((root / file).read_text()).body
            for part in test.split("::"):
                found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
                assert found, f"{name}: {file}::{test} does not exist"
                scope = found[0].body
