"""fuse-collectives: independent all-reduces share one collective per bucket.

Graph-level checks count ``rp.all_reduce`` equations before and after the pass
(and ``psum`` after lowering) and type-check every rewritten graph; numeric
checks run the step through ``Replicator.run`` on per-replica-distinct data (each
worker's batch its own) and compare with ``tests.utils.simulate`` (every replica at
once under ``jax.vmap`` with ``jax.lax`` collectives: no pass or lowering of the
library). The groups are also checked on square meshes (``mesh2d``: ``2 x 2``), where
``'workers'`` and ``'cores'`` have the same size and only the numbers tell them apart.
"""

import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from utils import check_against_simulation

import replicator as rp
from replicator.passes import (
    CheckReplicaInvariance,
    LowerCollectives,
    PassManager,
    count_primitives,
    verify_graph,
)
from replicator.passes.fuse_collectives import (
    DEFAULT_MAX_TENSOR_BYTES,
    DEFAULT_THRESHOLD_BYTES,
    FuseCollectives,
    fusion_report,
)

ALL_REDUCE = "rp.all_reduce"
N_LAYERS, WIDTH = 8, 4


def _pipeline(**kwargs) -> PassManager:
    return PassManager([CheckReplicaInvariance(), FuseCollectives(**kwargs), LowerCollectives()], verify=True)


@pytest.fixture(scope="module")
def fused_repl(n_devices):
    return rp.Replicator(1, n_devices, passes=_pipeline())


@pytest.fixture(scope="module")
def plain_repl(n_devices):
    """The default pipeline without fusion: graphs with one all-reduce per leaf (graph tests only)."""
    return rp.Replicator(1, n_devices, passes=PassManager(disable=["fuse-collectives"]))


def _count(jaxpr, name=ALL_REDUCE) -> int:
    return count_primitives(jaxpr, [name]).get(name, 0)


def _top_level(jaxpr, name=ALL_REDUCE) -> list:
    return [e for e in jaxpr.eqns if e.primitive.name == name]


def _size(eqn) -> int:
    """Elements an all-reduce equation carries, over all its operands."""
    return sum(math.prod(v.aval.shape) for v in eqn.invars)


def _fuse(graph, **kwargs):
    """Run the pass on ``graph``; check it is pure and the result type-checks."""
    text = str(graph.jaxpr)
    result = FuseCollectives(**kwargs).run(graph)
    assert str(graph.jaxpr) == text
    verify_graph(result.graph, lowered=False)
    return result


def _lower_and_check(graph):
    lowered = LowerCollectives().run(graph).graph
    verify_graph(lowered, lowered=True)
    return lowered


def _traced(repl, step, batch, state=None):
    return repl.lower(step, batch, state).traced


def _repeat(batch):
    """An ``input_fn`` whose every worker yields ``batch`` forever."""

    def input_fn(ctx):
        while True:
            yield batch

    return input_fn


def _worker_batch(batch, w):
    """Worker ``w``'s batch made from ``batch``: its rows rolled by ``w``, its values times ``w + 1``.

    Every worker's rows differ (so a mix-up along ``'workers'`` shows), and every value
    keeps its sign (the predicates of the ``cond`` steps take the same branch).
    """
    return jax.tree.map(lambda a: np.roll(np.asarray(a), w, axis=0) * np.asarray(w + 1, np.asarray(a).dtype), batch)


