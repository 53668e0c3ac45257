"""capture-collectives: code written for jax.pmap / shard_map runs unchanged.

Numbers are checked against JAX running the same unchanged function under
``jax.pmap`` (all replicas) or ``jax.shard_map`` (groups), and by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import replicator as rp
from replicator.passes import (
    CaptureCollectives,
    CheckReplicaInvariance,
    LowerCollectives,
    PassManager,
    count_primitives,
)

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="written for 8 devices")

RAW = ["psum", "pmax", "pmin", "all_gather", "reduce_scatter", "axis_index", "ppermute"]
PLACEHOLDERS = ["rp.all_reduce", "rp.all_gather", "rp.reduce_scatter", "rp.replica_id"]
X = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 7.0  # row r: replica r's values


def pmap_style(w, x):
    """A step as written for jax.pmap(axis_name='batch'): x is this replica's row."""

    def loss(w):
        return lax.pmean(jnp.sum(jnp.sin(x * w) ** 2), "batch")

    g = lax.pmean(jax.grad(loss)(w), "batch")
    return w - 0.5 * g, {
        "sum": lax.psum(x, "batch"),
        "max": lax.pmax(x, "batch"),
        "min": lax.pmin(x, "batch"),
        "rows": lax.all_gather(x, "batch"),
        "tiled": lax.all_gather(x, "batch", tiled=True),
        "chunk": lax.psum_scatter(jnp.tile(x, 8), "batch", tiled=True),
        "untiled": lax.psum_scatter(jnp.tile(x[:1], 8), "batch"),
        "id": lax.axis_index("batch"),
        "next": lax.ppermute(x, "batch", [(i, (i + 1) % 8) for i in range(8)]),
    }


def _input_fn(workers):
    rows = 8 // workers
    return lambda ctx: iter([{"x": X[rows * ctx.worker_id : rows * (ctx.worker_id + 1)]}])


def _step(w, batch):
    return pmap_style(w, batch["x"][0])


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_pmap_code_matches_jax_pmap(mesh):
    repl = rp.Replicator(*mesh, axis_name="batch")
    w0 = jnp.array([0.3, -0.2, 0.1])
    w, out = repl.run(_step, _input_fn(mesh[0]), w0)
    want_w, want = jax.pmap(pmap_style, axis_name="batch", in_axes=(None, 0))(w0, X)
    np.testing.assert_allclose(w, want_w[0], rtol=1e-5, atol=1e-6)
    for key in want:
        np.testing.assert_allclose(np.asarray(out[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(out["sum"][3], X.sum(0), rtol=1e-6)  # and by hand
    np.testing.assert_array_equal(out["id"], np.arange(8))


def test_every_raw_collective_becomes_a_placeholder():
    repl = rp.Replicator(2, 4, axis_name="batch")
    lowered = repl.lower(_step, {"x": X[:4]}, jnp.zeros(3))
    before = count_primitives(lowered.traced.jaxpr, RAW)
    after = count_primitives(lowered.after("capture-collectives").jaxpr, RAW + PLACEHOLDERS)
    assert before["psum"] >= 3 and before["axis_index"] == 1 and before["reduce_scatter"] == 2
    assert {k: after.get(k, 0) for k in RAW} == {k: int(k == "ppermute") for k in RAW}  # ppermute: renamed
    assert after["rp.all_gather"] == 2 and after["rp.reduce_scatter"] == 2 and after["rp.replica_id"] == 1
    ppermute = next(e for e in lowered.final.jaxpr.jaxpr.eqns if e.primitive.name == "ppermute")
    assert tuple(ppermute.params["axis_name"]) == ("workers", "cores")  # the user's name, renamed


def _grouped(x):
    """Written for shard_map over ('outer', 'local'); runs on a Replicator that maps the names."""
    return {
        "local_sum": lax.psum(x, "local"),
        "outer_max": lax.pmax(x, "outer"),
        "local_id": lax.axis_index("local"),
        "all": lax.psum(x, ("outer", "local")),
    }


def test_groups_match_shard_map():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("outer", "local"))
    spec = PartitionSpec(("outer", "local"))
    per_shard = lambda x: jax.tree.map(lambda a: jnp.reshape(a, (1, -1)), _grouped(x[0]))  # noqa: E731
    want = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))(X)
    repl = rp.Replicator(2, 4, axis_name={"outer": "workers", "local": "cores"})
    got = repl.run(lambda b: _grouped(b["x"][0]), _input_fn(2))
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]).reshape(8, -1), want[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(got["local_sum"][6], X[4:].sum(0), rtol=1e-6)  # and by hand


def test_unbound_axis_name_says_how_to_map_it():
    repl = rp.Replicator(1, 8)
    with pytest.raises(NameError, match=r"'batch', which is not bound.*Replicator\(\.\.\., axis_name='batch'\)"):
        repl.run(lambda b: lax.pmean(b["x"], "batch"), _input_fn(1))


def test_the_mesh_names_are_always_bound():
    repl = rp.Replicator(2, 4)
    out = repl.run(lambda b: lax.psum(b["x"], "cores"), _input_fn(2))
    np.testing.assert_allclose(out[5, 0], X[4:].sum(0), rtol=1e-6)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda x: lax.psum(x, "batch", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]), "axis_index_groups"),
        (lambda x: lax.all_gather(x, ("cores", "workers")), "not one replica group"),
    ],
    ids=["axis_index_groups", "axes-out-of-order"],
)
def test_collectives_that_are_not_one_group_are_rejected(fn, match):
    repl = rp.Replicator(2, 4, axis_name="batch")
    with pytest.raises(rp.passes.CaptureError, match=match):
        repl.lower(lambda b: fn(b["x"]), {"x": X[:4]})


