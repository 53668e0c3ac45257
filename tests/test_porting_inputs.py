"""What pmap programs pass and how: per-device arguments (typed PRNG keys, one per replica) next to batch rows,
typed keys in the state, and a ``jax.pmap``-ed step refused with the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp


def noisy_step(w, batch):
    """One replica: its rows' mean plus noise drawn from its own key (one key per replica)."""
    noise = jax.random.normal(batch["key"][0], (3,))
    return w, {"y": jnp.mean(batch["x"], axis=0) + noise}


def _reference(x, keys, replicas):
    """Every replica's output computed one replica at a time on one device."""
    rows = np.split(x, replicas)
    noise = [np.asarray(jax.random.normal(keys[i], (x.shape[1],))) for i in range(replicas)]
    return np.stack([np.mean(r, axis=0) + noise[i] for i, r in enumerate(rows)])


def test_one_typed_key_per_replica_next_to_rows_given_as_a_batch(repl2d):
    n = repl2d.num_replicas
    x = np.random.default_rng(0).normal(size=(4 * n, 3)).astype(np.float32)  # 4 rows per replica
    keys = jax.random.split(jax.random.key(1), n)  # one per replica, as pmap's dropout_rng
    _, out = repl2d.run(noisy_step, {"x": x, "key": keys}, jnp.zeros(3))
    np.testing.assert_allclose(np.asarray(out["y"]), _reference(x, keys, n), rtol=1e-5, atol=1e-6)


def test_one_typed_key_per_replica_from_an_input_fn_of_each_worker(repl2d):
    n, c = repl2d.num_replicas, repl2d.cores_per_worker
    x = np.random.default_rng(2).normal(size=(2 * n, 3)).astype(np.float32)
    keys = jax.random.split(jax.random.key(3), n)

    def input_fn(ctx):  # worker w: its 2C rows and the keys of its C replicas
        w = ctx.worker_id
        while True:
            yield {"x": x[2 * c * w : 2 * c * (w + 1)], "key": keys[c * w : c * (w + 1)]}

    _, out = repl2d.run(noisy_step, input_fn, jnp.zeros(3))
    np.testing.assert_allclose(np.asarray(out["y"]), _reference(x, keys, n), rtol=1e-5, atol=1e-6)


def test_raw_uint32_keys_per_replica_work_too(repl):
    n = repl.num_replicas
    x = np.ones((n, 3), np.float32)
    keys = jax.random.split(jax.random.PRNGKey(4), n)  # legacy keys: uint32 (n, 2)

    def step(w, batch):
        return w, {"y": jax.random.normal(batch["key"][0], (3,))}

    _, out = repl.run(step, {"x": x, "key": np.asarray(keys)}, jnp.zeros(3))
    want = np.stack([np.asarray(jax.random.normal(keys[i], (3,))) for i in range(n)])
    np.testing.assert_allclose(np.asarray(out["y"]), want, rtol=1e-6)


def test_a_typed_key_array_in_the_state_is_split_and_carried(repl):
    def step(state, batch):
        keys = jax.vmap(jax.random.split)(state["keys"])  # (4, 2) keys
        return {"keys": keys[:, 0], "w": state["w"] + jax.random.normal(keys[0, 1], (3,))}, {}

    state = {"keys": jax.random.split(jax.random.key(5), 4), "w": jnp.zeros(3)}
    batch = {"x": np.ones(repl.num_replicas, np.float32)}
    keys, w = state["keys"], np.zeros(3, np.float32)
    for _ in range(3):
        state, _ = repl.run(step, batch, state)
        split = jax.vmap(jax.random.split)(keys)
        keys, w = split[:, 0], w + np.asarray(jax.random.normal(split[0, 1], (3,)))
    np.testing.assert_allclose(np.asarray(state["w"]), w, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(state["keys"])), np.asarray(jax.random.key_data(keys)))


def pmap_step(w, batch):
    grads = jax.grad(lambda w: jnp.mean((batch["x"] @ w - 1.0) ** 2))(w)
    return w - 0.1 * lax.pmean(grads, "batch"), {"loss": lax.pmean(jnp.mean(batch["x"] @ w), "batch")}


def test_a_pmapped_step_is_refused_with_the_fix_and_its_wrapped_function_matches_pmap(n_devices):
    repl = rp.Replicator(1, n_devices, axis_name="batch")
    p_step = jax.pmap(pmap_step, axis_name="batch")
    x = np.random.default_rng(6).normal(size=(2 * n_devices, 3)).astype(np.float32)
    w = jnp.zeros(3)
    for entry in (lambda: repl.run(p_step, {"x": x}, w), lambda: repl.lower(p_step, {"x": x}, w)):
        with pytest.raises(TypeError, match=r"jax\.pmap.*repl\.run\(pmap_step\.__wrapped__, \.\.\.\).*axis_name="):
            entry()
    new_w, out = repl.run(p_step.__wrapped__, {"x": x}, w)
    ws = jnp.broadcast_to(w, (n_devices, 3))
    want_w, want_out = p_step(ws, {"x": x.reshape(n_devices, 2, 3)})  # pmap itself: the reference
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(want_w[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["loss"]), np.asarray(want_out["loss"]), rtol=1e-6)


def test_a_jitted_step_is_not_mistaken_for_a_pmapped_one(repl):
    step = jax.jit(lambda w, b: (w + rp.all_mean(jnp.mean(b["x"])), {}))
    w, _ = repl.run(step, {"x": np.arange(repl.num_replicas, dtype=np.float32)}, jnp.float32(0))
    assert float(w) == pytest.approx((repl.num_replicas - 1) / 2)


@pytest.mark.multiprocess
def test_typed_keys_per_replica_given_directly_across_two_processes(tmp_path, n_devices):
    """Each process gives run its rows and its replicas' keys; every replica's output against one at a time."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if n_devices % 2:
        pytest.skip(f"{n_devices} devices do not split into 2 workers")
    script = Path(__file__).resolve().parent / "multiproc" / "keys_worker.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPLICATOR_", "SLURM_", "OMPI_"))}
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count per worker
    cores = n_devices // 2
    command = [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", str(cores)]
    proc = subprocess.run(
        [*command, str(script), "--out", str(tmp_path)],
        env=env,
        cwd=script.parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    spec = importlib.util.spec_from_file_location("keys_worker", script)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    n = 2 * cores
    want = {step: _reference(*worker.global_batch(n, step).values(), n) for step in (0, 2)}
    total0 = float(worker.global_batch(n, 0)["x"].sum())
    for w in (0, 1):
        got = {name: np.load(tmp_path / f"w{w}_{name}.npy") for name in ("y0", "total0", "y2", "count")}
        mine = slice(w * cores, (w + 1) * cores)
        np.testing.assert_allclose(got["y0"], want[0][mine], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["y2"], want[2][mine], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["total0"], total0, rtol=1e-5)
        assert int(got["count"]) == 3
