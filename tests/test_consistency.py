"""Replicator(check_state_every=K): replicas whose state drifted apart are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.runtime.consistency import check_replicas_agree


def _input(n):
    return lambda ctx: iter([{"x": np.ones((n, 2), np.float32)}] * 100)


def _differs_on(repl, device_id):
    """A 'replicated' array placed by hand with a different value on one device."""
    parts = [jax.device_put(np.full(2, float(d.id == device_id), np.float32), d) for d in repl.mesh.devices.flat]
    return jax.make_array_from_single_device_arrays((2,), NamedSharding(repl.mesh, P()), parts)


def test_identical_replicas_pass_every_step(n_devices):
    repl = rp.Replicator(1, n_devices, check_state_every=1)
    state = {"w": jnp.zeros(2), "n": jnp.int32(0), "flag": jnp.bool_(True), "h": jnp.zeros(3, jnp.bfloat16)}

    def step(s, b):
        return {**s, "w": s["w"] + rp.all_mean(b["x"][0]), "n": s["n"] + 1}, {}

    input_fn = _input(n_devices)
    for _ in range(3):
        state, _ = repl.run(step, input_fn, state)
    assert int(state["n"]) == 3


def test_a_drifted_leaf_is_named_with_the_devices(n_devices):
    repl = rp.Replicator(1, n_devices, check_state_every=2)
    device = repl.mesh.devices.flat[n_devices - 1].id
    state = {"ok": jnp.ones(3), "w": _differs_on(repl, device)}

    def step(s, b):
        return {"ok": s["ok"], "w": s["w"] * 1.0}, {}

    state, _ = repl.run(step, _input(n_devices), state)  # step 1: not checked (K = 2)
    with pytest.raises(rp.DivergentStateError, match=rf"state\['w'\] is no longer identical.*\[{device}\] another"):
        repl.run(step, _input(n_devices), state)


def test_the_checksum_sees_a_one_ulp_change_and_a_swap(n_devices):
    repl = rp.Replicator(1, n_devices)
    sharding = NamedSharding(repl.mesh, P())
    base = np.arange(6, dtype=np.float32)
    for other in (np.nextafter(base, 10).astype(np.float32), base[[1, 0, 2, 3, 4, 5]]):
        parts = [jax.device_put(other if i == 1 else base, d) for i, d in enumerate(repl.mesh.devices.flat)]
        leaf = jax.make_array_from_single_device_arrays((6,), sharding, parts)
        with pytest.raises(rp.DivergentStateError):
            check_replicas_agree([leaf], ["state['x']"])


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="check_state_every must be a positive int"):
        rp.Replicator(1, 1, check_state_every=0)