@pytest.mark.parametrize(
    ("axis_name", "match"),
    [({"cores": None}, "always bound"), ({"batch": "rows"}, "map it to None"), (3, "must be a name")],
)
def test_bad_axis_name_mappings(axis_name, match):
    with pytest.raises((ValueError, TypeError), match=match):
        rp.Replicator(1, 8, axis_name=axis_name)


def test_capture_must_come_before_the_library_passes():
    with pytest.raises(ValueError, match="'capture-collectives' must come before.*'check-replica-invariance'"):
        PassManager([CheckReplicaInvariance(), CaptureCollectives(), LowerCollectives()])


def test_divergent_control_flow_is_caught_in_pmap_code_too():
    repl = rp.Replicator(1, 8, axis_name="batch")

    def step(b):
        x = b["x"][0]
        return lax.cond(x.sum() > 1, lambda v: lax.pmean(v, "batch"), lambda v: v, x)

    with pytest.raises(rp.DivergentControlFlowError):
        repl.run(step, _input_fn(1))


def test_raw_collectives_inside_remat_scan_and_cond():
    # Found by the fuzzer's 'lax' variant: the enclosing remat/scan kept JAX's named-axis
    # effect of the captured psum, and the graph no longer type-checked.
    def step(w, batch):
        x = batch["x"][0]

        def body(c, xi):
            return c + lax.pmean(xi, "batch") * xi, None

        loss_fn = jax.checkpoint(lambda w: lax.scan(body, jnp.zeros(()), x * w)[0])
        g = lax.pmean(jax.grad(loss_fn)(w), "batch")
        flag = lax.pmax(x[0], "batch") > 0  # identical on every replica
        y = lax.cond(flag, lambda v: lax.psum(v, "batch"), lambda v: v, x)
        return w - 0.1 * g, {"y": y}

    repl = rp.Replicator(2, 4, axis_name="batch")
    w0 = jnp.array([0.5, -1.0, 2.0])
    w, out = repl.run(step, _input_fn(2), w0)
    after = repl.lower(step, {"x": X[:4]}, w0).after("capture-collectives").jaxpr
    assert count_primitives(after, ["psum", "pmax"]) == {}
    want_w, want = jax.pmap(lambda x: step(w0, {"x": x[None]}), axis_name="batch")(X)
    np.testing.assert_allclose(w, want_w[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["y"]), want["y"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["y"])[0], X.sum(0), rtol=1e-6)  # by hand: X is positive
