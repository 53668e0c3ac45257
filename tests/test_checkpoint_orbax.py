"""Checkpoints from and for orbax (``replicator[orbax]``): ``restore_orbax`` and ``export_orbax``.

A Flax ``TrainState`` (an MLP, Adam, two steps of one-device ``jax.jit``
training) is saved by plain orbax code: with ``ocp.StandardCheckpointer``
from one device, and with ``ocp.CheckpointManager`` from leaves sharded over
a mesh of 8 devices. Each restores into a Replicator run on 1 x 8, 2 x 2
and 8 replicas folded onto 4 devices, at ZeRO stages 0, 1 and 3: the restored
leaves equal the saved ones bit for bit, and one training step from them is
compared with one step of one-device ``jax.jit`` on the global batch from the
same state (``ATOL``: float32 Adam; the replicas differ only in the order of
the sums). The other way: a ZeRO-3 state after three steps, exported, is
read by plain orbax (``StandardCheckpointer().restore``) as the values
``rp.gather_outputs`` reads from the run. Then the errors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed (pip install '.[orbax]')")
nn = pytest.importorskip("flax.linen")
train_state = pytest.importorskip("flax.training.train_state")

import replicator as rp  # noqa: E402
from replicator.training.checkpoint import CheckpointError, export_orbax, restore_orbax  # noqa: E402

ATOL = 1e-6  # one step from the same state: the replicated sums differ from one device's only in their order
SAVED_AT = 2  # the one-device steps trained before saving
GLOBAL_ROWS = 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = jnp.tanh(nn.Dense(32)(x))  # Dense_0: kernel (8, 32)
        return nn.Dense(8)(hidden)


model = MLP()
tx = optax.adam(1e-2)


def fresh_state() -> train_state.TrainState:
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    x = rng.normal(size=(GLOBAL_ROWS, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x)}


def _loss(params, state, batch):
    return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


def train_step(state, batch):  # one replica's step
    loss, grads = jax.value_and_grad(_loss)(state.params, state, batch)
    return state.apply_gradients(grads=rp.all_mean(grads)), {"loss": rp.all_mean(loss)}


@jax.jit
def reference_step(state, batch):  # one device, the global batch
    loss, grads = jax.value_and_grad(_loss)(state.params, state, batch)
    return state.apply_gradients(grads=grads), loss


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_equal(got, want) -> None:
    """Bit for bit, leaf by leaf, naming the leaf."""
    got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
    assert got_def == jax.tree.structure(want)
    for (keys, a), b in zip(got_flat, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(keys))


@pytest.fixture(scope="module")
def trained():
    """The state after ``SAVED_AT`` one-device steps (host arrays)."""
    state = jax.device_put(fresh_state(), jax.devices()[0])
    for i in range(SAVED_AT):
        state, _ = reference_step(state, batch(i))
    return host(state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, trained):
    """Plain orbax saves of ``trained``: ``standard`` (one device), ``manager`` (sharded over 8 devices, steps 1, 2)."""
    root = tmp_path_factory.mktemp("orbax")
    standard = str(root / "standard")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(standard, jax.device_put(trained, jax.devices()[0]))
    checkpointer.wait_until_finished()

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    n = len(jax.devices())

    def shard(x):
        split = x.ndim == 2 and x.shape[1] % n == 0  # the kernels' columns over every device
        spec = jax.sharding.PartitionSpec(None, "d") if split else jax.sharding.PartitionSpec()
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    sharded = jax.tree.map(shard, trained)
    assert not sharded.params["Dense_0"]["kernel"].sharding.is_fully_replicated
    manager_dir = str(root / "manager")
    with ocp.CheckpointManager(manager_dir) as manager:
        manager.save(1, args=ocp.args.StandardSave(jax.tree.map(jnp.zeros_like, sharded)))
        manager.save(SAVED_AT, args=ocp.args.StandardSave(sharded))
        manager.wait_until_finished()
    return {"standard": standard, "manager": manager_dir}


LAYOUTS = {
    "1x8": lambda passes: rp.Replicator(1, 8, passes=passes),
    "2x2": lambda passes: rp.Replicator(2, 2, devices=jax.devices()[:4], passes=passes),
    "8-on-4": lambda passes: rp.Replicator(
        1, 8, devices=jax.devices()[:4], parallelism=rp.Parallelism(replicas_per_device=2), passes=passes
    ),
}


@pytest.fixture(scope="module")
def n8(n_devices):
    if n_devices != 8:
        pytest.skip("these layouts need 8 devices")


def _split(state) -> int:
    return sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state) if hasattr(x, "sharding"))


@pytest.mark.parametrize(
    "layout, zero_stage, source",
    [
        ("1x8", 0, "standard"),  # the fresh state as the target: leaves restored whole, on the host
        ("1x8", 3, "manager"),  # saved sharded over 8 devices, restored onto ZeRO-3's layout
        ("2x2", 0, "manager"),
        ("2x2", 3, "standard"),
        ("8-on-4", 1, "standard"),  # 8 replicas folded onto 4 devices; ZeRO-1: the optimizer state split
        ("8-on-4", 3, "manager"),
    ],
)
def test_an_orbax_train_state_restores_into_a_run(n8, saved, trained, layout, zero_stage, source):
    passes = rp.PassManager.default(zero=zero_stage, shard_optimizer_min_bytes=0)
    repl = LAYOUTS[layout](passes)
    if zero_stage == 0:
        target = fresh_state()
    else:  # the layout of a step's output: each device's part is placed from the host copy
        probe, _ = repl.run(train_step, batch(0), fresh_state())
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), probe)
        assert _split(target) > 0
    state = restore_orbax(saved[source], target)
    assert_equal(state, trained)
    if zero_stage:
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
            assert got.sharding == want.sharding

    state, out = repl.run(train_step, batch(SAVED_AT), state)
    want, loss = reference_step(jax.device_put(trained, jax.devices()[0]), batch(SAVED_AT))
    assert int(state.step) == SAVED_AT + 1
    np.testing.assert_allclose(rp.replica_invariant(out)["loss"], loss, atol=ATOL, rtol=0)
    for (keys, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0, err_msg=jax.tree_util.keystr(keys))


def test_a_checkpoint_manager_step_or_its_item_directory(saved, trained):
    zeros = host(jax.tree.map(jnp.zeros_like, trained))
    target = fresh_state()
    assert_equal(restore_orbax(saved["manager"], target, step=1), zeros)
    assert_equal(restore_orbax(os.path.join(saved["manager"], str(SAVED_AT)), target), trained)
    assert_equal(restore_orbax(os.path.join(saved["manager"], "1", "default"), target), zeros)
    on_host = restore_orbax(saved["manager"], host(target))  # numpy targets: numpy leaves, whole
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(on_host))
    on_device = restore_orbax(saved["manager"], target)  # a target on one device: there
    assert all(x.devices() == {jax.devices()[0]} for x in jax.tree.leaves(on_device) if isinstance(x, jax.Array))


def test_a_python_number_and_a_typed_key(tmp_path):
    # TrainState.create's step is the Python int 0: orbax stores it as an int64 scalar; a key as its key data.
    state = {"step": 7, "scale": 0.5, "key": jax.random.key(3), "w": np.arange(6, dtype=np.float32)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "ckpt"), state)
    target = {"step": 0, "scale": 1.0, "key": jax.random.key(0), "w": jnp.zeros(6)}
    restored = restore_orbax(tmp_path / "ckpt", target)
    assert restored["step"].dtype == np.int32 and int(restored["step"]) == 7  # JAX's canonical int
    assert restored["scale"].dtype == np.float32 and float(restored["scale"]) == 0.5
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)  # a typed key again, not its data
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    np.testing.assert_array_equal(np.asarray(restored["w"]), state["w"])


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_run_exports_what_orbax_restores(n8, tmp_path, zero_stage):
    passes = rp.PassManager.default(zero=zero_stage, shard_optimizer_min_bytes=0)
    repl = rp.Replicator(2, 4, passes=passes)
    state = fresh_state()
    for i in range(3):
        state, _ = repl.run(train_step, batch(i), state)
    assert (_split(state) > 0) == (zero_stage == 3)
    path = export_orbax(tmp_path / "exported", state)

    as_tree = ocp.StandardCheckpointer().restore(path)  # no target: nested dicts and lists of numpy arrays
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(as_tree))  # whole, on no device
    flat = {
        tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys): v
        for keys, v in jax.tree_util.tree_flatten_with_path(as_tree)[0]
    }
    gathered = rp.gather_outputs(state)
    for keys, value in jax.tree_util.tree_flatten_with_path(gathered)[0]:
        name = tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in keys)
        np.testing.assert_array_equal(np.asarray(flat.pop(name)), value, err_msg=str(name))
    assert not flat  # nothing else was written

    # With a target, orbax restores the TrainState itself, onto the target's shardings (here one device).
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, jax.device_put(fresh_state(), jax.devices()[0]))
    restored = ocp.StandardCheckpointer().restore(path, abstract)
    assert isinstance(restored, train_state.TrainState)
    assert_equal(restored, gathered)


def test_export_then_restore_into_another_layout(n8, tmp_path):
    state = fresh_state()
    zero3 = rp.Replicator(1, 8, passes=rp.PassManager.default(zero=3, shard_optimizer_min_bytes=0))
    state, _ = zero3.run(train_step, batch(0), state)
    path = export_orbax(tmp_path / "e", state)
    back = restore_orbax(path, fresh_state())
    assert_equal(back, rp.gather_outputs(state))


def test_replicator_does_not_import_orbax():
    # The runtime dependencies stay jax, numpy and optax: orbax is imported by the first restore_orbax/export_orbax.
    code = (
        "import sys, replicator, replicator.training.checkpoint; print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "'orbax'" not in proc.stdout and "'flax'" not in proc.stdout and "'jax'" in proc.stdout


# -- errors ------------------------------------------------------------------------------


def test_a_mismatch_names_the_leaf_before_reading(saved):
    def other_model(features):
        class Other(nn.Module):
            @nn.compact
            def __call__(self, x):
                hidden = jnp.tanh(nn.Dense(features)(x))
                return nn.Dense(8)(hidden)

        params = Other().init(jax.random.key(0), jnp.ones((1, 8)))["params"]
        return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    with pytest.raises(
        CheckpointError,
        match=r"params\.Dense_0\.bias of shape \(32,\) float32, but the target's state\.params\['Dense_0'\]\['bias'\] is \(16,\) float32",
    ):
        restore_orbax(saved["standard"], other_model(16))

    target = fresh_state()
    wrong_dtype = target.replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params))
    with pytest.raises(CheckpointError, match=r"params\.Dense_0\.bias of shape \(32,\) float32.*bfloat16"):
        restore_orbax(saved["standard"], wrong_dtype)

    more = target.replace(params={**target.params, "Dense_2": {"bias": jnp.zeros(8)}})
    with pytest.raises(CheckpointError, match=r"lacks state\.params\['Dense_2'\]\['bias'\] \(orbax's name "):
        restore_orbax(saved["standard"], more)

    params_only = {"params": target.params}
    with pytest.raises(CheckpointError, match=r"has opt_state\.0\.count, which the target lacks.*partial=True"):
        restore_orbax(saved["standard"], params_only)
    restored = restore_orbax(saved["standard"], params_only, partial=True)  # e.g. fine-tuning a new optimizer
    assert_equal(restored["params"], restore_orbax(saved["standard"], target).params)


def test_a_python_int_too_large_for_its_target(tmp_path):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "big"), {"step": 2**40})
    with pytest.raises(CheckpointError, match=r"state\['step'\] is 1099511627776, which a int32"):
        restore_orbax(tmp_path / "big", {"step": 0})


def test_paths_that_hold_no_such_checkpoint(tmp_path, saved):
    target = fresh_state()
    with pytest.raises(CheckpointError, match="not a directory"):
        restore_orbax(tmp_path / "missing", target)
    with pytest.raises(CheckpointError, match="neither it nor a subdirectory holds _METADATA"):
        restore_orbax(tmp_path, target)
    with pytest.raises(CheckpointError, match=r"no step 5 .* it has steps \[1, 2\]"):
        restore_orbax(saved["manager"], target, step=5)
    with pytest.raises(CheckpointError, match="Drop them"):
        restore_orbax(saved["standard"], target, step=1)
    with pytest.raises(CheckpointError, match=r"no pytree item 'state'; it has \['default'\]"):
        restore_orbax(saved["manager"], target, item="state")
    rp.save_checkpoint(tmp_path / "own", 3, {"w": np.zeros(2, np.float32)})  # replicator's format, not orbax's
    with pytest.raises(CheckpointError, match="no orbax checkpoint"):
        restore_orbax(tmp_path / "own", {"w": np.zeros(2, np.float32)})


def test_export_refuses_an_existing_directory(tmp_path):
    path = export_orbax(tmp_path / "e", {"w": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match="exists; export into a new directory"):
        export_orbax(path, {"w": np.zeros(2, np.float32)})
    export_orbax(path, {"w": np.zeros(2, np.float32)}, overwrite=True)
    assert_equal(ocp.StandardCheckpointer().restore(path), {"w": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="checkpoints hold arrays of numbers"):
        export_orbax(tmp_path / "s", {"name": "text"})


def test_narrow_dtypes_keep_their_dtype_through_export_and_restore(n8, tmp_path):
    """bfloat16, float16, int8 and bool leaves (mixed precision's parameters, a loss scale's flag), 0-d ones
    too, are written by export_orbax and read back by orbax and by restore_orbax with their own dtype, bit for
    bit (assert_array_equal alone would pass a float32 copy of the same values)."""
    repl = rp.Replicator(1, 8)
    state = {
        "w16": jnp.linspace(-2, 2, 8, dtype=jnp.bfloat16),
        "h16": jnp.linspace(-1, 1, 6, dtype=jnp.float16),
        "scale": jnp.float16(1024.0),
        "q": jnp.arange(-4, 4, dtype=jnp.int8),
        "finite": jnp.bool_(True),
        "w32": jnp.ones(3, jnp.float32),
    }
    state, _ = repl.run(lambda s, b: (s, {}), {"x": np.zeros((8, 1), np.float32)}, state)
    path = export_orbax(tmp_path / "narrow", state)
    as_tree = ocp.StandardCheckpointer().restore(path)
    back = restore_orbax(path, jax.tree.map(jnp.zeros_like, state))
    for name, want in state.items():
        for got in (as_tree[name], back[name]):
            assert np.asarray(got).dtype == np.asarray(want).dtype, (name, np.asarray(got).dtype)
            assert np.shape(got) == np.shape(want), name
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


# -- promises without a test before (issue #41 item 4) ------------------------------------


def test_a_mismatch_is_raised_before_any_array_is_read(saved, monkeypatch):
    def no_read(self, *args, **kwargs):
        raise AssertionError("an array was read")

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", no_read)
    target = fresh_state()
    more = target.replace(params={**target.params, "Dense_2": {"bias": jnp.zeros(8)}})
    wrong_dtype = target.replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params))
    for wrong, match in ((more, "lacks state"), (wrong_dtype, "bfloat16"), ({"params": target.params}, "partial")):
        with pytest.raises(CheckpointError, match=match):
            restore_orbax(saved["standard"], wrong)
