"""compress-communication: float32 all-reduce payloads travel as bf16.

Graph checks look at the casts around the placeholder and at what is left
alone; numeric checks compare the compressed all-reduce with the exact sum
(float64 on the host) against the error bound derived in
``replicator/passes/compress.py``:
``|s^ - s| <= gamma_N * sum_i |x_i|``, ``gamma_N = N u / (1 - N u)``,
``u = 2**-8``. They also check that the bound is not vacuous: the compressed
result differs from the float32 one by far more than float32 rounding, and
its error reaches ``u * sum|x_i|``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from utils import simulate

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.passes import (
    CompressCommunication,
    HierarchicalAllReduce,
    PassManager,
    count_primitives,
    default_passes,
    verify_graph,
)
from replicator.passes.compress import error_bound

ALL_REDUCE = "rp.all_reduce"
U_BF16 = 2.0**-8  # bf16: 8-bit significand, round to nearest
U_F32 = 2.0**-24
F16_TINY = 2.0**-14  # float16's smallest normal number


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _passes(*extra) -> list:
    """The default passes with ``extra`` right after fuse-collectives."""
    passes = default_passes()
    at = [p.name for p in passes].index("fuse-collectives") + 1
    passes[at:at] = list(extra)
    return passes


_REPLICATORS: dict = {}


def _replicator(workers: int, cores: int, *extra) -> rp.Replicator:
    key = (workers, cores, tuple(repr(p) for p in extra))
    if key not in _REPLICATORS:
        passes = PassManager(_passes(*extra), verify=True) if extra else None
        _REPLICATORS[key] = rp.Replicator(workers, cores, passes=passes)
    return _REPLICATORS[key]


def _eqns(graph, name):
    return [e for e in iter_eqns(graph.jaxpr.jaxpr) if e.primitive.name == name]


def _compress(graph, **config):
    text = str(graph.jaxpr)
    result = CompressCommunication(**config).run(graph)
    assert str(graph.jaxpr) == text
    verify_graph(result.graph, lowered=False)
    return result


def _batch(cores, cols=5):
    return {"x": np.zeros((2 * cores, cols), np.float32)}


def _fixed_input(x):
    """Every worker yields ``x[w]`` (its rows are split over its cores)."""

    def input_fn(ctx):
        while True:
            yield {"x": x[ctx.worker_id]}

    return input_fn


# ----------------------------------------------------------------------------
# The graph
# ----------------------------------------------------------------------------


def test_off_by_default():
    assert "compress-communication" not in PassManager().names
    assert not any(isinstance(p, CompressCommunication) for p in default_passes())


def test_float32_mean_is_cast_around_a_bf16_sum(repl):
    graph = repl.lower(lambda b: rp.all_mean(b["x"]), _batch(repl.num_replicas)).traced
    result = _compress(graph)
    assert result.changed
    eqns = result.graph.jaxpr.jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["convert_element_type", ALL_REDUCE, "convert_element_type", "div"]
    to_wire, reduce, back, div = eqns
    assert to_wire.params["new_dtype"] == jnp.bfloat16 and back.params["new_dtype"] == jnp.float32
    assert reduce.params["op"] == "sum" and reduce.invars[0].aval.dtype == jnp.bfloat16
    assert div.invars[0].aval.dtype == jnp.float32 and float(div.invars[1].val) == repl.num_replicas


def test_only_float32_operands_are_compressed(repl):
    def step(b):
        x = b["x"]
        tree = {"f": x, "i": x.astype(jnp.int32), "h": x.astype(jnp.float16), "b": x.astype(jnp.bfloat16)}
        return rp.all_sum(tree), rp.all_max(x), rp.all_min(x), rp.all_sum(x.astype(jnp.int32) * 2)

    graph = repl.lower(step, _batch(repl.num_replicas)).traced
    result = _compress(graph)
    reduces = _eqns(result.graph, ALL_REDUCE)
    assert [(e.params["op"], [str(v.aval.dtype) for v in e.invars]) for e in reduces] == [
        ("sum", ["bfloat16", "bfloat16", "float16", "int32"]),  # leaves b, f, h, i: one collective still
        ("max", ["float32"]),
        ("min", ["float32"]),
        ("sum", ["int32"]),
    ]
    assert (
        count_primitives(result.graph.jaxpr)["convert_element_type"]
        - count_primitives(graph.jaxpr).get("convert_element_type", 0)
        == 2
    )


def test_nothing_to_compress_is_unchanged(repl):
    graph = repl.lower(lambda b: rp.all_max(b["x"]), _batch(repl.num_replicas)).traced
    result = _compress(graph)
    assert not result.changed and result.graph is graph


def test_compressing_a_compressed_graph_changes_nothing(repl):
    graph = repl.lower(lambda b: rp.all_mean(b["x"]), _batch(repl.num_replicas)).traced
    once = _compress(graph)
    again = _compress(once.graph)
    assert once.changed and not again.changed and again.graph is once.graph


def test_wire_dtype_and_groups(repl2d):
    def step(b):
        return rp.all_sum(b["x"]), rp.all_sum(b["x"], group="cores"), rp.all_sum(b["x"], group="workers")

    graph = repl2d.lower(step, _batch(repl2d.cores_per_worker)).traced
    result = _compress(graph, wire_dtype=jnp.float16, groups=("workers",))
    dtypes = {e.params["group"]: str(e.invars[0].aval.dtype) for e in _eqns(result.graph, ALL_REDUCE)}
    assert dtypes == {None: "float32", "cores": "float32", "workers": "float16"}


def test_after_hierarchical_only_the_inter_worker_step_is_compressed(repl2d):
    workers, cores = repl2d.num_workers, repl2d.cores_per_worker
    if workers < 2 or cores < 2:
        pytest.skip("needs two workers with two or more cores each")
    passes = default_passes()
    at = [p.name for p in passes].index("lower-collectives")
    passes[at:at] = [HierarchicalAllReduce(), CompressCommunication(groups=("workers",))]
    lowered = rp.Replicator(workers, cores, passes=PassManager(passes, verify=True)).lower(
        lambda b: rp.all_mean(b["x"]), _batch(cores)
    )
    graph = lowered.after("compress-communication")
    ((scatter_dtype,),) = [[str(v.aval.dtype) for v in e.invars] for e in _eqns(graph, "rp.reduce_scatter")]
    ((reduce_dtype,),) = [[str(v.aval.dtype) for v in e.invars] for e in _eqns(graph, ALL_REDUCE)]
    assert (scatter_dtype, reduce_dtype) == ("float32", "bfloat16")
    (psum,) = _eqns(lowered.final, "psum")
    assert psum.params["axes"] == ("workers",) and psum.invars[0].aval.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------
# The error bound, checked on data
# ----------------------------------------------------------------------------


def test_error_bound_formula():
    assert error_bound(1.0, 8) == pytest.approx(_gamma(8, U_BF16))
    assert error_bound(1.0, 8) == pytest.approx(U_BF16 * 8 / (1 - 8 * U_BF16))  # u * c(N)
    assert error_bound(2.0, 8, op="mean") == pytest.approx((_gamma(8, U_BF16) + U_F32 * (1 + _gamma(8, U_BF16))) / 4)
    # The underflow term, (2N - 1) eta (1 + gamma_N): negligible for bf16, not for f16.
    f16_gamma = _gamma(8, 2.0**-11)
    assert error_bound(1.0, 8, wire_dtype=jnp.float16) == pytest.approx(f16_gamma + 15 * F16_TINY * (1 + f16_gamma))
    assert error_bound(0.0, 8) == pytest.approx(15 * float(jnp.finfo(jnp.bfloat16).tiny) * (1 + _gamma(8, U_BF16)))
    with pytest.raises(ValueError, match="N \\* u < 1"):
        error_bound(1.0, 256)


def _sum_and_mean(b):
    x = b["x"][0]
    return rp.all_sum(x), rp.all_mean(x)


def _check_against_exact(workers, cores, x, *extra):
    """Run compressed and uncompressed; check the bound; return the compressed sum's error / (u sum|x|)."""
    n = workers * cores
    compressed = _replicator(workers, cores, CompressCommunication(), *extra).run(_sum_and_mean, _fixed_input(x))
    plain = _replicator(workers, cores).run(_sum_and_mean, _fixed_input(x))
    x64 = x.astype(np.float64).reshape(n, -1)  # one row per replica
    exact, abs_sum = x64.sum(0), np.abs(x64).sum(0)
    bound = _gamma(n, U_BF16) * abs_sum
    for got_sum, got_mean in zip(*(np.asarray(o, np.float64) for o in compressed), strict=True):
        assert np.all(np.abs(got_sum - exact) <= bound)
        assert np.all(np.abs(got_sum - exact) <= error_bound(abs_sum, n))
        assert np.all(np.abs(got_mean - exact / n) <= error_bound(abs_sum, n, op="mean"))
    # The uncompressed all-reduce is within the float32 bound; the compressed one is not:
    # a pass that did nothing (or compressed to float32) would fail here.
    plain_sum, compressed_sum = np.asarray(plain[0][0], np.float64), np.asarray(compressed[0][0], np.float64)
    assert np.all(np.abs(plain_sum - exact) <= _gamma(n, U_F32) * abs_sum)
    assert np.any(np.abs(compressed_sum - exact) > _gamma(n, U_F32) * abs_sum)
    assert not np.array_equal(compressed_sum, plain_sum)
    return np.abs(compressed_sum - exact) / (U_BF16 * abs_sum)


