"""Correctness matrix of the cross-replica placeholders against NumPy.

Every placeholder is run through ``Replicator.run`` on per-replica-distinct
data, in every context a step may put it in (plain, ``jit``, ``cond``,
``scan``, ``while_loop``, ``checkpoint``, under ``grad``), for every group, under
``vmap`` and inside custom-derivative functions, and compared with a NumPy
reference computed from the global batch. Gradients live in
``test_placeholders_grad.py``.

Replica ``r`` gets rows ``r * k:(r + 1) * k`` of the global batch (``k`` = the
number of replicas, so that ``reduce_scatter`` can split a per-replica leaf).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from utils import (
    CASE_PARAMS,
    COLS,
    CONTEXTS,
    assert_matches,
    data,
    per_replica,
    reference,
    run_step,
)

import replicator as rp

# The shared helpers (run_step, the cases and their NumPy references, the contexts) live in
# tests/utils.py, with test_placeholders_grad.py.


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_placeholder_in_context_matches_numpy(repl, case, context):
    n = repl.num_replicas
    x = data((n * n, COLS))
    wrapped = CONTEXTS[context](lambda v: case.fn(v, None))
    got = run_step(repl, lambda b: wrapped(b["x"]), {"x": x})
    assert_matches(got, reference(repl, case.ref, per_replica(x, n)))


# ----------------------------------------------------------------------------
# 2. Groups on a 2-D mesh
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, "cores", "workers"])
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_placeholder_over_group_matches_numpy(repl2d, case, group):
    n = repl2d.num_replicas
    x = data((n * n, COLS), seed=1)
    got = run_step(repl2d, lambda b: case.fn(b["x"], group), {"x": x})
    assert_matches(got, reference(repl2d, case.ref, per_replica(x, n), group))


def test_replica_ids_of_all_groups_on_2d_mesh(repl2d):
    n, cores = repl2d.num_replicas, repl2d.cores_per_worker

    def step(b):
        return {g or "all": rp.replica_id(group=g) for g in (None, "cores", "workers")}

    got = run_step(repl2d, step, {"x": np.zeros((n, 1), np.float32)})
    ids = np.arange(n, dtype=np.int32)
    assert_matches(got["all"], ids)
    assert_matches(got["cores"], ids % cores)
    assert_matches(got["workers"], ids // cores)


def test_group_sizes(repl2d):
    sizes = {}

    def step(b):
        sizes.update({g: rp.num_replicas(group=g) for g in (None, "cores", "workers")})
        return b

    run_step(repl2d, step, {"x": np.zeros((repl2d.num_replicas, 1), np.float32)})
    assert sizes == {
        None: repl2d.num_replicas,
        "cores": repl2d.cores_per_worker,
        "workers": repl2d.num_workers,
    }


# ----------------------------------------------------------------------------
# 3. vmap inside the step, custom_jvp and custom_vjp
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("in_axis", [0, 1])
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_placeholder_under_vmap_matches_numpy(repl, case, in_axis):
    n, lanes = repl.num_replicas, 2
    z = data((n * lanes, n, COLS), seed=2)  # each replica: (lanes, k, d)

    def step(b):
        zb = jnp.moveaxis(b["z"], 0, in_axis)
        return jax.vmap(lambda v: case.fn(v, None), in_axes=in_axis)(zb)

    got = run_step(repl, step, {"z": z})
    zs = per_replica(z, n)  # (n, lanes, k, d)
    want = np.stack([reference(repl, case.ref, zs[:, lane]) for lane in range(lanes)], axis=1)
    assert_matches(got, want)


def test_vmap_with_batched_and_unbatched_leaves_and_nested(repl):
    n = repl.num_replicas
    z = data((n * 2, 3, COLS), seed=3)

    def step(b):
        z, fixed = b["z"], b["z"][0, 0]

        def lane(row):  # row: (3, d); fixed is not batched
            return rp.all_sum((row, fixed)), jax.vmap(lambda r: rp.all_gather(r, tiled=True))(row)

        return jax.vmap(lane)(z)

    (summed, fixed_sum), gathered = run_step(repl, step, {"z": z})
    zs = per_replica(z, n)  # (n, 2, 3, d)
    assert_matches(summed, np.broadcast_to(zs.sum(0), (n, *zs.shape[1:])))
    assert_matches(fixed_sum, np.broadcast_to(zs[:, 0, 0].sum(0), (n, 2, COLS)))
    # gathered[r, lane, row] = concatenate over replicas s of zs[s, lane, row]
    want = zs.transpose(1, 2, 0, 3).reshape(2, 3, n * COLS)
    assert_matches(gathered, np.broadcast_to(want, (n, 2, 3, n * COLS)))


def _custom_jvp_of(fn: Callable) -> Callable:
    wrapped = jax.custom_jvp(fn)
    wrapped.defjvp(lambda primals, tangents: (fn(*primals), jnp.zeros_like(fn(*primals))))
    return wrapped


def _custom_vjp_of(fn: Callable) -> Callable:
    wrapped = jax.custom_vjp(fn)
    wrapped.defvjp(lambda x: (fn(x), x), lambda x, g: (jnp.zeros_like(x),))
    return wrapped


@pytest.mark.parametrize("custom", [_custom_jvp_of, _custom_vjp_of], ids=["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_placeholder_inside_custom_derivative_function(repl, case, custom):
    n = repl.num_replicas
    x = data((n * n, COLS), seed=4)
    fn = custom(lambda v: case.fn(v, None))
    got = run_step(repl, lambda b: fn(b["x"]), {"x": x})
    assert_matches(got, reference(repl, case.ref, per_replica(x, n)))


# ----------------------------------------------------------------------------
# 5. Pytrees of mixed dtypes
# ----------------------------------------------------------------------------


def _mixed_batch(n: int, rows: int = 2) -> dict:
    rng = np.random.default_rng(5)
    return {
        "f": rng.normal(size=(n * rows, COLS)).astype(np.float32),
        "i": rng.integers(-50, 50, size=(n * rows, COLS)).astype(np.int32),
        "b": rng.random(size=(n * rows, COLS)) < 0.3,
    }


def test_pytree_all_sum_mixed_dtypes(repl):
    n = repl.num_replicas
    batch = _mixed_batch(n)

    def step(b):
        return rp.all_sum({"f": b["f"], "t": (b["i"], jnp.sum(b["f"])), "py": 1.0})

    got = run_step(repl, step, batch)
    f, i = per_replica(batch["f"], n), per_replica(batch["i"], n)
    assert_matches(got["f"], np.broadcast_to(f.sum(0), f.shape))
    assert_matches(got["t"][0], np.broadcast_to(i.sum(0, dtype=np.int32), i.shape))
    assert_matches(got["t"][1], np.full(n, f.sum(), np.float32))
    assert_matches(got["py"], np.full(n, n, np.float32))


@pytest.mark.parametrize("op", ["max", "min"])
def test_pytree_all_max_min_mixed_dtypes_incl_bool(repl, op):
    n = repl.num_replicas
    batch = _mixed_batch(n)
    collective = {"max": rp.all_max, "min": rp.all_min}[op]
    got = run_step(repl, lambda b: collective(b), batch)
    for key in ("f", "i", "b"):
        xs = per_replica(batch[key], n)
        want = xs.max(0) if op == "max" else xs.min(0)
        assert_matches(got[key], np.broadcast_to(want, xs.shape))
    # bool all_max is "any replica", all_min is "every replica"
    assert got["b"].dtype == np.bool_


@pytest.mark.parametrize("source", [0, -1])
def test_pytree_broadcast_mixed_dtypes_incl_bool(repl, source):
    n = repl.num_replicas
    batch = _mixed_batch(n)
    src = source % n
    got = run_step(repl, lambda b: rp.broadcast((b["f"], [b["i"], {"b": b["b"]}]), source=src), batch)
    for leaf, key in zip(jax.tree.leaves(got), ("f", "i", "b"), strict=True):
        xs = per_replica(batch[key], n)
        assert_matches(leaf, np.broadcast_to(xs[src], xs.shape))


def test_pytree_all_gather_and_reduce_scatter_mixed_dtypes(repl):
    n = repl.num_replicas
    batch = _mixed_batch(n, rows=n)

    def step(b):
        return {
            "gather": rp.all_gather({"i": b["i"], "b": b["b"], "s": jnp.sum(b["f"])}),
            "scatter": rp.reduce_scatter((b["f"], b["i"])),
        }

    got = run_step(repl, step, batch)
    f, i, bl = (per_replica(batch[k], n) for k in ("f", "i", "b"))
    assert_matches(got["gather"]["i"], np.broadcast_to(i, (n, *i.shape)))
    assert_matches(got["gather"]["b"], np.broadcast_to(bl, (n, *bl.shape)))
    assert_matches(got["gather"]["s"], np.broadcast_to(f.sum((1, 2)), (n, n)))
    assert_matches(got["scatter"][0], f.sum(0)[:, None].reshape(n, 1, COLS))
    assert_matches(got["scatter"][1], i.sum(0, dtype=np.int32).reshape(n, 1, COLS))


def test_pytree_all_mean_of_float_tree_and_empty_tree(repl):
    n = repl.num_replicas
    batch = _mixed_batch(n)

    def step(b):
        assert rp.all_sum({}) == {}
        assert rp.all_gather(()) == ()
        f16 = b["f"].astype(jnp.float16)
        return rp.all_mean({"f": b["f"], "h": f16, "n": [jnp.float32(2.0)]})

    got = run_step(repl, step, batch)
    f = per_replica(batch["f"], n)
    assert_matches(got["f"], np.broadcast_to(f.mean(0), f.shape))
    assert got["h"].dtype == np.float16
    np.testing.assert_allclose(got["h"], np.broadcast_to(f.mean(0), f.shape), atol=2e-2)
    assert_matches(got["n"][0], np.full(n, 2.0, np.float32))


# ----------------------------------------------------------------------------
# 6. Errors at call time
# ----------------------------------------------------------------------------


def _raises_in_step(repl: rp.Replicator, fn: Callable, exc: type, match: str) -> None:
    n = repl.num_replicas
    with pytest.raises(exc, match=match):
        run_step(repl, lambda b: fn(b["x"]), {"x": np.zeros((n * n, COLS), np.float32)})


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: rp.all_gather(x, axis=3), r"all_gather: axis=3 is out of range .*rank 2 \(valid: -3\.\.2\)"),
        (lambda x: rp.all_gather(x, axis=-4), r"all_gather: axis=-4 is out of range"),
        (lambda x: rp.all_gather(x, axis=2, tiled=True), r"all_gather: axis=2 is out of range .*\(valid: -2\.\.1\)"),
        (lambda x: rp.all_gather(x[0, 0], tiled=True), r"all_gather\(tiled=True\) needs leaves of rank >= 1"),
        (lambda x: rp.all_gather(x, axis=1.0), r"all_gather: axis must be an int"),
        (lambda x: rp.reduce_scatter(x, axis=2), r"reduce_scatter: axis=2 is out of range"),
        (lambda x: rp.reduce_scatter(x, axis=-3), r"reduce_scatter: axis=-3 is out of range"),
        (lambda x: rp.reduce_scatter(x[0, 0]), r"reduce_scatter needs leaves of rank >= 1"),
    ],
)
def test_bad_axis_raises(repl, fn, match):
    _raises_in_step(repl, fn, (ValueError, TypeError), match)


def test_reduce_scatter_not_divisible_raises(repl):
    n = repl.num_replicas
    _raises_in_step(
        repl,
        lambda x: rp.reduce_scatter(jnp.zeros((2, n + 1)), axis=1),
        ValueError,
        rf"axis 1 of a leaf with shape \(2, {n + 1}\) has size {n + 1}, not divisible by the {n} replicas of group=None",
    )


@pytest.mark.parametrize("group", ["cores", "workers"])
def test_reduce_scatter_not_divisible_by_group_raises(repl2d, group):
    size = repl2d.cores_per_worker if group == "cores" else repl2d.num_workers
    if size == 1:
        pytest.skip(f"group={group!r} has one replica: every size is divisible")
    _raises_in_step(
        repl2d,
        lambda x: rp.reduce_scatter(jnp.zeros(size + 1), group=group),
        ValueError,
        rf"not divisible by the {size} replicas of group={group!r}",
    )


@pytest.mark.parametrize("source", ["n", -1, 1.0])
def test_broadcast_source_out_of_range_raises(repl, source):
    n = repl.num_replicas
    source = n if source == "n" else source
    _raises_in_step(
        repl,
        lambda x: rp.broadcast(x, source=source),
        ValueError,
        rf"broadcast: source={source!r} is out of range; .* source must be an int in 0\.\.{n - 1}",
    )


def test_broadcast_source_out_of_range_of_group_raises(repl2d):
    workers = repl2d.num_workers
    _raises_in_step(
        repl2d,
        lambda x: rp.broadcast(x, source=workers, group="workers"),
        ValueError,
        rf"source={workers} is out of range; group='workers' has {workers} replicas",
    )


ALL_APIS = {
    "all_sum": lambda x, **kw: rp.all_sum(x, **kw),
    "all_mean": lambda x, **kw: rp.all_mean(x, **kw),
    "all_max": lambda x, **kw: rp.all_max(x, **kw),
    "all_min": lambda x, **kw: rp.all_min(x, **kw),
    "all_gather": lambda x, **kw: rp.all_gather(x, **kw),
    "broadcast": lambda x, **kw: rp.broadcast(x, **kw),
    "reduce_scatter": lambda x, **kw: rp.reduce_scatter(x, **kw),
    "replica_id": lambda x, **kw: rp.replica_id(**kw),
    "num_replicas": lambda x, **kw: jnp.asarray(rp.num_replicas(**kw)),
}


@pytest.mark.parametrize("api", list(ALL_APIS))
def test_bad_group_raises(repl, api):
    _raises_in_step(
        repl,
        lambda x: ALL_APIS[api](x, group="bad"),
        ValueError,
        rf"{api}\(group='bad'\): group must be None \(all replicas\), 'cores' .* or 'workers'",
    )


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_all_mean_of_non_floats_raises(repl, dtype):
    match = (
        r"all_mean: leaf x\['bad'\] has dtype int32, and a mean of integers"
        if dtype == jnp.int32
        else r"is boolean and cannot be summed"
    )
    _raises_in_step(repl, lambda x: rp.all_mean({"ok": x, "bad": x.astype(dtype)}), TypeError, match)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: rp.all_sum(x > 0),
        lambda x: rp.reduce_scatter(x > 0),
    ],
    ids=["all_sum", "reduce_scatter"],
)
def test_sum_of_bools_raises(repl, fn):
    _raises_in_step(repl, fn, TypeError, r"is boolean and cannot be summed; cast first")


def test_non_array_leaf_raises(repl):
    _raises_in_step(
        repl, lambda x: rp.all_sum({"x": x, "s": "text"}), TypeError, r"all_sum: every leaf must be an array"
    )


@pytest.mark.parametrize("api", list(ALL_APIS))
def test_placeholder_outside_a_step_raises(api):
    with pytest.raises(
        RuntimeError, match=rf"replicator\.{api}\(\) was called outside a replicated step.*Replicator\.run"
    ):
        ALL_APIS[api](jnp.ones((4, 2)))


def test_placeholder_outside_a_step_under_jit_raises():
    with pytest.raises(RuntimeError, match=r"all_sum\(\) was called outside a replicated step.*Replicator\.run"):
        jax.jit(rp.all_sum)(jnp.ones(3))


def test_placeholder_primitive_evaluated_eagerly_raises():
    from replicator.core.primitives import all_reduce_p

    with pytest.raises(RuntimeError, match=r"placeholder '(rp\.)?all_reduce' was evaluated eagerly.*Replicator\.run"):
        all_reduce_p.bind(jnp.ones(3), op="sum", group=None, group_size=2)
