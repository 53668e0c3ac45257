"""``split_scan``: a stack of layers under one ``lax.scan`` (or Flax's ``nn.scan``) cut into S stages without
markers. Against one device: ``jax.value_and_grad`` of the unsplit function on the whole batch (the split is
the same math), ``pipeline_train_step`` and ``Replicator.run`` against ``jax.jit`` of the unsplit step over
3 Adam steps; on the graph: ``split_stages`` finds S stages; and the choice rule's errors."""

from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages import StageSplitError, split_scan, split_stages
from replicator.stages.train import pipeline_train_step
from tests.stages.test_train import STEPS, _assert_close, _assert_like_one_device, _train
from tests.stages.test_user_step import _one_device, make_step

LAYERS, DIM, ROWS = 8, 6, 32


def _layer(h, w):
    return jnp.tanh(h @ w), None


def plain_loss(p, x, y):
    """A ``lax.scan`` MLP stack of ``LAYERS`` layers, then a head."""
    h, _ = jax.lax.scan(_layer, x, p["stack"])
    return jnp.mean((h @ p["head"] - y) ** 2)


def plain_params():
    rng = np.random.default_rng(0)
    return {
        "stack": (0.5 * rng.normal(size=(LAYERS, DIM, DIM))).astype(np.float32),
        "head": rng.normal(size=(DIM, DIM)).astype(np.float32),
    }


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(h.shape[-1])(h)), None


class _Stack(nn.Module):
    """``nn.scan`` of Dense layers (the transformer form), then a head."""

    @nn.compact
    def __call__(self, h):
        stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        h, _ = stack()(h, None)
        return nn.Dense(DIM)(h)


_MODEL = _Stack()


def flax_loss(p, x, y):
    return jnp.mean((_MODEL.apply({"params": p}, x) - y) ** 2)


def flax_params():
    return _MODEL.init(jax.random.key(0), jnp.zeros((2, DIM)))["params"]


def batch(rows=ROWS):
    rng = np.random.default_rng(1)
    return rng.normal(size=(rows, DIM)).astype(np.float32), rng.normal(size=(rows, DIM)).astype(np.float32)


MODELS = {"lax.scan": (plain_loss, plain_params), "nn.scan": (flax_loss, flax_params)}


def _assert_grads_close(got, want, tol=1e-5):
    value, grads = got
    want_value, want_grads = want
    np.testing.assert_allclose(value, want_value, rtol=tol)
    _assert_close(grads, want_grads, tol)


# ----------------------------------------------------------------------------
# The same function, and S stages on the graph
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_the_split_function_has_the_unsplit_value_and_gradients(model, stages):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    want = jax.jit(jax.value_and_grad(loss))(p, x, y)
    _assert_grads_close(jax.jit(jax.value_and_grad(split_scan(loss, stages)))(p, x, y), want)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_split_stages_finds_one_stage_per_slice_of_the_stack(model, stages):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    jaxpr = jax.make_jaxpr(jax.value_and_grad(split_scan(loss, stages)))(p, x, y)
    split = split_stages(jaxpr, first_batch=len(jax.tree.leaves(p)))
    assert split.num_stages == stages
    assert [(b.sender, b.receiver) for b in split.boundaries if not b.transposed] == [
        (s, s + 1) for s in range(stages - 1)
    ]
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert {e.params["length"] for e in scans} == {LAYERS // stages}  # every piece, forward and backward


def test_reverse_scan_with_stacked_outputs_and_unroll():
    """``reverse=True`` runs the last slice first; the ``ys`` come back in index order."""

    def body(h, wi):
        return jnp.tanh(h @ wi), jnp.sum(h * h)

    def loss(w, x):
        h, ys = jax.lax.scan(body, x, w, None, True, 3)  # length, reverse, unroll by position
        return jnp.mean(h**2) + jnp.sum(ys * jnp.arange(LAYERS))

    w, (x, _) = plain_params()["stack"], batch()
    want = jax.value_and_grad(loss)(w, x)
    split = split_scan(loss, 4)
    _assert_grads_close(jax.value_and_grad(split)(w, x), want)
    assert split_stages(jax.make_jaxpr(jax.value_and_grad(split))(w, x)).num_stages == 4


def test_a_scan_with_length_and_no_xs():
    """``length=L`` with ``xs=None``: each piece gets ``length=L/S``; the parameter is read by every stage."""

    def loss(w, x):
        h, hs = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), h[0]), x, None, length=LAYERS)
        return jnp.mean(h**2) + 0.1 * jnp.mean(hs)

    w, (x, _) = plain_params()["head"], batch()
    split = split_scan(loss, 2)
    _assert_grads_close(jax.value_and_grad(split)(w, x), jax.value_and_grad(loss)(w, x))
    assert split_stages(jax.make_jaxpr(jax.value_and_grad(split))(w, x)).num_stages == 2


