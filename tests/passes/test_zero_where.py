"""ZeRO with the state kept on a non-finite step by ``jnp.where`` (Flax ``DynamicScale``'s pattern).

``jnp.where(is_finite, new, old)`` is a ``jit`` call around ``select_n`` with a
scalar predicate (and ``broadcast_in_dim`` of a scalar operand): the leaves must
be sharded as with ``lax.select``, and train as on one device (the reference:
the same step under ``jax.jit`` on one device with the global batch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from utils import sum_rounding_scale, train_on_global_batches

import replicator as rp
from replicator.passes import count_primitives

WIDTH = 128  # 64 KiB weights: at the default threshold
TOL = 5e-5


def _loss(params, x, y):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x - y) ** 2)


def _make_step(tx, keep, mean=None):
    """An Adam step that keeps the old state when the averaged gradients are not finite."""

    def step(state, batch):
        average = mean or rp.all_mean
        params, opt = state
        g = average(jax.grad(_loss)(params, batch["x"], batch["y"]))
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(g)]))
        upd, new_opt = tx.update(g, opt, params)
        new = (optax.apply_updates(params, upd), new_opt)
        return jax.tree.map(lambda a, b: keep(finite, a, b), new, state), {}

    return step


def _where(finite, new, old):
    return jnp.where(finite, new, old)


def _select(finite, new, old):
    return lax.select(jnp.broadcast_to(finite, jnp.shape(new)), new, old)


def _setup():
    rng = np.random.default_rng(0)
    params = [
        {"w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), "b": np.zeros(WIDTH, np.float32)}
        for _ in range(2)
    ]
    tx = optax.adam(1e-2)
    return tx, (params, tx.init(params))


def _batches(rows, steps=4, bad=(1,)):
    """``steps`` global batches; in the steps ``bad``, one row of x is infinite (non-finite gradients)."""
    rng = np.random.default_rng(1)
    out = []
    for k in range(steps):
        x = rng.normal(size=(rows, WIDTH)).astype(np.float32)
        if k in bad:
            x[rows // 3, 0] = np.inf
        out.append({"x": x, "y": rng.normal(size=(rows, WIDTH)).astype(np.float32)})
    return out


def _sharded_paths(repl, step, state):
    lowered = repl.lower(step, _batches(2 * repl.cores_per_worker, 1, ())[0], state)
    return sorted(lowered.final.state_paths[i] for i in lowered.final.sharded_state), lowered


@pytest.mark.parametrize("stage", [1, 3])
def test_where_on_a_scalar_predicate_shards_as_select_does(stage):
    tx, state = _setup()
    repl = rp.Replicator(2, 4, passes=rp.PassManager.default(zero=stage))
    with_where, lowered = _sharded_paths(repl, _make_step(tx, _where), state)
    with_select, _ = _sharded_paths(repl, _make_step(tx, _select), state)
    assert with_where == with_select, (with_where, with_select)
    assert any("mu" in p for p in with_where), with_where  # Adam's moments
    if stage == 3:
        assert any("['w']" in p for p in with_where), with_where  # the parameters too
    assert not [n for n in lowered.notes if "stays replicated" in n and "['w']" in n], lowered.notes


def test_a_broadcast_scalar_is_made_as_chunks():
    """``jnp.where(finite, new, 0.0)`` broadcasts ``0.0``: on chunks, never a whole broadcast sliced."""
    tx, state = _setup()
    repl = rp.Replicator(2, 4, passes=rp.PassManager.default(zero=1))
    step = _make_step(tx, lambda finite, new, old: jnp.where(finite, new, jnp.zeros((), new.dtype)))
    paths, lowered = _sharded_paths(repl, step, state)
    assert any("mu" in p for p in paths), paths
    graph = lowered.after("shard-optimizer-update").jaxpr.jaxpr
    shapes = [e.outvars[0].aval.shape for e in graph.eqns if e.primitive.name == "broadcast_in_dim"]
    assert (WIDTH // 8, WIDTH) in shapes, shapes  # the weights' 0.0, made as this replica's chunk
    assert (WIDTH, WIDTH) not in shapes, shapes
    assert count_primitives(graph, ["jit"]).get("jit", 0) == 0


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("workers,cores", [(2, 4), (2, 2)])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_non_finite_step_keeps_the_state_as_on_one_device(n_devices, workers, cores, stage):
    if workers * cores > n_devices:
        pytest.skip(f"needs {workers * cores} devices")
    tx, state = _setup()
    batches = _batches(4 * workers * cores, steps=4, bad=(1,))
    repl = rp.Replicator(workers, cores, passes=rp.PassManager.default(zero=stage))
    step = _make_step(tx, _where)
    assert _sharded_paths(repl, step, state)[0]  # the run below is sharded
    got = train_on_global_batches(repl, step, state, batches)

    reference = jax.jit(_make_step(tx, _where, mean=lambda x: x))
    ref = state
    for k, b in enumerate(batches):
        before = ref
        ref, _ = reference(ref, b)
        if k == 1:  # the non-finite step kept everything on one device too
            assert _max_diff(before, ref) == 0.0
    assert _max_diff(ref[0], state[0]) > 1e-3  # the finite steps moved the parameters
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
    assert _max_diff(got, ref) < TOL * sum_rounding_scale(workers * cores)


def test_a_leaf_left_whole_names_the_equation_not_unproven_values():
    """The note of a parameter stage 3 leaves whole names what is not element-wise, not unproven values."""
    rng = np.random.default_rng(0)
    state = {"w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32), "v": np.ones((WIDTH, WIDTH), np.float32)}

    def step(s, b):
        g = rp.all_mean(jax.grad(lambda w: jnp.sum(jnp.tanh(b["x"] @ w)))(s["w"]))
        return {"w": s["w"] - 0.1 * g, "v": jnp.cumsum(s["v"], axis=1) * 0.5 + 0.5}, {}

    repl = rp.Replicator(1, 8, passes=rp.PassManager.default(zero=3))
    lowered = repl.lower(step, {"x": np.ones((16, WIDTH), np.float32)}, state)
    (note,) = [n for n in lowered.notes if "state['v']" in n]
    assert "stays replicated" in note and "identical on every replica" in note, note
    assert "cumsum" in note and "test_zero_where.py" in note, note
    assert "proves identical" not in note, note


def test_explain_does_not_call_identical_updates_unproven():
    rng = np.random.default_rng(0)
    state = {"w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32), "v": np.ones((WIDTH, WIDTH), np.float32)}

    def step(s, b):
        g = rp.all_mean(jax.grad(lambda w: jnp.sum(jnp.tanh(b["x"] @ w)))(s["w"]))
        return {"w": s["w"] - 0.1 * g, "v": jnp.cumsum(s["v"], axis=1) * 0.5 + 0.5}, {}

    repl = rp.Replicator(1, 8, passes=rp.PassManager.default(zero=1))
    text = " ".join(str(repl.explain(step, {"x": np.ones((16, WIDTH), np.float32)}, state)).split())
    assert "identical on every replica, are not made element by element" in text, text
    assert "proven identical" not in text, text
