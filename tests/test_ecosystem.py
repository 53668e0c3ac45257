"""Models from Equinox and Haiku, written for ``jax.pmap``, run unchanged by ``Replicator.run``.

Each step is run three ways on the same data and compared: replicated (1 x 8
and 2 x 4), ``jax.pmap`` over the 8 devices, and ``jax.pmap`` over ONE device
with the global batch (the single-device reference: cross-replica batch norm
and means then span the global batch). Flax is covered by
``examples/flax_imagenet_pmap.py`` (``tests/test_examples.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="compares with jax.pmap over 8 devices")

STEPS = 3
GLOBAL_BATCH = 32
TOL = 1e-5
RNG = np.random.default_rng(0)
BATCHES = [
    {
        "x": RNG.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32),
        "y": RNG.normal(size=(GLOBAL_BATCH,)).astype(np.float32),
    }
    for _ in range(STEPS)
]


def replicated(step, state, mesh, **kwargs):
    repl = rp.Replicator(*mesh, axis_name="batch", **kwargs)
    rows = GLOBAL_BATCH // mesh[0]

    def input_fn(ctx):
        for b in BATCHES:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)

    outs = []
    for _ in BATCHES:
        state, out = repl.run(step, input_fn, state)
        outs.append(out)
    return state, outs


def pmapped(step, state, n):
    p_step = jax.pmap(step, axis_name="batch", devices=jax.devices()[:n])
    state = jax.tree.map(lambda a: jnp.stack([a] * n), state)
    outs = []
    for b in BATCHES:
        state, out = p_step(state, jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), b))
        outs.append(out)
    return jax.tree.map(lambda a: a[0], state), outs


def assert_close(got, want, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL, err_msg=f"{what}{jax.tree_util.keystr(path)}"
        )


def arrays(tree):
    return [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]


# -- Equinox ------------------------------------------------------------------------------


def equinox_step_and_state():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.lin = eqx.nn.Linear(3, 8, key=k1)
            # ('rows', 'batch'): the statistics span this replica's rows (a vmap) and every replica.
            self.bn = eqx.nn.BatchNorm(8, axis_name=("rows", "batch"), mode="batch")
            self.out = eqx.nn.Linear(8, "scalar", key=k2)

        def __call__(self, x, state):
            h, state = self.bn(self.lin(x), state)
            return self.out(jax.nn.relu(h)), state

    model, bn_state = eqx.nn.make_with_state(Net)(jax.random.key(0))

    def step(carry, batch):  # written for pmap(axis_name='batch')
        model, bn_state = carry

        def loss_fn(model):
            forward = jax.vmap(model, axis_name="rows", in_axes=(0, None), out_axes=(0, None))
            pred, new_state = forward(batch["x"], bn_state)
            return jnp.mean((pred - batch["y"]) ** 2), new_state

        (loss, new_state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        grads = lax.pmean(grads, "batch")
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        return (model, new_state), {"loss": lax.pmean(loss, "batch")}

    return step, (model, bn_state)


@pytest.mark.parametrize(
    ("mesh", "zero_stage"), [((1, 8), 0), ((2, 4), 0), ((2, 4), 3)], ids=["1x8", "2x4", "2x4-zero3"]
)
def test_equinox_module_state_and_batch_norm_match_pmap_and_one_device(mesh, zero_stage):
    eqx = pytest.importorskip("equinox")
    step, state = equinox_step_and_state()
    passes = rp.PassManager.default(zero=zero_stage, shard_optimizer_min_bytes=0)
    got, outs = replicated(step, state, mesh, passes=passes)
    # ZeRO-3 stores the first Linear's weight (8 x 3: its leading axis divides by 8) 1/8 per device
    assert got[0].lin.weight.sharding.is_fully_replicated == (zero_stage == 0)
    # The whole module is the state: its str and bool fields are static and come back as they were.
    assert got[0].bn.axis_name == ("rows", "batch") and got[0].bn.inference is False
    params, static = eqx.partition(state, eqx.is_array)

    def array_step(params, batch):  # pmap needs array-only state: the partition Equinox users write
        new, out = step(eqx.combine(params, static), batch)
        return eqx.filter(new, eqx.is_array), out

    want8, outs8 = pmapped(array_step, params, 8)
    want1, _ = pmapped(array_step, params, 1)
    assert_close(arrays(got), arrays(want8), "vs pmap: ")
    assert_close(arrays(got), arrays(want1), "vs one device: ")
    np.testing.assert_allclose(outs[-1]["loss"][0], outs8[-1]["loss"][0], rtol=TOL)


# -- Haiku --------------------------------------------------------------------------------


def haiku_step_and_state():
    hk = pytest.importorskip("haiku")
    optax = pytest.importorskip("optax")

    def forward(x):
        h = hk.Linear(8, with_bias=False)(x)  # a bias before batch norm has a gradient of rounding noise
        h = hk.BatchNorm(True, True, 0.9, cross_replica_axis="batch")(h, is_training=True)
        return hk.Linear(1)(jax.nn.relu(h))[:, 0]

    net = hk.transform_with_state(forward)
    # Haiku's batch norm needs its axis bound even at init: init under a one-device pmap.
    init = jax.pmap(lambda x: net.init(jax.random.key(0), x), axis_name="batch", devices=jax.devices()[:1])
    params, net_state = jax.tree.map(lambda a: np.asarray(a[0]), init(BATCHES[0]["x"][None, :4]))
    tx = optax.adam(1e-2)

    def step(carry, batch):  # written for pmap(axis_name='batch')
        params, net_state, opt_state = carry

        def loss_fn(params):
            pred, new_state = net.apply(params, net_state, None, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2), new_state

        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_state, opt_state), {"loss": lax.pmean(loss, "batch")}

    return step, (params, net_state, tx.init(params))


@pytest.mark.parametrize(
    ("mesh", "zero_stage"), [((1, 8), 0), ((2, 4), 0), ((1, 8), 3)], ids=["1x8", "2x4", "1x8-zero3"]
)
def test_haiku_cross_replica_batch_norm_matches_pmap_and_one_device(mesh, zero_stage):
    step, state = haiku_step_and_state()
    passes = rp.PassManager.default(zero=zero_stage, shard_optimizer_min_bytes=0)
    got, outs = replicated(step, state, mesh, passes=passes)
    want8, outs8 = pmapped(step, state, 8)
    want1, _ = pmapped(step, state, 1)
    assert_close(got, want8, "vs pmap: ")
    assert_close(got, want1, "vs one device: ")
    np.testing.assert_allclose(outs[-1]["loss"][0], outs8[-1]["loss"][0], rtol=TOL)


def test_fusion_applies_to_captured_collectives():
    step, state = haiku_step_and_state()
    repl = rp.Replicator(1, 8, axis_name="batch")
    report = repl.explain(step, BATCHES[0], state)
    fused = [row for row in report.rows if row.tensors > 1]
    assert fused, str(report)  # the gradient pmean's leaves travel in one bucket


def test_a_step_may_close_over_an_array_an_earlier_run_returned():
    repl = rp.Replicator(1, 8)
    x = BATCHES[0]["x"][:8]
    w, _ = repl.run(lambda w, b: (w + rp.all_mean(b["x"][0]), {}), lambda ctx: iter([{"x": x}]), jnp.zeros(3))
    out = repl.run(lambda b: {"y": b["x"] @ w}, lambda ctx: iter([{"x": x}]))  # w lives on the mesh
    np.testing.assert_allclose(np.asarray(out["y"])[:, 0], x @ x.mean(0), rtol=1e-5)


def test_non_array_state_leaves_are_static_and_must_come_back_unchanged():
    repl = rp.Replicator(1, 8)
    x = BATCHES[0]["x"][:8]
    state = {"w": jnp.ones(3), "act": jnp.tanh, "name": "mlp", "train": True}
    new, _ = repl.run(lambda s, b: ({**s, "w": s["w"] * 2}, {}), lambda ctx: iter([{"x": x}] * 2), state)
    assert new["act"] is jnp.tanh and new["name"] == "mlp" and new["train"] is True
    np.testing.assert_allclose(new["w"], 2.0)
    with pytest.raises(ValueError, match=r"step_fn changed state\['name'\], a non-array part of the state"):
        repl.run(lambda s, b: ({**s, "name": "other"}, {}), lambda ctx: iter([{"x": x}]), state)
    with pytest.raises(TypeError, match=r"state\['bad'\] is a _Unhashable, neither an array nor a hashable"):
        repl.run(lambda s, b: (s, {}), lambda ctx: iter([{"x": x}]), {"w": jnp.ones(3), "bad": _Unhashable()})


class _Unhashable(list):
    """A leaf (registered as no pytree) that cannot be hashed."""

    __hash__ = None
