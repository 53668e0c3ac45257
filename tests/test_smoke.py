import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp


def test_all_mean_gradient_step_matches_single_device(repl):
    n = repl.num_replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * n, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 3.0], np.float32)).astype(np.float32)

    def loss_fn(w, b):
        return jnp.mean((b["x"] @ w - b["y"]) ** 2)

    def step_fn(w, b):
        loss, g = jax.value_and_grad(loss_fn)(w, b)
        return w - 0.1 * rp.all_mean(g), {"loss": rp.all_mean(loss)}

    def input_fn(ctx):
        while True:
            yield {"x": x, "y": y}

    w0 = jnp.zeros(3)
    w, out = repl.run(step_fn, input_fn, w0)
    ref_loss, ref_g = jax.value_and_grad(loss_fn)(w0, {"x": x, "y": y})
    np.testing.assert_allclose(w, w0 - 0.1 * ref_g, atol=1e-6)
    np.testing.assert_allclose(out["loss"], np.full(n, ref_loss), rtol=1e-6)