# ----------------------------------------------------------------------------
# Training against one device
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("model, stages", [("lax.scan", 2), ("nn.scan", 4)], ids=["lax.scan-S2", "nn.scan-S4"])
def test_three_adam_steps_match_one_device(model, stages, schedule):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    opt = optax.adam(1e-2)
    train = pipeline_train_step(
        split_scan(loss, stages), opt, num_microbatches=4, schedule=schedule, devices=jax.devices()[:stages]
    )
    got_p, state, values = _train(train, opt, p, x, y)
    _assert_like_one_device(got_p, state, loss, opt, p, x, y, values=values)


@pytest.mark.parametrize("model, stages, m", [("lax.scan", 2, 2), ("nn.scan", 4, 4)], ids=["lax.scan-S2", "nn.scan-S4"])
def test_replicator_run_of_a_split_step_matches_one_device(model, stages, m):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=stages, microbatches=m))
    step, state, values = split_scan(make_step(loss, opt), stages), (p, opt.init(p)), []
    for _ in range(STEPS):
        state, out = repl.run(step, (x, y), state)
        values.append(out["loss"][0])
    want_state, want_values = _one_device(make_step(loss, opt, mean=False), (p, opt.init(p)), (x, y))
    _assert_close(state, want_state)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


@pytest.mark.parametrize("model", list(MODELS))
def test_a_pipelined_replicator_cuts_an_unmarked_stack_by_itself(model):
    """No markers and no split_scan: the Replicator cuts the scanned stack into its stages (run and
    run_pipelined alike), equal to one device."""
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=4, microbatches=4))
    state, piped = (p, opt.init(p)), (p, opt.init(p))
    for _ in range(STEPS):
        state, _ = repl.run(make_step(loss, opt), (x, y), state)
        piped, _ = repl.run_pipelined(loss, opt, (x, y), piped)
    want_state, _ = _one_device(make_step(loss, opt, mean=False), (p, opt.init(p)), (x, y))
    _assert_close(state, want_state)
    _assert_close(piped, want_state)
    assert repl.describe_pipeline(loss, opt, (x, y), (p, opt.init(p))).stages == 4


def test_an_unmarked_step_without_a_stack_gets_the_scan_error():
    def dense(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2)

    x, y = batch()
    p = {"w": jnp.zeros((x.shape[1], y.shape[1]))}
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=2, microbatches=2))
    with pytest.raises(StageSplitError, match=r"(?s)jax.lax.scan.*rp.stage_boundary"):
        repl.run_pipelined(dense, optax.sgd(0.1), (x, y), (p, optax.sgd(0.1).init(p)))


# ----------------------------------------------------------------------------
# Which scan: the choice rule and its errors
# ----------------------------------------------------------------------------


