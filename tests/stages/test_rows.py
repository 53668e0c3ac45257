"""The state of a pipelined step between calls: packed rows reused only for the very leaves a call returned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp
from tests.stages.test_gpipe import four_stages_tied
from tests.stages.test_replicas import _params_for, global_batch
from tests.stages.test_train import _assert_close
from tests.stages.test_user_step import make_step


def _pipelined():
    return rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=4))


def test_a_state_changed_between_calls_is_packed_again():
    """Reusing the rows of the last call for a state the user changed would silently train the old one."""
    p, batch = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    step, repl = make_step(four_stages_tied, opt), _pipelined()
    state, _ = repl.run(step, batch, (p, opt.init(p)))
    params, opt_state = state
    changed = ({**params, "w1": params["w1"] * 0.5}, opt_state)  # one new leaf, the others the same objects
    got, _ = repl.run(step, batch, changed)
    want, _ = jax.jit(make_step(four_stages_tied, opt, mean=False))(jax.tree.map(np.asarray, changed), batch)
    _assert_close(got, want)


def test_the_rows_a_call_returned_are_reused_as_they_are():
    p, batch = _params_for(four_stages_tied), global_batch()
    opt = optax.sgd(0.1)
    step, repl = make_step(four_stages_tied, opt), _pipelined()
    state, _ = repl.run(step, batch, (p, opt.init(p)))
    (built,) = [b for _, b in repl.pipelined._user_steps.values()]
    rows = built._last.rows_for(built.state_def.flatten_up_to(state))
    assert rows is not None and rows is built._last._rows
    packs = []
    original = built.pack
    built.pack = lambda s: packs.append(1) or original(s)
    state, _ = repl.run(step, batch, state)
    assert packs == []  # the returned leaves came back: no packing
    repl.run(step, batch, jax.tree.map(jnp.copy, state))  # equal values, other arrays: packed
    assert packs == [1]


def test_unpacked_leaves_live_on_their_stage_and_round_trip():
    p, batch = _params_for(four_stages_tied), global_batch()
    opt = optax.sgd(0.1)
    step, repl = make_step(four_stages_tied, opt), _pipelined()
    repl.run(step, batch, (p, opt.init(p)))
    (built,) = [b for _, b in repl.pipelined._user_steps.values()]
    mesh_devices = repl.pipelined.mesh.devices
    leaves = built.state_def.flatten_up_to((p, opt.init(p)))
    rows = built.pack((p, opt.init(p)))
    back = built.state_def.flatten_up_to(built.unpack(rows))
    for i, (a, b) in enumerate(zip(leaves, back, strict=True)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        owner = min(built.held[i])
        assert b.devices() <= set(mesh_devices[owner].flat), (i, owner, b.devices())
