"""Corners of the passes that scripts/mutate.py found untested (benchmarks/results/mutation.md).

Each test kills a mutant that survived the rest of its module's tests; numbers are checked
against ``tests.utils.simulate`` (every replica under ``jax.vmap`` with ``jax.lax`` collectives).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from utils import check_against_simulation, run_step

import replicator as rp
from replicator.analysis.records import estimated_sent_bytes, pass_on_origin
from replicator.core.graph import Origin
from replicator.passes import Pipeline, count_primitives, default_passes
from replicator.passes.shard_optimizer import ShardOptimizerUpdate


def _with_zero(stage: int = 1) -> Pipeline:
    passes = default_passes()
    names = [p.name for p in passes]
    zero = ShardOptimizerUpdate(min_tensor_bytes=0, stage=stage)  # the test tensors are small
    if "shard-optimizer-update" in names:
        passes[names.index("shard-optimizer-update")] = zero
    else:
        passes.insert(names.index("fuse-collectives"), zero)
    return Pipeline(passes, verify=True)


def test_momentum_also_returned_as_an_output_stays_replicated(n_devices):
    """ZeRO stores a leaf sharded only if its new value is returned once (as the new state).

    Momentum ``m`` (read only element-wise, updated from the reduce-scattered gradient) is
    sharded; ``k``, updated the same way but also returned as an output, stays whole.
    """
    if n_devices == 1:
        pytest.skip("needs several replicas")
    w = 2 * n_devices

    def step(state, batch):
        p, m, k = state
        g = rp.all_mean(batch["x"].T @ (batch["x"] @ p))  # a gradient-like all-reduce of a (w, 3) value
        m, k = 0.9 * m + g, 0.5 * k + g
        return (p - 0.1 * m - 0.1 * k, m, k), {"k": k}

    rng = np.random.default_rng(0)
    state = tuple((rng.normal(size=(w, 3)) * 0.1).astype(np.float32) for _ in range(3))
    batches = [{"x": rng.normal(size=(2 * n_devices, w)).astype(np.float32)} for _ in range(3)]
    repl = rp.Replicator(1, n_devices, passes=_with_zero())
    after = repl.lower(step, batches[0], state).after("shard-optimizer-update")
    assert {after.state_paths[i] for i in after.sharded_state} == {"state[1]"}
    check_against_simulation(repl, step, batches, state, atol=1e-6, rtol=1e-5)


def test_stage2_reduces_on_chunks_only_over_the_chunk_axis(n_devices):
    """Stage 2: a sum over the chunk axis of the reduce-scattered gradient is partial sums and an all-reduce;
    a sum over another axis (each row's sum) is not made of chunks: it reads the gradient whole."""
    if n_devices == 1:
        pytest.skip("needs several replicas")
    w = 2 * n_devices

    def step(state, batch):
        p, m = state
        g = rp.all_mean(batch["x"].T @ (batch["x"] @ p))
        m = 0.9 * m + g
        return (p - 0.1 * m, m), {"total": jnp.sum(g, axis=0), "rows": jnp.sum(g, axis=1)}

    rng = np.random.default_rng(0)
    state = tuple((rng.normal(size=(w, 3)) * 0.1).astype(np.float32) for _ in range(2))
    batches = [{"x": rng.normal(size=(2 * n_devices, w)).astype(np.float32)} for _ in range(3)]
    repl = rp.Replicator(1, n_devices, passes=_with_zero(stage=2))
    after = repl.lower(step, batches[0], state).after("shard-optimizer-update")
    assert count_primitives(after.jaxpr, ["rp.reduce_scatter", "rp.all_reduce"]) == {
        "rp.reduce_scatter": 1,  # the gradient
        "rp.all_reduce": 1,  # the partial sums over the chunk axis
    }
    check_against_simulation(repl, step, batches, state, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("per_device", [2, 8])
def test_folded_ppermute_gives_zeros_to_a_replica_no_one_sends_to(per_device):
    """``lax.ppermute`` over a folded axis, a shift without wrap-around: replica 0 receives zeros, as in JAX."""
    repl = rp.Replicator(1, 8, replicas_per_device=per_device, axis_name="batch")
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3) + 1  # no zero rows: a row sent by mistake shows
    perm = [(i, i + 1) for i in range(7)]
    got = run_step(repl, lambda b: {"y": lax.ppermute(b["x"], "batch", perm)}, {"x": x})
    rows = x.reshape(8, 2, 3)  # replica r's rows
    want = np.zeros_like(rows)
    for src, dst in perm:
        want[dst] = rows[src]
    np.testing.assert_array_equal(np.asarray(rp.local_outputs(got)["y"]), want)


def test_sent_bytes_count_an_axis_of_unknown_size_as_one_replica():
    """``estimated_sent_bytes``: a psum sends ``2 (n - 1) / n`` of its bytes over ``n`` replicas; an axis not in
    ``axis_sizes`` is one replica (nothing sent over it)."""
    x = jnp.ones((4, 8), jnp.float32)  # 128 bytes
    eqns = jax.make_jaxpr(lambda x: lax.psum(x, "i"), axis_env=[("i", 4)])(x).jaxpr.eqns
    assert estimated_sent_bytes(eqns, {"i": 4}) == 2 * 3 / 4 * 128
    assert estimated_sent_bytes(eqns, {"j": 4}) == 0.0


def test_pass_on_origin_marks_only_the_placeholders(repl):
    """The origin goes to the placeholders among the new equations (by first result), not to the code around them."""
    batch = {"x": np.ones((repl.num_replicas, 3), np.float32)}
    jaxpr = repl.lower(lambda b: rp.all_sum(b["x"] * 2.0) + 1.0, batch).traced.jaxpr.jaxpr
    origin = Origin(2, ("train.py:10",))
    (placeholder,) = [e for e in jaxpr.eqns if e.primitive.name == "rp.all_reduce"]
    assert len(jaxpr.eqns) == 3  # mul, the all_sum, add
    assert pass_on_origin(origin, jaxpr.eqns) == {placeholder.outvars[0]: origin}
