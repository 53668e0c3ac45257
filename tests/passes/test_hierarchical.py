"""hierarchical-allreduce: all-replica sums become cores / workers / cores steps.

Graph checks count placeholders before and after the pass (one
``rp.all_reduce`` becomes ``rp.reduce_scatter`` + ``rp.all_reduce(group='workers')``
+ ``rp.all_gather``) and type-check every rewritten graph; numeric checks run
the same steps through ``Replicator.run`` with the default pipeline and with
the pass, on two-level meshes whose core counts need padding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from utils import check_against_simulation, worker_batches

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.passes import (
    HierarchicalAllReduce,
    LowerCollectives,
    PassManager,
    count_primitives,
    default_passes,
    verify_graph,
)

from .workloads import input_fn_from, mlp_batch, mlp_params, mlp_step

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "rp.all_reduce", "rp.reduce_scatter", "rp.all_gather"
RTOL, ATOL = 2e-6, 1e-6


def _pipeline(algorithm: str = "native", **config) -> PassManager:
    """The default passes with the hierarchical pass right before lowering."""
    passes = default_passes()
    assert [p.name for p in passes[-3:]] == ["fuse-collectives", "share-slice-kernels", "lower-collectives"]
    passes[-1:] = [HierarchicalAllReduce(**config), LowerCollectives(algorithms={"all_reduce": algorithm})]
    return PassManager(passes, verify=True)


_REPLICATORS: dict = {}


def _replicator(workers: int, cores: int, hierarchical: bool = True, algorithm: str = "native") -> rp.Replicator:
    key = (workers, cores, hierarchical, algorithm)
    if key not in _REPLICATORS:
        passes = _pipeline(algorithm) if hierarchical else None
        _REPLICATORS[key] = rp.Replicator(workers, cores, passes=passes)
    return _REPLICATORS[key]


def _two_level(repl2d):
    if repl2d.num_workers < 2 or repl2d.cores_per_worker < 2:
        pytest.skip("needs two workers with two or more cores each")
    return repl2d.num_workers, repl2d.cores_per_worker


def _eqns(graph, name):
    return [e for e in iter_eqns(graph.jaxpr.jaxpr) if e.primitive.name == name]


def _placeholders(graph):
    return count_primitives(graph.jaxpr, [ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER])


def _rewrite(graph, **config):
    """Run the pass on ``graph``; check it is pure and the result type-checks."""
    text = str(graph.jaxpr)
    result = HierarchicalAllReduce(**config).run(graph)
    assert str(graph.jaxpr) == text
    verify_graph(result.graph, lowered=False)
    return result


def _batch(cores, cols=5):
    return {"x": np.zeros((2 * cores, cols), np.float32)}


def _check_with_reference(repl, step, make_batch, seed=0, steps=1, state=None):
    """Run ``step`` on ``repl`` with ``input_fn_from(make_batch, seed)``; compare each step with the reference.

    The reference (``tests.utils.simulate``) runs every replica at once under
    ``jax.vmap`` with ``jax.lax`` collectives: none of the library's passes or
    lowerings. Floats within ``ATOL + RTOL |want|``; other dtypes equal.
    """
    batches = worker_batches(input_fn_from(make_batch, seed), repl.num_workers, repl.cores_per_worker, steps)
    return check_against_simulation(repl, step, batches, state, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------
# The graph
# ----------------------------------------------------------------------------


def test_one_all_reduce_becomes_three_steps(repl2d):
    workers, cores = _two_level(repl2d)
    graph = repl2d.lower(lambda b: rp.all_mean(b["x"]), _batch(cores)).traced
    assert _placeholders(graph) == {ALL_REDUCE: 1}
    result = _rewrite(graph)
    assert result.changed
    assert _placeholders(result.graph) == {REDUCE_SCATTER: 1, ALL_REDUCE: 1, ALL_GATHER: 1}
    (scatter,) = _eqns(result.graph, REDUCE_SCATTER)
    (reduce,) = _eqns(result.graph, ALL_REDUCE)
    (gather,) = _eqns(result.graph, ALL_GATHER)
    padded = -(-10 // cores) * cores  # the 2x5 operand, flattened and padded
    assert scatter.params == {"axis": 0, "group": "cores", "group_size": cores}
    assert scatter.invars[0].aval.shape == (padded,)
    assert reduce.params == {"op": "sum", "group": "workers", "group_size": workers}
    assert reduce.invars[0].aval.shape == (padded // cores,)  # only 1/C crosses workers
    assert gather.params == {"axis": 0, "tiled": True, "group": "cores", "group_size": cores}
    # The mean is one division, on the chunk, by the total replica count.
    (div,) = _eqns(result.graph, "div")
    assert float(div.invars[1].val) == workers * cores and div.invars[0] is reduce.outvars[0]
    lowered = LowerCollectives().run(result.graph).graph
    verify_graph(lowered, lowered=True)
    axes = {e.primitive.name: e.params.get("axis_name", e.params.get("axes")) for e in iter_eqns(lowered.jaxpr.jaxpr)}
    assert axes["reduce_scatter"] == ("cores",) and axes["psum"] == ("workers",) and axes["all_gather"] == ("cores",)


def test_fused_gradients_become_one_hierarchical_reduce(repl2d):
    workers, cores = _two_level(repl2d)
    state = mlp_params(np.random.default_rng(0))
    batch = mlp_batch(cores)(np.random.default_rng(1))
    lowered = _replicator(workers, cores).lower(mlp_step, batch, state)
    names = [s.name for s in lowered.snapshots]
    assert names.index("fuse-collectives") < names.index("hierarchical-allreduce") < names.index("lower-collectives")
    # fuse-collectives leaves one f32 mean (gradients and loss), one int32 sum (the
    # sum of a constant was simplified away) and the max, which is not hierarchical.
    fused = lowered.after("fuse-collectives")
    kinds = sorted((e.params["op"], str(e.invars[0].aval.dtype), len(e.invars)) for e in _eqns(fused, ALL_REDUCE))
    assert kinds == [("max", "bool", 1), ("mean", "float32", 1), ("sum", "int32", 1)]
    after = lowered.after("hierarchical-allreduce")
    assert _placeholders(after) == {REDUCE_SCATTER: 2, ALL_GATHER: 2, ALL_REDUCE: 3}
    groups = sorted((e.params["op"], str(e.params["group"])) for e in _eqns(after, ALL_REDUCE))
    assert groups == [("max", "None"), ("sum", "workers"), ("sum", "workers")]


def test_operands_of_several_dtypes_share_one_inter_worker_collective(repl2d):
    workers, cores = _two_level(repl2d)

    def step(b):
        x = b["x"]
        return rp.all_sum({"a": x, "i": x.astype(jnp.int32), "b": x[:, :3] * 2, "e": x[:0]})

    graph = repl2d.lower(step, _batch(cores)).traced
    assert len(_eqns(graph, ALL_REDUCE)) == 1
    result = _rewrite(graph)
    scatters = sorted(
        (str(e.invars[0].aval.dtype), e.invars[0].aval.shape) for e in _eqns(result.graph, REDUCE_SCATTER)
    )
    pad = lambda n: -(-n // cores) * cores  # noqa: E731
    assert scatters == [("float32", (pad(10 + 6),)), ("int32", (pad(10),))]
    (reduce,) = _eqns(result.graph, ALL_REDUCE)
    assert [v.aval.dtype for v in reduce.invars] == [jnp.float32, jnp.int32]
    assert len(_eqns(result.graph, ALL_GATHER)) == 2
    _check_with_reference(_replicator(workers, cores), step, _float_batch(cores))


def test_nothing_to_do_without_two_levels(n_devices):
    step = lambda b: rp.all_sum(b["x"])  # noqa: E731
    for workers, cores in [(1, n_devices), (n_devices, 1)]:
        graph = rp.Replicator(workers, cores).lower(step, _batch(cores)).traced
        result = _rewrite(graph)
        assert not result.changed and result.graph is graph


@pytest.mark.parametrize(
    "fn",
    [
        lambda b: rp.all_max(b["x"]),
        lambda b: rp.all_min(b["x"]),
        lambda b: rp.all_sum(b["x"], group="cores"),
        lambda b: rp.all_mean(b["x"], group="workers"),
        lambda b: rp.all_gather(b["x"]),
    ],
    ids=["max", "min", "cores", "workers", "all_gather"],
)
def test_only_sum_and_mean_over_all_replicas_are_rewritten(repl2d, fn):
    _two_level(repl2d)
    graph = repl2d.lower(fn, _batch(repl2d.cores_per_worker)).traced
    result = _rewrite(graph)
    assert not result.changed and result.graph is graph


@pytest.mark.parametrize("min_bytes, rewritten", [(0, [40, 4]), (5, [40]), (40, [40]), (41, [])])
def test_min_bytes(repl2d, min_bytes, rewritten):
    _two_level(repl2d)

    def step(b):
        return rp.all_sum(b["x"]), rp.all_sum(b["x"][0, 0])  # 40 bytes, then 4

    graph = repl2d.lower(step, _batch(repl2d.cores_per_worker)).traced
    result = _rewrite(graph, min_bytes=min_bytes)
    scattered = [e.invars[0].aval.size for e in _eqns(result.graph, REDUCE_SCATTER)]
    pad = lambda n: -(-n // repl2d.cores_per_worker) * repl2d.cores_per_worker  # noqa: E731
    assert scattered == [pad(b // 4) for b in rewritten]
    assert result.changed == bool(rewritten)


def test_rewriting_a_rewritten_graph_changes_nothing(repl2d):
    _two_level(repl2d)
    graph = repl2d.lower(lambda b: rp.all_sum(b["x"]), _batch(repl2d.cores_per_worker)).traced
    once = _rewrite(graph)
    again = _rewrite(once.graph)
    assert once.changed and not again.changed and again.graph is once.graph


def _in_scan(s, b):
    def body(carry, row):
        return carry + rp.all_sum(row), rp.all_mean(row * 2)

    total, means = lax.scan(body, jnp.zeros(b["x"].shape[1]), b["x"])
    # The predicate is state: a runtime value, identical on every replica.
    return s, (total, means, lax.cond(s["on"] > 0, lambda y: rp.all_sum(y), lambda y: y * 3, b["x"][0]))


@pytest.mark.parametrize("on", [1, 0], ids=["all_sum-branch", "local-branch"])
def test_sub_jaxprs_are_rewritten_in_place(repl2d, on):
    workers, cores = _two_level(repl2d)
    state = {"on": jnp.int32(on)}
    graph = repl2d.lower(_in_scan, _batch(cores), state).traced
    result = _rewrite(graph)
    top = result.graph.jaxpr.jaxpr
    assert not [e for e in top.eqns if e.primitive.name in (ALL_REDUCE, REDUCE_SCATTER)]
    (scan,) = [e for e in top.eqns if e.primitive.name == "scan"]
    assert count_primitives(scan.params["jaxpr"], [REDUCE_SCATTER, ALL_GATHER]) == {REDUCE_SCATTER: 2, ALL_GATHER: 2}
    (cond,) = [e for e in top.eqns if e.primitive.name == "cond"]
    assert [count_primitives(br, [REDUCE_SCATTER]) for br in cond.params["branches"]] == [{}, {REDUCE_SCATTER: 1}]
    repl = _replicator(workers, cores)
    _, (outputs,) = _check_with_reference(repl, _in_scan, _float_batch(cores, rows=3), state=state)
    # The branch taken, by hand: replica r's first row x0.
    x0 = worker_batches(input_fn_from(_float_batch(cores, rows=3)), workers, cores, 1)[0]["x"][::3]
    want = np.broadcast_to(x0.sum(0), x0.shape) if on else 3 * x0
    np.testing.assert_allclose(outputs[2], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# The numbers
# ----------------------------------------------------------------------------


def _float_batch(cores, rows=1):
    return lambda rng: {"x": rng.normal(size=(rows * cores, 5)).astype(np.float32)}


@pytest.mark.parametrize(
    "shape, algorithm",
    [("2xN/2", "native"), ("2x3", "native"), ("2x2", "native"), ("2xN/2", "ring")],
    ids=["2xN/2", "2x3", "2x2", "ring"],
)
def test_mlp_training_matches_the_reference(n_devices, shape, algorithm):
    """Also on a square mesh, where a step over 'workers' taken for one over 'cores' keeps its shapes."""
    if shape in ("2x3", "2x2"):
        workers, cores = (2, 3) if shape == "2x3" else (2, 2)
        if n_devices < workers * cores:
            pytest.skip(f"needs {workers * cores} devices")
    else:
        if n_devices % 2 or n_devices < 4:
            pytest.skip("needs an even number of devices >= 4")
        workers, cores = 2, n_devices // 2
    state = mlp_params(np.random.default_rng(0))
    hierarchical = _replicator(workers, cores, algorithm=algorithm)
    assert "hierarchical-allreduce" in hierarchical.passes.names
    final, outputs = _check_with_reference(hierarchical, mlp_step, mlp_batch(cores), seed=7, steps=2, state=state)
    assert int(final["steps"]) == 2
    assert not np.allclose(np.asarray(final["w1"]), np.asarray(state["w1"]))
    # Every replica holds the same reduced values.
    for leaf in jax.tree.leaves(outputs[-1]):
        np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(np.asarray(leaf)[:1], np.shape(leaf)))


def test_zero_size_operands_are_left_alone(repl2d):
    """Nothing to reduce: no reduce-scatter of an empty buffer."""
    _two_level(repl2d)
    graph = repl2d.lower(lambda b: rp.all_sum(b["x"][:, :0]), _batch(repl2d.cores_per_worker)).traced
    before = count_primitives(graph.jaxpr)
    result = _rewrite(graph)
    assert not result.changed and result.graph is graph
    assert count_primitives(result.graph.jaxpr) == before == {**before, ALL_REDUCE: 1}


def _wrapping_sums(b):
    return {
        "i8": rp.all_sum(b["i8"]),  # wraps around mod 256
        "u8": rp.all_sum(b["u8"]),
        "i32": rp.all_sum(b["i32"]),  # near 2**31: wraps too
        "mean": rp.all_mean(b["f"]),
    }


def _wrapping_batch(cores):
    return lambda rng: {
        "i8": rng.integers(-128, 128, size=(cores, 6)).astype(np.int8),
        "u8": rng.integers(0, 256, size=(cores, 6)).astype(np.uint8),
        "i32": rng.integers(2**30, 2**31 - 1, size=(cores, 6)).astype(np.int32),
        "f": rng.normal(size=(cores, 6)).astype(np.float32),
    }


@pytest.mark.parametrize("shape, algorithm", [("2xN/2", "native"), ("2x3", "native"), ("2x3", "ring")])
def test_integer_sums_wrap_and_means_match_numpy(n_devices, shape, algorithm):
    """Modular integer addition is associative: cores-then-workers wraps exactly as one sum."""
    if shape == "2x3":
        if n_devices < 6:
            pytest.skip("needs 6 devices")
        workers, cores = 2, 3
    else:
        if n_devices % 2 or n_devices < 4:
            pytest.skip("needs an even number of devices >= 4")
        workers, cores = 2, n_devices // 2
    repl = _replicator(workers, cores, algorithm=algorithm)
    make_batch = _wrapping_batch(cores)
    rewritten = repl.lower(_wrapping_sums, make_batch(np.random.default_rng(0))).after("hierarchical-allreduce")
    assert len(_eqns(rewritten, REDUCE_SCATTER)) == 4  # one per dtype, all four rewritten
    got = repl.run(_wrapping_sums, input_fn_from(make_batch, seed=4))
    batches = [make_batch(np.random.default_rng((4, w))) for w in range(workers)]
    x = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}  # (replicas, 6): one row each
    with np.errstate(over="ignore"):
        want = {k: np.broadcast_to(x[k].sum(0, dtype=x[k].dtype), x[k].shape) for k in ("i8", "u8", "i32")}
    for k, w in want.items():
        assert np.asarray(got[k]).dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(got[k]).reshape(w.shape), w, err_msg=k)
    mean = np.broadcast_to(x["f"].astype(np.float64).mean(0), x["f"].shape)
    np.testing.assert_allclose(np.asarray(got["mean"]).reshape(mean.shape), mean, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------


def test_repr_is_the_configuration_and_bad_configs_raise():
    assert repr(HierarchicalAllReduce()) == "HierarchicalAllReduce(min_bytes=0)"
    assert repr(HierarchicalAllReduce(min_bytes=4096)) == "HierarchicalAllReduce(min_bytes=4096)"
    assert HierarchicalAllReduce.name == "hierarchical-allreduce" and not HierarchicalAllReduce.required
    assert _pipeline().key() != _pipeline(min_bytes=1).key()
    assert "hierarchical-allreduce" not in PassManager().names
    with pytest.raises(ValueError, match=">= 0"):
        HierarchicalAllReduce(min_bytes=-1)
    with pytest.raises(TypeError, match="int"):
        HierarchicalAllReduce(min_bytes=1.5)