def _compare_runs(fused, step, batches, state=None):
    """Run ``step`` with ``fused`` on ``batches`` (one worker's batch each: worker ``w`` gets
    ``_worker_batch(batch, w)``); compare with the reference.

    The reference (``tests.utils.simulate``) runs every replica at once with
    ``jax.vmap`` and ``jax.lax`` collectives, none of the library's passes or
    lowering; results agree to ``1e-6 + 1e-5 |want|``.
    """
    W = fused.num_workers
    global_batches = [
        jax.tree.map(lambda *a: np.concatenate(a), *[_worker_batch(b, w) for w in range(W)]) for b in batches
    ]
    return check_against_simulation(fused, step, global_batches, state, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------
# A data-parallel MLP that averages its gradients leaf by leaf
# ----------------------------------------------------------------------------


def _params(seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i in range(N_LAYERS):
        params[f"w{i}"] = rng.normal(0, 0.5, (WIDTH, WIDTH)).astype(np.float32)
        params[f"b{i}"] = rng.normal(0, 0.1, (WIDTH,)).astype(np.float32)
    return params


def _mlp_batches(n, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(2 * n, WIDTH)).astype(np.float32),
            "y": rng.normal(size=(2 * n, WIDTH)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _mlp_step(state, batch):
    def loss_fn(p):
        h = batch["x"]
        for i in range(N_LAYERS):
            h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
        return jnp.mean((h - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    grads = {k: rp.all_mean(g) for k, g in grads.items()}  # one collective per leaf
    new_state = jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)
    return new_state, {"loss": rp.all_mean(loss), "local_loss": loss}


MLP_LEAVES = 2 * N_LAYERS + 1  # the gradients and the loss
MLP_FLOATS = N_LAYERS * (WIDTH * WIDTH + WIDTH) + 1


def test_leaf_by_leaf_gradient_mean_becomes_one_collective(plain_repl, n_devices):
    graph = _traced(plain_repl, _mlp_step, _mlp_batches(n_devices, 1)[0], _params())
    assert _count(graph.jaxpr) == MLP_LEAVES
    result = _fuse(graph)
    assert result.changed
    (eqn,) = _top_level(result.graph.jaxpr.jaxpr)
    assert eqn.params["op"] == "mean" and eqn.params["group"] is None
    ((shape, dtype),) = [(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    assert shape == (MLP_FLOATS,) and dtype == jnp.float32
    assert _count(result.graph.jaxpr) == 1
    lowered = _lower_and_check(result.graph)
    assert _count(lowered.jaxpr, "psum") == 1


def test_fused_pipeline_lowers_to_one_psum(fused_repl, n_devices):
    lowered = fused_repl.lower(_mlp_step, _mlp_batches(n_devices, 1)[0], _params())
    assert [s.name for s in lowered.snapshots] == [
        "traced",
        "check-replica-invariance",
        "fuse-collectives",
        "lower-collectives",
    ]
    assert lowered.snapshots[2].changed
    assert _count(lowered.after("fuse-collectives").jaxpr) == 1
    assert _count(lowered.final.jaxpr, "psum") == 1
    assert _count(lowered.final.jaxpr, ALL_REDUCE) == 0


def test_mlp_training_matches_the_reference_over_several_steps(fused_repl, n_devices):
    state = jax.tree.map(jnp.asarray, _params())
    final_state, _ = _compare_runs(fused_repl, _mlp_step, _mlp_batches(n_devices, 3), state)
    # The updates did something: the state moved away from the initial parameters.
    assert not np.allclose(np.asarray(final_state["w0"]), _params()["w0"])


# ----------------------------------------------------------------------------
# Bucketing rules
# ----------------------------------------------------------------------------


def _eight_sums(b):
    return [rp.all_sum(b["x"][i] * (i + 1)) for i in range(8)]  # eight f32[4, 4] = 64 bytes each


def _eight_batch(n):
    return {"x": np.zeros((8 * n, 4, 4), np.float32)}


@pytest.mark.parametrize(
    "threshold, bucket_sizes",
    [
        (DEFAULT_THRESHOLD_BYTES, [8]),
        (3 * 64, [3, 3, 2]),
        (3 * 64 - 1, [2, 2, 2, 2]),
        (64, [1] * 8),  # each operand fills a bucket: nothing to fuse
        (1, [1] * 8),  # operands larger than the threshold get a bucket each
    ],
)
def test_threshold_splits_into_buckets(repl, threshold, bucket_sizes):
    graph = _traced(repl, _eight_sums, _eight_batch(repl.num_replicas))
    result = _fuse(graph, threshold_bytes=threshold)
    eqns = _top_level(result.graph.jaxpr.jaxpr)
    assert [_size(e) // 16 for e in eqns] == bucket_sizes
    assert all(len(e.invars) == 1 for e in eqns)
    assert result.changed == (len(bucket_sizes) < 8)
    if not result.changed:
        assert result.graph is graph
    plan = fusion_report(graph, FuseCollectives(threshold_bytes=threshold))
    assert [b.num_operands for b in plan] == bucket_sizes
    assert all(b.nbytes <= max(threshold, 64) for b in plan)
    assert _count(_lower_and_check(result.graph).jaxpr, "psum") == len(bucket_sizes)


def _dependent(b):
    y = rp.all_sum(b["x"])
    z = rp.all_sum(y * 2)  # needs y: cannot share y's collective
    w = rp.all_sum(b["x"] + 1)  # independent of both
    return y, z, w


def test_dependent_all_reduces_are_not_fused(repl, fused_repl):
    n = repl.num_replicas
    graph = _traced(repl, _dependent, {"x": np.zeros((n, 3), np.float32)})
    result = _fuse(graph)
    first, second = _top_level(result.graph.jaxpr.jaxpr)
    assert [v.aval.shape for v in first.invars] == [(1, 3)]  # y alone, as it was
    assert [v.aval.shape for v in second.invars] == [(6,)]  # z and w fused
    eqns = result.graph.jaxpr.jaxpr.eqns
    assert eqns.index(first) < next(i for i, e in enumerate(eqns) if e.primitive.name == "mul") < eqns.index(second)
    batch = {"x": np.arange(n * 3, dtype=np.float32).reshape(n, 3)}
    _compare_runs(fused_repl, _dependent, [batch])


def _mixed_dtypes(b):
    a = rp.all_sum({"f": b["x"], "i": b["i"], "g": b["x"][:, :2] * 3})  # one call, two dtypes
    c = rp.all_sum(b["i"] * 2)
    d = rp.all_sum(b["x"].sum())
    return a, c, d


def test_mixed_dtypes_go_to_separate_buckets(repl, fused_repl):
    n = repl.num_replicas
    batch = {
        "x": np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32),
        "i": np.arange(n * 2, dtype=np.int32).reshape(n, 2),
    }
    graph = _traced(repl, _mixed_dtypes, batch)
    assert _count(graph.jaxpr) == 3
    result = _fuse(graph)
    eqns = _top_level(result.graph.jaxpr.jaxpr)
    assert sorted((str(e.invars[0].aval.dtype), e.invars[0].aval.shape) for e in eqns) == [
        ("float32", (3 + 2 + 1,)),
        ("int32", (2 + 2,)),
    ]
    plan = fusion_report(graph)
    assert [(b.dtype, b.num_operands) for b in plan] == [("float32", 3), ("int32", 2)]
    _compare_runs(fused_repl, _mixed_dtypes, [batch])


def _groups(b):
    x = b["x"]
    return (
        rp.all_sum(x, group="cores"),
        rp.all_sum(x * 2),
        rp.all_sum(x * 3, group="cores"),
        rp.all_sum(x * 4, group="workers"),
        rp.all_sum(x * 5),
    )


def test_different_groups_go_to_separate_buckets(mesh2d):
    """On ``2 x n/2`` the groups differ in size too; on a square mesh only the group keeps them apart."""
    workers, cores = mesh2d
    fused = rp.Replicator(workers, cores, passes=_pipeline())
    batch = {"x": np.arange(cores * 2, dtype=np.float32).reshape(cores, 2) + 1}  # one worker's: a row per core
    graph = _traced(fused, _groups, batch)
    result = _fuse(graph)
    eqns = _top_level(result.graph.jaxpr.jaxpr)
    assert [(e.params["group"], _size(e)) for e in eqns] == [("cores", 4), (None, 4), ("workers", 2)]
    assert all(len(e.invars) == 1 for e in eqns)
    _lower_and_check(result.graph)
    _compare_runs(fused, _groups, [batch])
    # By hand: replica (w, c) holds row c of worker w's batch; the workers' sums differ from the cores' sums.
    x = np.stack([_worker_batch(batch, w)["x"] for w in range(workers)])  # (workers, cores, 2)
    got = rp.local_outputs(fused.run(_groups, lambda ctx: iter([_worker_batch(batch, ctx.worker_id)])))
    want_workers = np.broadcast_to(4 * x.sum(0, keepdims=True), x.shape).reshape(workers * cores, 2)
    want_cores = np.broadcast_to(x.sum(1, keepdims=True), x.shape).reshape(workers * cores, 2)
    assert not np.allclose(want_workers, 4 * want_cores)
    np.testing.assert_allclose(got[3].reshape(want_workers.shape), want_workers, rtol=1e-6)
    np.testing.assert_allclose(got[0].reshape(want_cores.shape), want_cores, rtol=1e-6)


def _ops(b):
    x = b["x"]
    return rp.all_max(x), rp.all_sum(x * 2), rp.all_max(x * 3), rp.all_sum(x * 4), rp.all_mean(x * 5), rp.all_min(x)


@pytest.mark.parametrize(
    "ops, expected",
    [
        (("sum", "mean"), [("max", 1), ("max", 1), ("sum", 2), ("mean", 1), ("min", 1)]),
        (("sum", "mean", "max", "min"), [("max", 2), ("sum", 2), ("mean", 1), ("min", 1)]),
    ],
)
def test_ops_are_keyed_and_only_the_chosen_ones_fused(repl, ops, expected):
    graph = _traced(repl, _ops, {"x": np.zeros((repl.num_replicas, 3), np.float32)})
    result = _fuse(graph, ops=ops)
    eqns = _top_level(result.graph.jaxpr.jaxpr)
    got = [(e.params["op"], _size(e) // 3) for e in eqns]
    assert sorted(got) == sorted(expected)
    _lower_and_check(result.graph)


def test_max_and_min_fusion_numbers(repl, n_devices):
    fused = rp.Replicator(1, n_devices, passes=_pipeline(ops=("sum", "mean", "max", "min")))
    batch = {"x": np.random.default_rng(3).normal(size=(n_devices, 3)).astype(np.float32)}
    _compare_runs(fused, _ops, [batch])


# ----------------------------------------------------------------------------
# Regions: collectives never cross a control-flow boundary
# ----------------------------------------------------------------------------


def _scan_step(b):
    x = b["x"]
    before = rp.all_sum(x[0])

    def body(carry, row):
        return carry + rp.all_sum(row) * rp.all_sum(row * row), None

    total, _ = lax.scan(body, jnp.zeros(3), x)
    after = rp.all_sum(x[1] * 2)  # independent of the scan: joins `before`
    return before, total, after


def test_scan_body_is_fused_on_its_own(repl, fused_repl):
    n = repl.num_replicas
    batch = {"x": np.random.default_rng(4).normal(size=(4 * n, 3)).astype(np.float32)}
    graph = _traced(repl, _scan_step, batch)
    (scan_index,) = [i for i, e in enumerate(graph.jaxpr.jaxpr.eqns) if e.primitive.name == "scan"]
    result = _fuse(graph)
    top = result.graph.jaxpr.jaxpr
    (outer,) = _top_level(top)
    assert [v.aval.shape for v in outer.invars] == [(6,)]
    (scan,) = [e for e in top.eqns if e.primitive.name == "scan"]
    (inner,) = _top_level(scan.params["jaxpr"].jaxpr)
    assert [v.aval.shape for v in inner.invars] == [(6,)]
    assert _count(result.graph.jaxpr) == 2
    assert sorted(b.region for b in fusion_report(graph)) == ["step", f"step/scan@{scan_index}.0"]
    _lower_and_check(result.graph)
    _compare_runs(fused_repl, _scan_step, [batch])


def _two(x):
    return rp.all_sum(x) + rp.all_sum(x * 2)


def _in_jit(b):
    return jax.jit(_two)(b["x"])


def _in_cond(b):
    """Both branches fuse; the predicate is a runtime value identical on every replica (an all_min)."""
    return lax.cond(rp.all_min(b["x"][0, 0]) >= 0, _two, lambda x: _two(x * 3), b["x"])


def _in_while(b):
    return lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, _two(c[1])), (0, b["x"]))[1]


def _in_checkpoint(b):
    return jax.checkpoint(_two)(b["x"])


def _in_custom_vjp(b):
    f = jax.custom_vjp(_two)
    f.defvjp(lambda x: (_two(x), None), lambda _, ct: (ct,))
    return f(b["x"])


@pytest.mark.parametrize(
    "fn, container, bodies, top",
    [
        (_in_jit, "jit", 1, 0),
        (_in_cond, "cond", 2, 1),  # top: the predicate's all_min (not fusable)
        (_in_while, "while", 1, 0),
        (_in_checkpoint, "remat2", 1, 0),
        (_in_custom_vjp, "custom_vjp_call", 1, 0),
    ],
)
def test_every_sub_jaxpr_is_a_region(repl, fn, container, bodies, top):
    graph = _traced(repl, fn, {"x": np.zeros((repl.num_replicas, 3), np.float32)})
    assert container in count_primitives(graph.jaxpr)
    assert _count(graph.jaxpr) == 2 * bodies + top
    result = _fuse(graph)
    assert result.changed
    assert _count(result.graph.jaxpr) == bodies + top
    assert [e.params["op"] for e in _top_level(result.graph.jaxpr.jaxpr)] == ["min"] * top
    _lower_and_check(result.graph)


@pytest.mark.parametrize("branch", ["true", "false"])
def test_cond_branches_numbers(repl, fused_repl, branch):
    """Each fused branch runs (the predicate is all_min(x[0, 0]) >= 0) and matches the reference."""
    n = repl.num_replicas
    batch = {"x": np.arange(n * 3, dtype=np.float32).reshape(n, 3) - (branch == "false")}
    _compare_runs(fused_repl, _in_cond, [batch])
    # By hand: one row per replica; _two(x) = sum(x) + sum(2 x), and the false branch triples x.
    want = 3 * batch["x"].sum(0) * (1 if branch == "true" else 3)
    got = rp.local_outputs(fused_repl.run(_in_cond, _repeat(batch)))
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)


def test_effects_flush_the_window(repl):
    def step(b):
        a = rp.all_sum(b["x"])
        jax.debug.print("between")
        return a, rp.all_sum(b["x"] * 2)

    graph = _traced(repl, step, {"x": np.zeros((repl.num_replicas, 3), np.float32)})
    result = _fuse(graph)
    assert not result.changed and result.graph is graph
    assert _count(result.graph.jaxpr) == 2


# ----------------------------------------------------------------------------
# Pass contract
# ----------------------------------------------------------------------------


def test_fusing_a_fused_graph_changes_nothing(plain_repl, n_devices):
    graph = _traced(plain_repl, _mlp_step, _mlp_batches(n_devices, 1)[0], _params())
    once = _fuse(graph).graph
    again = _fuse(once)
    assert not again.changed and again.graph is once
    plan = fusion_report(once)
    assert [(b.num_operands, b.fused) for b in plan] == [(1, False)]


def test_fusion_report_lists_bucket_membership(plain_repl, n_devices):
    graph = _traced(plain_repl, _mlp_step, _mlp_batches(n_devices, 1)[0], _params())
    (bucket,) = fusion_report(graph)
    assert bucket.kind == "all_reduce" and len(bucket.sources) == bucket.num_operands
    assert (bucket.region, bucket.op, bucket.group, bucket.dtype, bucket.fused) == (
        "step",
        "mean",
        None,
        "float32",
        True,
    )
    assert bucket.num_operands == MLP_LEAVES and bucket.nbytes == 4 * MLP_FLOATS
    assert sorted(bucket.shapes) == sorted([(WIDTH, WIDTH)] * N_LAYERS + [(WIDTH,)] * N_LAYERS + [()])
    assert all("test_fuse_collectives.py" in s for s in bucket.sources)
    # Each operand names its own collective: the per-leaf gradient means (one line), then the loss's mean.
    lines, start = inspect.getsourcelines(_mlp_step)
    grads_line = start + next(i for i, t in enumerate(lines) if "rp.all_mean(g)" in t)
    loss_line = start + next(i for i, t in enumerate(lines) if "rp.all_mean(loss)" in t)
    source_lines = [int(re.search(r"\.py:(\d+)", s).group(1)) for s in bucket.sources]
    assert sorted(source_lines) == sorted([grads_line] * (MLP_LEAVES - 1) + [loss_line])


def test_repr_names_the_configuration_and_bad_configs_raise():
    assert repr(FuseCollectives()) == (
        f"FuseCollectives(threshold_bytes={DEFAULT_THRESHOLD_BYTES}, ops=('sum', 'mean'), scatter_gather=True, "
        f"max_tensor_bytes={DEFAULT_MAX_TENSOR_BYTES})"
    )
    assert _pipeline(scatter_gather=False).key() != _pipeline().key()
    assert FuseCollectives.name == "fuse-collectives" and not FuseCollectives.required
    assert _pipeline().key() != _pipeline(threshold_bytes=1024).key()
    assert _pipeline(ops=("sum",)).key() != _pipeline().key()
    with pytest.raises(ValueError, match="positive"):
        FuseCollectives(threshold_bytes=0)
    with pytest.raises(TypeError, match="int"):
        FuseCollectives(threshold_bytes=1.5)
    with pytest.raises(ValueError, match="unknown ops"):
        FuseCollectives(ops=("sum", "prod"))


def test_one_pytree_all_reduce_is_flattened_into_one_buffer(fused_repl, n_devices):
    """A single all_sum of many leaves would be a tuple all-reduce: fuse it too."""
    shapes = [(3,), (2, 2), (5,), (1, 4), ()]

    def step(b):
        leaves = [jnp.ones(s) * b["x"].sum() * (i + 1) for i, s in enumerate(shapes)]
        return rp.all_sum(leaves)

    batch = {"x": np.arange(2 * n_devices, dtype=np.float32)}
    graph = _traced(fused_repl, step, batch)
    (eqn,) = _top_level(graph.jaxpr.jaxpr)
    assert len(eqn.invars) == len(shapes)
    result = _fuse(graph)
    assert result.changed
    (fused,) = _top_level(result.graph.jaxpr.jaxpr)
    assert len(fused.invars) == 1 and _size(fused) == sum(math.prod(s) for s in shapes)
    assert _count(_lower_and_check(result.graph).jaxpr, "psum") == 1
    assert not FuseCollectives().run(result.graph).changed
    _compare_runs(fused_repl, step, [batch])


def test_a_collective_reading_a_bucket_output_directly(fused_repl, n_devices):
    """all_sum(all_sum(x)): the second reads the first's (fused) result itself."""

    def step(b):
        x = b["x"]
        first, second = rp.all_sum(x), rp.all_sum(2 * x)  # one fused bucket
        return rp.all_sum(first), rp.all_sum(second), rp.all_sum(second * 1.0)

    batch = {"x": np.arange(2 * n_devices, dtype=np.float32)}
    graph = _traced(fused_repl, step, batch)
    result = _fuse(graph)  # type-checks the fused graph
    _lower_and_check(result.graph)
    _compare_runs(fused_repl, step, [batch])


def test_tensors_above_max_tensor_bytes_keep_their_own_collective(n_devices):
    big, small = (64, 64), (3,)  # 16 KiB and 12 B of float32

    def step(b):
        s = b["x"].sum()
        return rp.all_sum([jnp.ones(big) * s, jnp.ones(small) * s, jnp.ones(big) * 2 * s, jnp.ones(small) * 3 * s])

    repl = rp.Replicator(1, n_devices, passes=_pipeline())
    graph = _traced(repl, step, {"x": np.ones(n_devices, np.float32)})
    fused = FuseCollectives(max_tensor_bytes=1024).run(graph).graph
    sizes = sorted(_size(e) for e in _top_level(fused.jaxpr.jaxpr))
    assert sizes == [6, 64 * 64, 64 * 64]  # the two small ones share a bucket
    everything = FuseCollectives(max_tensor_bytes=None).run(graph).graph
    assert [_size(e) for e in _top_level(everything.jaxpr.jaxpr)] == [2 * 64 * 64 + 6]
    with pytest.raises(ValueError, match="max_tensor_bytes"):
        FuseCollectives(max_tensor_bytes=-1)


# ----------------------------------------------------------------------------
# Just outside the precondition: left alone
# ----------------------------------------------------------------------------


def _assert_left_alone(graph, **kwargs):
    before = count_primitives(graph.jaxpr)
    result = _fuse(graph, **kwargs)
    assert not result.changed and result.graph is graph
    assert count_primitives(result.graph.jaxpr) == before
    assert fusion_report(graph, FuseCollectives(**kwargs)) == fusion_report(result.graph, FuseCollectives(**kwargs))


def test_weak_and_strong_types_stay_apart(repl):
    """Same dtype, different weak type: one buffer would change a value's type."""
    graph = _traced(repl, lambda b: (rp.all_sum(1.0), rp.all_sum(b["x"][0, 0])), _eight_batch(repl.num_replicas))
    assert [v.aval.weak_type for e in _top_level(graph.jaxpr.jaxpr) for v in e.invars] == [True, False]
    _assert_left_alone(graph)


@pytest.mark.parametrize("container", ["jit", "cond", "scan"])
def test_dependence_through_a_sub_jaxpr_is_not_fused(repl, container):
    """The second all-reduce reads the first's result through a call or control flow."""

    def double(v):
        if container == "jit":
            return jax.jit(lambda u: u * 2)(v)
        if container == "cond":
            return lax.cond(v.sum() >= 0, lambda u: u * 2, lambda u: u, v)  # v is identical on every replica
        return lax.scan(lambda c, _: (c * 2, None), v, None, length=1)[0]

    def step(b):
        first = rp.all_sum(b["x"])
        return first, rp.all_sum(double(first))

    graph = _traced(repl, step, {"x": np.zeros((repl.num_replicas, 3), np.float32)})
    assert _count(graph.jaxpr) == 2
    _assert_left_alone(graph)


def test_scatters_off_axis_0_and_untiled_gathers_are_not_fused(repl):
    n = repl.num_replicas

    def step(b):
        x = b["x"]  # (2, 4 n)
        return (
            rp.reduce_scatter(x, axis=1),
            rp.reduce_scatter(x * 2, axis=1),
            rp.all_gather(x),
            rp.all_gather(x * 2),
            rp.all_gather(x, axis=1, tiled=True),
            rp.all_gather(x * 3, axis=1, tiled=True),
        )

    graph = _traced(repl, step, {"x": np.zeros((2 * n, 4 * n), np.float32)})
    _assert_left_alone(graph)
