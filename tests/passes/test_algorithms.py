"""lower-collectives algorithms: ring and reduce-broadcast all-reduce from ppermute.

Graph checks look at what each algorithm lowers to (ppermute over the group's
axes, no psum); numeric checks run the same step through ``Replicator.run``
with the default pipeline and with the algorithm, on several mesh shapes
(including non-power-of-two groups), and compare every output. Both
algorithms reduce every element on one replica and copy it, so results must
also be bitwise identical across the replicas of a group.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from utils import check_against_simulation, sum_rounding_scale, worker_batches

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.core.primitives import all_reduce_p
from replicator.passes import LowerCollectives, PassManager, count_primitives, default_passes, verify_graph
from replicator.passes.lower_collectives import ALGORITHMS, LOWERINGS, lower_all_reduce

from .workloads import input_fn_from, mlp_batch, mlp_params, mlp_step

ALGORITHM_NAMES = ["ring", "reduce_broadcast"]
RTOL, ATOL = 2e-6, 1e-6  # float32; bf16 is checked against its rounding bound instead


def _pipeline(algorithm: str) -> PassManager:
    passes = default_passes()
    at = [p.name for p in passes].index("lower-collectives")
    passes[at] = LowerCollectives(algorithms={"all_reduce": algorithm})
    return PassManager(passes, verify=True)


_REPLICATORS: dict = {}


def _replicator(workers: int, cores: int, algorithm: str | None) -> rp.Replicator:
    """A cached Replicator on a ``workers x cores`` mesh (``None``: the default pipeline)."""
    key = (workers, cores, algorithm)
    if key not in _REPLICATORS:
        passes = None if algorithm is None else _pipeline(algorithm)
        _REPLICATORS[key] = rp.Replicator(workers, cores, passes=passes)
    return _REPLICATORS[key]


def _mesh(shape: str, n_devices: int) -> tuple[int, int]:
    """``'1xN'``, ``'2xN/2'`` or ``'2x3'`` on this many devices (skip if it does not fit)."""
    if shape == "1xN":
        return 1, n_devices
    if shape == "2xN/2":
        if n_devices % 2 or n_devices < 4:
            pytest.skip("needs an even number of devices >= 4")
        return 2, n_devices // 2
    if n_devices < 6:
        pytest.skip("needs 6 devices")
    return 2, 3


def _check_with_reference(repl, step, make_batch, seed=0, steps=1, state=None):
    """Run ``step`` on ``repl`` with ``input_fn_from(make_batch, seed)``; compare each step with the reference.

    The reference (``tests.utils.simulate``) runs every replica at once under
    ``jax.vmap`` with ``jax.lax`` collectives: none of the library's passes or
    lowerings. Floats within ``ATOL + RTOL |want|``; other dtypes equal.
    """
    batches = worker_batches(input_fn_from(make_batch, seed), repl.num_workers, repl.cores_per_worker, steps)
    scale = sum_rounding_scale(repl.num_replicas)
    return check_against_simulation(repl, step, batches, state, atol=ATOL * scale, rtol=RTOL * scale)


def _assert_equal_within_groups(out, workers, cores, group):
    """Per-replica outputs are bitwise equal across the replicas of each group."""
    out = np.asarray(out).reshape(workers, cores, *np.shape(out)[1:])
    if group is None:
        ref = out[:1, :1]
    elif group == "cores":
        ref = out[:, :1]
    else:
        ref = out[:1, :]
    np.testing.assert_array_equal(out, np.broadcast_to(ref, out.shape))


# ----------------------------------------------------------------------------
# The graph
# ----------------------------------------------------------------------------


def _batch(n, cols=5):
    return {"x": np.zeros((2 * n, cols), np.float32)}


def _ppermutes(graph):
    return [e for e in iter_eqns(graph.jaxpr.jaxpr) if e.primitive.name == "ppermute"]


@pytest.mark.parametrize("group", [None, "cores", "workers"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_ring_is_ppermutes_to_the_successor_and_no_psum(repl2d, group, op):
    repl = _replicator(repl2d.num_workers, repl2d.cores_per_worker, "ring")
    fn = {"sum": rp.all_sum, "mean": rp.all_mean, "max": rp.all_max}[op]
    lowered = repl.lower(lambda b: fn(b["x"], group=group), _batch(repl.cores_per_worker))
    final = lowered.final
    counts = count_primitives(final.jaxpr)
    assert counts.get("psum", 0) == counts.get("pmax", 0) == 0
    n = repl.context.group_size(group)
    axes = ("workers", "cores") if group is None else (group,)
    eqns = _ppermutes(final)
    if n == 1:
        assert eqns == []
        return
    # One ppermute in each of the two loops (reduce-scatter, all-gather) of N - 1 steps.
    assert len(eqns) == 2 and counts["scan"] == 2
    scans = [e for e in iter_eqns(final.jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert [s.params["length"] for s in scans] == [n - 1, n - 1]
    ring = tuple((i, (i + 1) % n) for i in range(n))
    for eqn in eqns:
        assert tuple(eqn.params["axis_name"]) == axes and tuple(eqn.params["perm"]) == ring
        (chunk,) = eqn.invars
        assert chunk.aval.shape == (1, math.ceil(10 / n))  # one of N chunks of the padded 2x5 buffer
    verify_graph(final, lowered=True)


def test_reduce_broadcast_is_two_trees_over_any_group_size(n_devices):
    if n_devices < 6:
        pytest.skip("needs 6 devices")
    repl = rp.Replicator(1, 6, passes=_pipeline("reduce_broadcast"))
    final = repl.lower(lambda b: rp.all_sum(b["x"]), _batch(6)).final
    assert count_primitives(final.jaxpr).get("psum", 0) == 0
    perms = [tuple(e.params["perm"]) for e in _ppermutes(final)]
    assert perms == [
        ((1, 0), (3, 2), (5, 4)),  # reduce: distance 1
        ((2, 0),),  # distance 2 (replica 4 has no partner at 6)
        ((4, 0),),  # distance 4: replica 0 holds the total
        ((0, 4),),  # broadcast back down the tree
        ((0, 2),),
        ((0, 1), (2, 3), (4, 5)),
    ]
    for eqn in _ppermutes(final):
        assert eqn.invars[0].aval.shape == (10,)  # the whole buffer every step


def test_operands_share_one_buffer_per_dtype(repl):
    pipe_repl = _replicator(1, repl.cores_per_worker, "ring")

    def step(b):
        x = b["x"]
        return rp.all_sum({"a": x, "b": x[:, :2] * 2, "i": x.astype(jnp.int32), "e": x[:0]})

    final = pipe_repl.lower(step, _batch(repl.cores_per_worker)).final
    shapes = sorted((str(e.invars[0].aval.dtype), e.invars[0].aval.size) for e in _ppermutes(final))
    n = repl.num_replicas
    if n == 1:
        assert shapes == []
        return
    f32_chunk, i32_chunk = math.ceil((10 + 4) / n), math.ceil(10 / n)
    assert shapes == sorted([("float32", f32_chunk)] * 2 + [("int32", i32_chunk)] * 2)


def test_other_collectives_and_the_default_are_unchanged(repl2d):
    def step(b):
        x = b["x"]
        return rp.all_gather(x), rp.reduce_scatter(x, axis=1, group="cores"), rp.broadcast(x), rp.replica_id()

    batch = _batch(repl2d.cores_per_worker, cols=repl2d.cores_per_worker)
    ring = _replicator(repl2d.num_workers, repl2d.cores_per_worker, "ring").lower(step, batch).final
    native = repl2d.lower(step, batch).final
    assert count_primitives(ring.jaxpr) == count_primitives(native.jaxpr)
    assert LowerCollectives().algorithms == {"all_reduce": "native"}
    assert LOWERINGS[all_reduce_p] is ALGORITHMS[all_reduce_p]["native"] is lower_all_reduce


def test_lowering_a_lowered_graph_changes_nothing(repl):
    graph = repl.lower(lambda b: rp.all_sum(b["x"]), _batch(repl.num_replicas)).traced
    once = LowerCollectives(algorithms={"all_reduce": "ring"}).run(graph)
    assert once.changed
    again = LowerCollectives(algorithms={"all_reduce": "ring"}).run(once.graph)
    assert not again.changed and again.graph is once.graph


# ----------------------------------------------------------------------------
# The numbers
# ----------------------------------------------------------------------------


def _every_op_and_group(b):
    x, i = b["x"], b["i"]
    return {
        "sum": rp.all_sum(x),  # f32[r, 7]: 7r elements, padded to a multiple of N
        "mean_cores": rp.all_mean(x[:, :3] * 2, group="cores"),
        "sum_workers": rp.all_sum(x[:, 1:] - 1, group="workers"),
        "max": rp.all_max(x),
        "min_cores": rp.all_min(x, group="cores"),
        "max_workers": rp.all_max(x, group="workers"),
        "scalar": rp.all_mean(jnp.sum(x)),
        "int": rp.all_sum(i),
        "int_max": rp.all_max(i * 3 - 5),
        "bool": rp.all_max(i > 4),
        "bool_min": rp.all_min(i > 1, group="cores"),
        "mixed": rp.all_max({"a": x[:, :2], "i": i, "b": i > 3}, group="cores"),
        "mixed_sum": rp.all_sum({"a": x[:, :2], "i": i, "s": x[0, 0]}),
    }


def _op_batch(cores):
    return lambda rng: {
        "x": rng.normal(size=(cores, 7)).astype(np.float32),
        "i": rng.integers(0, 7, size=(cores, 3)).astype(np.int32),
    }


GROUP_OF = {
    "mean_cores": "cores",
    "sum_workers": "workers",
    "min_cores": "cores",
    "max_workers": "workers",
    "bool_min": "cores",
    "mixed": "cores",
}


@pytest.mark.parametrize("shape", ["1xN", "2xN/2", "2x3"])
@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_every_op_group_and_dtype_matches_the_reference(n_devices, shape, algorithm):
    workers, cores = _mesh(shape, n_devices)
    algo = _replicator(workers, cores, algorithm)
    for seed in range(2):
        _, (actual,) = _check_with_reference(algo, _every_op_and_group, _op_batch(cores), seed)
        for name, out in actual.items():
            for leaf in jax.tree.leaves(out):
                _assert_equal_within_groups(leaf, workers, cores, GROUP_OF.get(name))


def _bf16_sums(b):
    x = b["x"].astype(jnp.bfloat16)
    return rp.all_sum(x), rp.all_mean({"f": b["x"], "h": x}, group="cores")


@pytest.mark.parametrize("algorithm", ["native", *ALGORITHM_NAMES])
def test_bf16_within_the_rounding_bound_of_the_exact_sum(repl2d, algorithm):
    """Summed in bf16 in some order: ``|s^ - s| <= gamma_(N-1) * sum|x_i|``, ``gamma_k = k u / (1 - k u)``.

    ``u = 2**-8``; a mean adds one more rounding (the division), ``u |m|``.
    The bound holds for any summation order, so it checks every algorithm
    against the exact sum of the same bf16 inputs.
    """
    workers, cores = repl2d.num_workers, repl2d.cores_per_worker
    make_batch = _op_batch(cores)
    total, by_core = _replicator(workers, cores, None if algorithm == "native" else algorithm).run(
        _bf16_sums, input_fn_from(make_batch, seed=3)
    )
    # Each worker's batch as its input_fn yields it, cut into per-replica rows.
    rngs = [np.random.default_rng((3, w)) for w in range(workers)]
    x = np.stack([make_batch(rng)["x"] for rng in rngs]).reshape(workers, cores, 1, 7)
    xb = x.astype(jnp.bfloat16).astype(np.float64)
    u = 2.0**-8

    def gamma(k):
        return k * u / (1 - k * u)

    n = workers * cores
    exact, abs_sum = xb.sum((0, 1)), np.abs(xb).sum((0, 1))
    for replica in np.asarray(total, np.float64):
        assert np.all(np.abs(replica - exact) <= gamma(n - 1) * abs_sum)
    exact_mean = xb.sum(1, keepdims=True) / cores  # per worker
    mean_bound = gamma(cores - 1) * np.abs(xb).sum(1, keepdims=True) / cores + u * np.abs(exact_mean) * 1.01
    got = np.asarray(by_core["h"], np.float64).reshape(workers, cores, 1, 7)
    assert np.all(np.abs(got - exact_mean) <= mean_bound)
    np.testing.assert_allclose(
        np.asarray(by_core["f"]).reshape(workers, cores, 1, 7),
        np.broadcast_to(x.sum(1, keepdims=True) / cores, (workers, cores, 1, 7)),
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_mlp_gradients_match_the_reference(repl2d, algorithm):
    workers, cores = repl2d.num_workers, repl2d.cores_per_worker
    state = mlp_params(np.random.default_rng(0))
    final, _ = _check_with_reference(
        _replicator(workers, cores, algorithm), mlp_step, mlp_batch(cores), seed=7, steps=2, state=state
    )
    assert int(final["steps"]) == 2
    assert not np.allclose(np.asarray(final["w1"]), np.asarray(state["w1"]))


def _control_flow(b):
    x = b["x"]

    def body(carry, row):
        return carry + rp.all_sum(row) * rp.all_max(row, group="cores"), None

    total, _ = lax.scan(body, jnp.zeros(7), x)
    # A runtime predicate, identical on every replica: whether any replica's flag is set.
    on = rp.all_max(b["flag"][0, 0]) > 0
    branch = lax.cond(on, lambda y: rp.all_mean(y * 2), lambda y: rp.all_sum(y, group="cores") - 1, x[0])
    return total, branch


@pytest.mark.parametrize("branch", ["true", "false"])
@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_inside_scan_and_cond(repl2d, algorithm, branch):
    """Collectives in a scan body and in both branches of a cond (each branch run in turn)."""
    workers, cores = repl2d.num_workers, repl2d.cores_per_worker
    rows = _op_batch(cores * 3)  # three rows per replica: three scan steps

    def make_batch(rng):
        flag = np.zeros((cores * 3, 1), np.int32)
        flag[-3] = branch == "true"  # the last core's first row only: the all_max spreads it
        return {**rows(rng), "flag": flag}

    algo = _replicator(workers, cores, algorithm)
    final = algo.lower(_control_flow, make_batch(np.random.default_rng(0))).final
    assert count_primitives(final.jaxpr).get("psum", 0) == 0
    _, (outputs,) = _check_with_reference(algo, _control_flow, make_batch)
    # The branch taken, by hand: replica r's first row x0; the true branch is the mean of 2 x0 over all replicas.
    x0 = worker_batches(input_fn_from(make_batch), workers, cores, 1)[0]["x"].reshape(workers, cores, 3, 7)[:, :, 0]
    if branch == "true":
        want = np.broadcast_to(2 * x0.mean((0, 1)), x0.shape)
    else:
        want = np.broadcast_to(x0.sum(1, keepdims=True), x0.shape) - 1
    np.testing.assert_allclose(outputs[1].reshape(x0.shape), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Against numpy: every replica simulated, one leading axis each for workers and cores
# ----------------------------------------------------------------------------

_GROUP_AXES = {None: (0, 1), "cores": 1, "workers": 0}


def _narrow_types(b):
    """Integer sums that wrap around, unsigned and signed max/min, booleans, float16."""
    out = {}
    for group in _GROUP_AXES:
        out[f"i8_sum/{group}"] = rp.all_sum(b["i8"], group=group)
        out[f"u8_min/{group}"] = rp.all_min(b["u8"], group=group)
        out[f"i8_max/{group}"] = rp.all_max(b["i8"], group=group)
        out[f"b_max/{group}"] = rp.all_max(b["f"] > 1.0, group=group)
        out[f"b_min/{group}"] = rp.all_min(b["f"] > -1.0, group=group)
        out[f"h_sum/{group}"] = rp.all_sum(b["f"].astype(jnp.float16), group=group)
        out[f"f_mean/{group}"] = rp.all_mean(b["f"], group=group)
    return out


def _narrow_batch(cores):
    return lambda rng: {
        "i8": rng.integers(-128, 128, size=(cores, 5)).astype(np.int8),
        "u8": rng.integers(0, 256, size=(cores, 5)).astype(np.uint8),
        "f": rng.normal(size=(cores, 5)).astype(np.float32),
    }


def _narrow_reference(x: dict) -> dict:
    """What every replica should hold; ``x[k]`` is ``(workers, cores, 5)``."""
    out = {}
    for group, axes in _GROUP_AXES.items():

        def reduce(a, fn, axes=axes):
            return np.broadcast_to(fn(a, axis=axes, keepdims=True), a.shape)

        out[f"i8_sum/{group}"] = reduce(x["i8"], lambda a, **k: a.sum(dtype=np.int8, **k))  # wraps mod 256
        out[f"u8_min/{group}"] = reduce(x["u8"], np.min)
        out[f"i8_max/{group}"] = reduce(x["i8"], np.max)
        out[f"b_max/{group}"] = reduce(x["f"] > 1.0, np.max)
        out[f"b_min/{group}"] = reduce(x["f"] > -1.0, np.min)
        out[f"h_sum/{group}"] = reduce(x["f"].astype(np.float16).astype(np.float64), np.sum)
        out[f"f_mean/{group}"] = reduce(x["f"].astype(np.float64), np.mean)
    return out


@pytest.mark.parametrize("shape", ["2xN/2", "2x3", "1x7"])
@pytest.mark.parametrize("algorithm", ["native", *ALGORITHM_NAMES])
def test_narrow_dtypes_and_odd_group_sizes_match_numpy(n_devices, shape, algorithm):
    """Each algorithm on non-power-of-two groups (3, 7), wrapping int8 sums, uint8, bool and float16."""
    if shape == "1x7":
        if n_devices < 7:
            pytest.skip("needs 7 devices")
        workers, cores = 1, 7
    else:
        workers, cores = _mesh(shape, n_devices)
    make_batch = _narrow_batch(cores)
    got = _replicator(workers, cores, None if algorithm == "native" else algorithm).run(
        _narrow_types, input_fn_from(make_batch, seed=5)
    )
    rngs = [np.random.default_rng((5, w)) for w in range(workers)]
    batches = [make_batch(rng) for rng in rngs]
    x = {k: np.stack([b[k] for b in batches]) for k in batches[0]}  # (workers, cores, 5): one row per replica
    for name, want in _narrow_reference(x).items():
        have = np.asarray(got[name]).reshape(workers, cores, 5)
        if name.startswith("h_"):
            assert have.dtype == np.float16
            np.testing.assert_allclose(have, want, rtol=1e-2, atol=1e-2, err_msg=name)
        elif name.startswith("f_"):
            np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            assert have.dtype == want.dtype, name
            np.testing.assert_array_equal(have, want, err_msg=name)


# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------


def test_repr_is_the_configuration_and_bad_configs_raise():
    assert repr(LowerCollectives()) == "LowerCollectives(algorithms={'all_reduce': 'native'})"
    assert repr(LowerCollectives(algorithms={"all_reduce": "ring"})) == (
        "LowerCollectives(algorithms={'all_reduce': 'ring'})"
    )
    assert LowerCollectives.required and LowerCollectives.name == "lower-collectives"
    keys = {_pipeline(a).key() for a in ["native", *ALGORITHM_NAMES]}
    assert len(keys) == 3
    assert _pipeline("native").key() == PassManager(verify=True).key()
    with pytest.raises(ValueError, match="unknown algorithm 'tree' for all_reduce; choose from"):
        LowerCollectives(algorithms={"all_reduce": "tree"})
    with pytest.raises(ValueError, match=r"no algorithms for \['all_gather'\]"):
        LowerCollectives(algorithms={"all_gather": "ring"})