def test_bound_holds_on_random_data_with_every_replica(n_devices):
    n = n_devices  # 8 by default
    x = np.random.default_rng(0).normal(size=(1, n, 4096)).astype(np.float32)
    ratio = _check_against_exact(1, n, x)
    # The bound is u * sum|x_i| * c(N), c(8) = 8.26; the observed error reaches
    # close to u * sum|x_i| (the rounding of operands and result), so the bound is
    # within a factor c(N) of what happens.
    assert ratio.max() > 0.5


def test_bound_holds_with_hierarchical_all_reduce(repl2d):
    workers, cores = repl2d.num_workers, repl2d.cores_per_worker
    x = np.random.default_rng(1).normal(0, 3, size=(workers, cores, 1001)).astype(np.float32)
    _check_against_exact(workers, cores, x, HierarchicalAllReduce())


def test_the_rounding_of_each_operand_is_reached(n_devices):
    """``1 + 2**-8 + 2**-20`` rounds up to ``1 + 2**-7`` in bf16: each operand's
    error is (almost) ``u`` times its size, and so is the error of the sum."""
    n = n_devices
    x = np.full((1, n, 4), 1 + 2**-8 + 2**-20, np.float32)
    ratio = _check_against_exact(1, n, x)
    assert np.all(ratio > 0.99)


