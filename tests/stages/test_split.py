"""The split: which stage runs each equation of a traced step, what crosses, tied parameters, the errors.

Steps are traced with ``jax.make_jaxpr`` (forward, backward and an optax update), as the compiler
traces them. The expected stages are written by hand from the model's structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import replicator as rp
from replicator.core.context import replica_context
from replicator.stages import StageSplitError, split_stages
from replicator.stages.stash import stash_plan

S0, S1, S2 = frozenset({0}), frozenset({1}), frozenset({2})
VOCAB, DIM = 6, 4


def mlp3(p, ids, y):
    """Three stages: an embedding lookup, a hidden layer, a head."""
    h = p["emb"][ids]  # stage 0
    h = rp.stage_boundary(h)
    h = jnp.tanh(h @ p["w1"])  # stage 1
    h = rp.stage_boundary(h)
    logits = h @ p["head"]  # stage 2
    return jnp.mean((logits - y) ** 2)


def tied3(p, ids, y):
    """The head is the embedding, transposed: a parameter of stages 0 and 2."""
    h = p["emb"][ids]
    h = rp.stage_boundary(h)
    h = jnp.tanh(h @ p["w1"])
    h = rp.stage_boundary(h)
    logits = h @ p["emb"].T
    return jnp.mean((logits - y) ** 2)


def params(head: bool = True):
    p = {
        "emb": np.linspace(-1, 1, VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM),
        "w1": np.linspace(-0.5, 0.5, DIM * DIM, dtype=np.float32).reshape(DIM, DIM),
    }
    if head:
        p["head"] = np.linspace(0.2, -0.3, DIM * VOCAB, dtype=np.float32).reshape(DIM, VOCAB)
    return p


BATCH = (np.array([1, 2, 5]), np.ones((3, VOCAB), np.float32))


def traced_step(loss, p, opt=None):
    """``(params, opt_state, ids, y) -> (params, opt_state, loss)`` traced; its state paths."""
    opt = opt or optax.adam(1e-2)

    def step(p, s, ids, y):
        value, g = jax.value_and_grad(loss)(p, ids, y)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, value

    state = (p, opt.init(p))
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    return jax.make_jaxpr(step)(*state, *BATCH), paths


def by_path(split, paths):
    stages = split.state_stages(len(paths))
    return {path: sorted(stages[i]) for i, path in enumerate(paths)}


class TestThreeStages:
    def test_state_lives_where_it_is_read(self):
        closed, paths = traced_step(mlp3, params())
        split = split_stages(closed, num_state=len(paths))
        assert split.num_stages == 3
        held = by_path(split, paths)
        for name, stage in (("emb", 0), ("w1", 1), ("head", 2)):
            assert held[f"[0]['{name}']"] == [stage]
            assert held[f"[1][0].mu['{name}']"] == held[f"[1][0].nu['{name}']"] == [stage]
        assert held["[1][0].count"] == [0, 1, 2]  # Adam's step count: every stage's update reads it
        assert split.tied(len(paths)) == () and split.stage_sums == ()

    def test_boundaries_forward_then_back(self):
        closed, paths = traced_step(mlp3, params())
        split = split_stages(closed, num_state=len(paths))
        got = [(b.sender, b.receiver, b.transposed) for b in split.boundaries]
        assert got == [(0, 1, False), (1, 2, False), (2, 1, True), (1, 0, True)]
        assert all("test_split.py" in b.source and "mlp3" in b.source for b in split.boundaries)
        for b in split.boundaries:
            assert [v.aval.shape for v in b.values] == [(3, DIM)]

    def test_every_stage_runs_forward_backward_update(self):
        closed, paths = traced_step(mlp3, params())
        split = split_stages(closed, num_state=len(paths))
        for stage in range(3):
            phases = {split.phases[i] for i in split.eqns_of(stage)}
            assert phases == {"forward", "backward", "update"}, stage
            assert stash_plan(split, stage).kept, stage  # something kept from the forward for the backward
        # The loss is computed by the last stage; each new parameter by its own.
        outs = split.output_stages
        assert outs[-1] == S2 and outs[0] == S0 and outs[1] == S2 and outs[2] == S1  # emb, head, w1 (sorted keys)

    def test_each_equation_reads_values_of_its_own_stages(self):
        # Every operand is an input, or is computed on each stage that reads it, or is received there.
        closed, paths = traced_step(mlp3, params())
        split = split_stages(closed, num_state=len(paths))
        where = {}
        for i, eqn in enumerate(split.jaxpr.eqns):
            where.update((v, split.eqn_stages[i]) for v in eqn.outvars)
        for b in split.boundaries:
            where.update((v, frozenset({b.receiver})) for v in split.jaxpr.eqns[b.eqn].outvars)
        senders = {b.eqn: frozenset({b.sender}) for b in split.boundaries}
        for i, eqn in enumerate(split.jaxpr.eqns):
            runs_on = senders.get(i, split.eqn_stages[i])
            for v in eqn.invars:
                if isinstance(v, jax.extend.core.Var) and v in where:
                    assert runs_on <= where[v], (i, eqn)

    def test_unmarked_step_is_one_stage(self):
        closed, paths = traced_step(lambda p, ids, y: jnp.mean((p["emb"][ids] @ p["head"] - y) ** 2), params())
        split = split_stages(closed, num_state=len(paths))
        assert split.num_stages == 1 and split.boundaries == ()
        assert all(s == S0 for s in split.state_stages(len(paths)))

    @pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
    def test_jit_and_checkpoint_split_alike(self, wrap):
        closed, paths = traced_step(wrap(mlp3), params())
        split = split_stages(closed, num_state=len(paths))
        plain = split_stages(traced_step(mlp3, params())[0], num_state=len(paths))
        assert split.num_stages == 3
        assert split.state_stages(len(paths)) == plain.state_stages(len(paths))

    def test_frozen_parameter_stays_on_its_stage(self):
        # A state leaf returned unchanged is kept where it is read, not on every stage.
        def step(p, ids, y):
            g = jax.grad(mlp3)(p, ids, y)
            return {**{k: p[k] - 0.1 * g[k] for k in ("emb", "w1")}, "head": p["head"]}

        split = split_stages(jax.make_jaxpr(step)(params(), *BATCH), num_state=3)
        assert split.state_stages(3) == (S0, S2, S1)  # emb, head, w1

    def test_jitted_update_over_every_stage(self):
        # A jax.jit call reading every stage's gradients (a jitted optimizer update) is inlined, not a crossing.
        opt = optax.adam(1e-2)

        def step(p, s, ids, y):
            g = jax.grad(mlp3)(p, ids, y)
            updates, s = jax.jit(opt.update)(g, s, p)
            return optax.apply_updates(p, updates), s

        state = (params(), opt.init(params()))
        n = len(jax.tree.leaves(state))
        split = split_stages(jax.make_jaxpr(step)(*state, *BATCH), num_state=n)
        assert split.num_stages == 3 and split.stage_sums == ()

    def test_checkpointed_layers(self):
        def layer(w, h):
            return rp.stage_boundary(jnp.tanh(h @ w))

        def loss(p, ids, y):
            h = jax.checkpoint(layer)(p["w1"], p["emb"][ids])
            return jnp.mean((h @ p["head"] - y) ** 2)

        closed, paths = traced_step(loss, params())
        split = split_stages(closed, num_state=len(paths))
        held = by_path(split, paths)
        assert split.num_stages == 2 and held["[0]['w1']"] == [0] and held["[0]['head']"] == [1]


class TestTied:
    def test_embedding_and_head(self):
        closed, paths = traced_step(tied3, params(head=False))
        split = split_stages(closed, num_state=len(paths))
        held = by_path(split, paths)
        assert held["[0]['emb']"] == [0, 2] and held["[0]['w1']"] == [1]
        (total,) = split.stage_sums
        assert total.stages == frozenset({0, 2})
        tied = {paths[i] for i in split.tied(len(paths))}
        assert tied == {"[0]['emb']", "[1][0].mu['emb']", "[1][0].nu['emb']"}

    def test_sgd(self):
        closed, paths = traced_step(tied3, params(head=False), opt=optax.sgd(0.1))
        split = split_stages(closed, num_state=len(paths))
        assert [paths[i] for i in split.tied(len(paths))] == ["[0]['emb']"]


def lines_of(fn) -> list[int]:
    """The source lines of ``fn`` tagged ``# <-`` (where an error must point)."""
    import inspect

    source, start = inspect.getsourcelines(fn)
    return [start + k for k, line in enumerate(source) if "# <-" in line]