def test_no_scan_of_a_divisible_length_is_an_error_that_says_what_to_do():
    p, (x, y) = plain_params(), batch()
    with pytest.raises(StageSplitError, match=r"no lax.scan .* divisible by 3 stages.*length 8 at .*rp.stage_boundary"):
        jax.make_jaxpr(split_scan(plain_loss, 3))(p, x, y)
    with pytest.raises(StageSplitError, match="makes no top-level jax.lax.scan call"):
        jax.make_jaxpr(split_scan(lambda p, x, y: jnp.mean(x @ p["head"] - y), 2))(p, x, y)


def _two_stacks(p, x, y):
    h, _ = jax.lax.scan(_layer, x, p["stack"])
    g, _ = jax.lax.scan(_layer, y, p["stack"][::-1])
    return jnp.mean((h @ p["head"] - g) ** 2)


def test_two_candidate_scans_are_an_error_and_index_chooses():
    p, (x, y) = plain_params(), batch()
    with pytest.raises(StageSplitError, match=r"2 lax.scan calls .*scan 0: length 8 .*scan 1: length 8.*index=k"):
        jax.make_jaxpr(split_scan(_two_stacks, 2))(p, x, y)
    split = split_scan(_two_stacks, 2, index=1)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(split))(p, x, y)
    assert split_stages(jaxpr, first_batch=2).num_stages == 2
    lengths = [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert lengths[:3] == [8, 4, 4]  # forward: the first stack whole, the second in two pieces
    _assert_grads_close(jax.value_and_grad(split)(p, x, y), jax.value_and_grad(_two_stacks)(p, x, y))


def test_a_scan_of_another_length_beside_the_stack_is_left_alone():
    """A loss over a sequence (a scan of 5 steps) after the stack: only the stack is a candidate."""

    def loss(p, x, y):
        h, _ = jax.lax.scan(_layer, x, p["stack"])
        total, _ = jax.lax.scan(lambda c, r: (c + jnp.mean(r**2), None), 0.0, (h @ p["head"] - y)[:5])
        return total

    p, (x, y) = plain_params(), batch()
    split = split_scan(loss, 2)
    assert split_stages(jax.make_jaxpr(jax.value_and_grad(split))(p, x, y), first_batch=2).num_stages == 2
    _assert_grads_close(jax.value_and_grad(split)(p, x, y), jax.value_and_grad(loss)(p, x, y))


class _SequenceLayer(nn.Module):
    """A Dense layer, then a scan over the features (a nested scan of length DIM, which 2 divides)."""

    @nn.compact
    def __call__(self, h, _):
        h = jnp.tanh(nn.Dense(h.shape[-1])(h))
        _, cumulative = jax.lax.scan(lambda c, col: (c + col, c + col), jnp.zeros(h.shape[0]), h.T)
        return 0.5 * cumulative.T, None


class _NestedStack(nn.Module):
    @nn.compact
    def __call__(self, h):
        stack = nn.scan(_SequenceLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        return stack()(h, None)[0]


def test_a_nested_scan_is_left_alone():
    """The scan inside each layer (also traced on its own by Flax's constancy check) is not a candidate."""
    model = _NestedStack()
    x, y = batch()
    p = model.init(jax.random.key(0), x[:2])["params"]

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    split = split_scan(loss, 2)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(split))(p, x, y)
    assert split_stages(jaxpr, first_batch=2).num_stages == 2
    top = [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert set(top) == {LAYERS // 2}
    bodies = [e.params["jaxpr"].jaxpr for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    nested = {n.params["length"] for b in bodies for n in b.eqns if n.primitive.name == "scan"}
    assert nested == {DIM}  # each layer's own scan, whole
    _assert_grads_close(jax.value_and_grad(split)(p, x, y), jax.value_and_grad(loss)(p, x, y))


def _scan_inside(h, w):
    """A module-level body (JAX caches its trace) with a nested scan: the nested call is not counted."""
    h, _ = jax.lax.scan(lambda c, row: (c + row, None), h, w[:2])
    return h, None


def test_a_nested_scan_in_a_cached_body_does_not_shift_the_count():
    def loss(p, x, y):
        h, _ = jax.lax.scan(_scan_inside, x, p["stack"][:3])  # length 3: not a candidate
        h, _ = jax.lax.scan(_layer, h, p["stack"])
        return jnp.mean((h @ p["head"] - y) ** 2)

    p, (x, y) = plain_params(), batch()
    split = split_scan(loss, 2)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(split))(p, x, y)
    assert split_stages(jaxpr, first_batch=2).num_stages == 2
    _assert_grads_close(jax.value_and_grad(split)(p, x, y), jax.value_and_grad(loss)(p, x, y))


def test_a_stack_inside_jax_jit_is_split():
    def loss(p, x, y):
        h = jax.jit(lambda s, h: jax.lax.scan(_layer, h, s)[0])(p["stack"], x)  # a fresh function: traced again
        return jnp.mean((h @ p["head"] - y) ** 2)

    p, (x, y) = plain_params(), batch()
    split = split_scan(loss, 4)
    assert split_stages(jax.make_jaxpr(jax.value_and_grad(split))(p, x, y), first_batch=2).num_stages == 4
    _assert_grads_close(jax.value_and_grad(split)(p, x, y), jax.value_and_grad(loss)(p, x, y))


@jax.jit
def _jitted_stack(stack, h):
    return jax.lax.scan(_layer, h, stack)[0]


def test_a_stack_in_a_cached_jit_trace_is_an_error():
    def loss(p, x, y):
        return jnp.mean((_jitted_stack(p["stack"], x) @ p["head"] - y) ** 2)

    p, (x, y) = plain_params(), batch()
    with pytest.raises(StageSplitError, match="was not called again.*jax.jit"):
        jax.make_jaxpr(split_scan(loss, 2))(p, x, y)


def test_unmarked_only_leaves_a_marked_function_alone():
    def marked(p, x, y):
        h = rp.stage_boundary(jnp.tanh(x @ p["head"]))
        return plain_loss(p, h, y)

    p, (x, y) = plain_params(), batch()
    for loss, stages in [(marked, 2), (plain_loss, 4)]:  # its own marker; else the stack in 4
        jaxpr = jax.make_jaxpr(jax.value_and_grad(split_scan(loss, 4, unmarked_only=True)))(p, x, y)
        assert split_stages(jaxpr, first_batch=2).num_stages == stages
    jaxpr = jax.make_jaxpr(jax.value_and_grad(split_scan(marked, 4)))(p, x, y)
    assert split_stages(jaxpr, first_batch=2).num_stages == 5  # without it: the marker's stage, then the stack's 4


def test_one_stage_is_the_function_itself_and_a_bad_count_is_refused():
    assert split_scan(plain_loss, 1) is plain_loss
    with pytest.raises(ValueError, match="positive int"):
        split_scan(plain_loss, 0)


def test_lax_scan_is_restored_after_an_error_and_other_threads_scans_pass_through():
    original = jax.lax.scan
    p, (x, y) = plain_params(), batch()
    seen, traces = [], []

    def other_thread():
        jaxpr = jax.make_jaxpr(lambda: jax.lax.scan(_layer, x, p["stack"]))()
        seen.extend(e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan")

    def loss(p, x, y):
        traces.append(None)
        if len(traces) == 2:  # the splitting trace: another thread's scan first, where the stack's would be
            other = threading.Thread(target=other_thread)
            other.start()
            other.join()
        return plain_loss(p, x, y)

    jaxpr = jax.make_jaxpr(split_scan(loss, 2))(p, x, y)  # traced twice: to choose, then to split
    assert jax.lax.scan is original and seen == [LAYERS]  # the other thread's scan, whole
    assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [4, 4]

    def failing(p, x, y):
        plain_loss(p, x, y)
        raise ValueError("the user's own error, while lax.scan is intercepted")

    with pytest.raises(ValueError, match="the user's own error"):
        jax.make_jaxpr(split_scan(failing, 2))(p, x, y)
    assert jax.lax.scan is original