def test_training_with_compression_stays_close_to_the_exact_reference(repl2d):
    workers, cores = repl2d.num_workers, repl2d.cores_per_worker
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    x = rng.normal(size=(workers, 2 * cores, 5)).astype(np.float32)

    def step(w, b):
        grads = jax.grad(lambda w: jnp.mean((b["x"] @ w) ** 2))(w)
        return w - 0.1 * rp.all_mean(grads), {}

    compressed = _replicator(workers, cores, CompressCommunication())
    w_compressed, _ = compressed.run(step, _fixed_input(x), w)
    w_compressed = np.asarray(w_compressed)
    # The exact reference: every replica at once under jax.vmap, float32 jax.lax collectives (tests.utils).
    w_plain, _ = simulate(step, workers, cores, [{"x": x.reshape(-1, 5)}], w)
    w_plain = np.asarray(w_plain)
    assert not np.array_equal(w_plain, w_compressed)
    # One step of lr 0.1: the difference is 0.1 times the gradient's rounding error.
    xs = x.reshape(-1, 2, 5).astype(np.float64)  # one (2, 5) block per replica
    grads = 2 * np.einsum("rbi,rbj->rij", xs, xs @ np.asarray(w, np.float64)) / 6  # d mean((x w)**2) / dw
    bound = 0.1 * error_bound(np.abs(grads).sum(0), workers * cores, op="mean") + 1e-6
    assert np.all(np.abs(w_plain - w_compressed) <= bound)


# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------


def test_repr_is_the_configuration_and_bad_configs_raise():
    assert repr(CompressCommunication()) == (
        "CompressCommunication(wire_dtype='bfloat16', groups=(None, 'cores', 'workers'))"
    )
    assert repr(CompressCommunication(jnp.float16, groups="workers")) == (
        "CompressCommunication(wire_dtype='float16', groups=('workers',))"
    )
    assert CompressCommunication.name == "compress-communication" and not CompressCommunication.required
    assert (
        PassManager(_passes(CompressCommunication())).key()
        != PassManager(_passes(CompressCommunication(jnp.float16))).key()
    )
    with pytest.raises(ValueError, match="narrower than float32"):
        CompressCommunication(wire_dtype=jnp.float32)
    with pytest.raises(ValueError, match="narrower than float32"):
        CompressCommunication(wire_dtype=jnp.int8)
    with pytest.raises(TypeError, match="not a dtype"):
        CompressCommunication(wire_dtype="nonsense")
    with pytest.raises(ValueError, match="unknown groups"):
        CompressCommunication(groups=("hosts",))