def raises_at(loss, *tagged_in):
    closed, paths = traced_step(loss, params())
    with pytest.raises(StageSplitError) as info:
        split_stages(closed, num_state=len(paths))
    message = str(info.value)
    for fn in tagged_in or (loss,):
        for line in lines_of(fn):
            assert f"test_split.py:{line} " in message, (line, message)
    return message


class TestErrors:
    def test_boundary_in_a_loop_body(self):
        def body(h, w):
            return rp.stage_boundary(jnp.tanh(h @ w)), None  # <-

        def loss(p, ids, y):
            h, _ = lax.scan(body, p["emb"][ids], jnp.stack([p["w1"], p["w1"]]))  # <-
            return jnp.mean((h @ p["head"] - y) ** 2)

        message = raises_at(loss, body, loss)
        assert "is inside the loop (lax.fori_loop / lax.scan / lax.map) at" in message

    def test_boundary_in_a_fori_loop_names_the_loop(self):
        # lax.fori_loop with static bounds (the only one jax.grad takes) lowers to a scan: the message names
        # the loop the user wrote, at its line, not the primitive it lowered to.
        def body(i, h):
            return rp.stage_boundary(jnp.tanh(h @ h.T @ h))  # <-

        def loss(p, ids, y):
            h = lax.fori_loop(0, 2, body, p["emb"][ids])  # <-
            return jnp.mean((h @ p["head"] - y) ** 2)

        message = raises_at(loss, body, loss)
        assert "is inside the loop (lax.fori_loop" in message and "'scan'" not in message, message

    def test_boundary_in_a_branch(self):
        def loss(p, ids, y):
            h = p["emb"][ids]
            h = lax.cond(jnp.sum(y) > 0, rp.stage_boundary, lambda h: h, h)  # <-
            return jnp.mean((h @ p["head"] - y) ** 2)

        assert "is inside a branch of the lax.cond / lax.switch at" in raises_at(loss)

    def test_skip_connection_past_a_boundary(self):
        def loss(p, ids, y):
            h0 = jnp.tanh(p["emb"][ids] @ p["w1"])  # <-
            h = rp.stage_boundary(h0)
            h = rp.stage_boundary(jnp.tanh(h @ p["w1"]))
            h = h + h0  # <-
            return jnp.mean((h @ p["head"] - y) ** 2)

        message = raises_at(loss)
        assert "(stage 0) is read on stage 2" in message and "rp.stage_boundary((h, skip))" in message

    def test_stage_value_read_two_stages_later(self):
        def loss(p, ids, y):
            h = rp.stage_boundary(jnp.tanh(p["emb"][ids] @ p["w1"]))
            h1 = jnp.tanh(h @ p["w1"])  # <-
            h = rp.stage_boundary(h1)
            h = rp.stage_boundary(jnp.sin(h))
            h = h * h1  # <-
            return jnp.mean((h @ p["head"] - y) ** 2)

        message = raises_at(loss)
        assert "stage 1" in message and "stage 3" in message

    def test_boundary_of_two_stages(self):
        def loss(p, ids, y):
            h = rp.stage_boundary(jnp.tanh(p["emb"][ids] @ p["w1"]))
            h1 = jnp.tanh(h @ p["w1"])
            h = rp.stage_boundary(h1)
            h, h1 = rp.stage_boundary((jnp.sin(h), h1))  # <-
            return jnp.mean((h * h1) @ p["head"] - y)

        assert "receives values computed on different stages ([1], [2])" in raises_at(loss)

    def test_cheap_free_values_are_recomputed(self):
        # A mask of the batch read by two stages is no error: each computes it.
        def loss(p, ids, y):
            mask = (ids > 1).astype(jnp.float32)[:, None]
            h = rp.stage_boundary(p["emb"][ids] * mask)
            return jnp.mean((jnp.tanh(h @ p["head"]) * mask - y) ** 2)

        closed, paths = traced_step(loss, params())
        split = split_stages(closed, num_state=len(paths))
        assert split.num_stages == 2
        assert split.input_stages[len(paths)] == frozenset({0, 1})  # ids