# ----------------------------------------------------------------------------
# Just outside the precondition: left alone
# ----------------------------------------------------------------------------


def _one_replica_groups(b):
    x = b["x"][0]
    return rp.all_mean(x, group="workers"), rp.all_sum(x * 2, group="workers")


def test_groups_of_one_replica_are_not_compressed(n_devices):
    """Over a group of one replica nothing travels: casting would only round (regression).

    Before: ``all_mean(x, group='workers')`` on one worker returned ``bf16(x)``,
    1.0 for ``x = 1 + 2**-9``, where the mean of one value is ``x`` itself.
    """
    repl = rp.Replicator(1, n_devices)
    graph = repl.lower(_one_replica_groups, _batch(n_devices)).traced
    before = count_primitives(graph.jaxpr)
    result = _compress(graph)
    assert not result.changed and result.graph is graph
    assert count_primitives(result.graph.jaxpr) == before
    # Numbers: simplify would make these collectives local itself, so run without it.
    pipeline = PassManager.default(shard_optimizer=False, compress=True, disable=["simplify"], verify=True)
    x = np.full((1, 2 * n_devices, 3), 1 + 2**-9, np.float32)
    x[0, :, 1] = np.arange(2 * n_devices) * (1 + 2**-12)  # a different value on each replica
    mean, total = rp.Replicator(1, n_devices, passes=pipeline).run(_one_replica_groups, _fixed_input(x))
    mine = x[0, ::2]  # replica r's first row: the only value in its group
    np.testing.assert_array_equal(np.asarray(mean), mine)
    np.testing.assert_array_equal(np.asarray(total), 2 * mine)


def _with_group_size(graph, group_size):
    """``graph`` with its all-reduce's ``group_size`` changed (a graph as a larger mesh would trace it)."""
    jaxpr = graph.jaxpr.jaxpr
    eqns = [
        e.replace(params={**e.params, "group_size": group_size}) if e.primitive.name == ALL_REDUCE else e
        for e in jaxpr.eqns
    ]
    return graph.with_jaxpr(jax.extend.core.ClosedJaxpr(jaxpr.replace(eqns=eqns), graph.jaxpr.consts))


@pytest.mark.parametrize(
    "group_size, wire_dtype, compressed",
    [
        (255, jnp.bfloat16, True),  # 255 * 2**-8 < 1
        (256, jnp.bfloat16, False),  # N u = 1: no bound
        (256, jnp.float16, True),  # float16's u = 2**-11
        (2048, jnp.float16, False),
    ],
)
def test_groups_too_large_for_the_bound_are_not_compressed(repl, group_size, wire_dtype, compressed):
    graph = repl.lower(lambda b: rp.all_mean(b["x"]), _batch(repl.num_replicas)).traced
    graph = _with_group_size(graph, group_size)
    before = count_primitives(graph.jaxpr)
    result = CompressCommunication(wire_dtype=wire_dtype).run(graph)
    assert result.changed == compressed
    if not compressed:
        assert result.graph is graph and count_primitives(result.graph.jaxpr) == before


def test_float16_underflow_is_within_the_bound(n_devices):
    """Values below float16's range round to zero on the wire: the bound's underflow term covers it.

    ``x = 1e-8`` on every replica: the float16 sum is 0, the exact one ``N * 1e-8``;
    ``gamma_N * sum|x_i|`` alone (the bound without the underflow term) is 255 times too small.
    """
    n = n_devices
    x = np.full((1, n, 4), 1e-8, np.float32)
    total, mean = _replicator(1, n, CompressCommunication(wire_dtype=jnp.float16)).run(_sum_and_mean, _fixed_input(x))
    exact, abs_sum = n * 1e-8, n * 1e-8
    error = np.abs(np.asarray(total, np.float64) - exact)
    assert np.all(np.asarray(total) == 0)
    assert np.all(error > _gamma(n, 2.0**-11) * abs_sum)
    assert np.all(error <= error_bound(abs_sum, n, wire_dtype=jnp.float16))
    mean_error = np.abs(np.asarray(mean, np.float64) - exact / n)
    assert np.all(mean_error <= error_bound(abs_sum, n, wire_dtype=jnp.float16, op="mean"))