def test_an_update_reading_every_stages_gradients():
    # A global-norm clip sums the gradients of all stages: refused by default; with update_reads_all (every
    # device holds every gradient after the loop) the sum runs on every stage and each update on its own.
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    closed, paths = traced_step(mlp3, params(), opt)
    with pytest.raises(StageSplitError, match="global-norm clip"):
        split_stages(closed, num_state=len(paths))
    split = split_stages(closed, num_state=len(paths), update_reads_all=True)
    held = by_path(split, paths)
    assert held["[0]['emb']"] == [0] and held["[0]['w1']"] == [1] and held["[0]['head']"] == [2]


def test_all_mean_of_several_stages_gradients_splits_per_operand():
    # rp.all_mean(grads) binds one equation for every leaf; each leaf's mean lives on its own stage.
    def step(p, ids, y):
        value, g = jax.value_and_grad(mlp3)(p, ids, y)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, rp.all_mean(g)), value

    with replica_context(rp.ReplicaContext(1, 2)):
        closed = jax.make_jaxpr(step)(params(), *BATCH)
    split = split_stages(closed, num_state=3)
    assert [sorted(s) for s in split.state_stages(3)] == [[0], [2], [1]]  # emb, head, w1


def test_a_steps_constants_stay_constants_not_inputs():
    # A constant the step returns (an array of counts) is a constvar of the traced jaxpr; the split keeps it one
    # (on JAX 0.12, a Jaxpr built with constvars and no values takes them as leading inputs: the state's and
    # the batch's indices then shifted by one, and a pipelined step read a parameter as batch).
    def step(w, x):
        h = rp.stage_boundary(jnp.tanh(x @ w))
        return w, (jnp.mean(h), jnp.array([4.0, 1.0, 4.0], jnp.float32))

    closed = jax.make_jaxpr(step)(jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert len(closed.jaxpr.constvars) == 1
    split = split_stages(closed, num_state=1)
    assert split.jaxpr.constvars == closed.jaxpr.constvars
    assert split.jaxpr.invars == closed.jaxpr.invars
