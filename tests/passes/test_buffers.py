"""The shared helpers: flat buffers, byte sizes, effects, regions, collective origins."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp
from replicator.analysis.records import emitted_bytes, origin_of
from replicator.core.buffers import nbytes, pack, per_dtype_buffers, unpack
from replicator.core.graph import Origin
from replicator.core.jaxprs import iter_eqns, iter_regions, merge_effects
from replicator.passes.fuse_collectives import fusion_report


@pytest.mark.parametrize("dtype", [np.float32, np.int8, jnp.bfloat16, np.bool_])
def test_nbytes_is_elements_times_itemsize(dtype):
    assert nbytes(jax.ShapeDtypeStruct((3, 5), dtype)) == 15 * np.dtype(dtype).itemsize
    assert nbytes(jax.ShapeDtypeStruct((), dtype)) == np.dtype(dtype).itemsize
    assert nbytes(jax.ShapeDtypeStruct((0, 4), dtype)) == 0


def test_pack_and_unpack_round_trip_flat_and_by_rows():
    xs = [jnp.arange(12.0).reshape(4, 3), jnp.arange(4.0) + 100]
    buf, sizes = pack(xs)
    assert buf.shape == (16,) and sizes == (12, 4)
    for x, y in zip(xs, unpack(buf, sizes, [x.shape for x in xs]), strict=True):
        np.testing.assert_array_equal(x, y)
    # Padding at the end of a 1-D buffer is dropped.
    padded = jnp.concatenate([buf, jnp.zeros(3)])
    np.testing.assert_array_equal(unpack(padded, sizes, [(4, 3), (4,)])[1], xs[1])
    # By rows: row r of the buffer holds row r of every array.
    buf, cols = pack(xs, rows=2)
    assert buf.shape == (2, 8) and cols == (6, 2)
    np.testing.assert_array_equal(buf[1], jnp.concatenate([xs[0][2:].ravel(), xs[1][2:]]))
    back = unpack(buf, cols, [(4, 3), (4,)])
    np.testing.assert_array_equal(back[0], xs[0])
    np.testing.assert_array_equal(back[1], xs[1])


def test_per_dtype_buffers_one_buffer_per_dtype_and_weak_type():
    xs = [jnp.ones((2, 2), jnp.float32), jnp.ones(3, jnp.int32), jnp.zeros((0,), jnp.float32), jnp.ones(5)]
    seen = []

    def fn(buffers):
        seen.extend((b.shape, b.dtype) for b in buffers)
        return [b * 2 for b in buffers]

    out = per_dtype_buffers(xs, fn)
    assert seen == [((9,), jnp.float32), ((3,), jnp.int32)]
    assert [o.shape for o in out] == [(2, 2), (3,), (0,), (5,)]
    np.testing.assert_array_equal(out[0], 2 * np.ones((2, 2)))
    assert out[2] is xs[2]  # zero-size: returned as it is
    # Nothing left to pack: fn is not called.
    assert per_dtype_buffers([jnp.zeros((0,))], lambda b: pytest.fail("called")) is not None


def test_per_dtype_buffers_traces_to_one_concatenate_per_dtype():
    def f(a, b, c):
        return per_dtype_buffers([a, b, c], lambda bufs: [lax.neg(x) for x in bufs])

    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones(4, jnp.int32), jnp.ones(2))
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("concatenate") == 1 and names.count("neg") == 2


def test_merge_effects_unions_items_and_base():
    class Item:
        def __init__(self, *effects):
            self.effects = frozenset(effects)

    assert merge_effects([Item("a"), Item("b", "a")], base={"c"}) == frozenset("abc")
    assert merge_effects([]) == frozenset()


def test_iter_regions_names_match_fusion_buckets(repl):
    n = repl.num_replicas

    def step(b):
        def body(carry, x):
            return carry + rp.all_sum(x) + rp.all_sum(2 * x), None

        total, _ = lax.scan(body, jnp.zeros(3), b["x"].reshape(-1, 3))
        return rp.all_mean(total)

    graph = repl.lower(step, {"x": np.ones((2 * n, 3), np.float32)}).traced
    regions = {r for r, e in iter_regions(graph.jaxpr.jaxpr) if e.primitive.name == "rp.all_reduce"}
    buckets = {b.region for b in fusion_report(graph)}
    assert regions == buckets and any("/scan@" in r for r in regions)
    # Every equation once, callees before the equation holding them.
    assert len(list(iter_regions(graph.jaxpr.jaxpr))) == len(list(iter_eqns(graph.jaxpr.jaxpr)))


def test_origins_follow_fused_and_compressed_buckets(repl):
    n = repl.num_replicas

    def step(b):
        return rp.all_mean(b["x"]), rp.all_mean(b["y"]), rp.all_sum(b["x"].sum())

    batch = {"x": np.ones((n, 4), np.float32), "y": np.ones((n, 2), np.float32)}
    lowered = rp.Replicator(1, n, passes=rp.PassManager.default(compress=True)).lower(step, batch)
    fused = lowered.after("fuse-collectives")
    placeholders = [e for e in iter_eqns(fused.jaxpr.jaxpr) if e.primitive.name == "rp.all_reduce"]
    carried = sorted(origin_of(e, fused.collective_origins).tensors for e in placeholders)
    assert carried == [1, 2]  # the two means in one bucket; the sum alone, kept as written
    records = lowered.final.collectives
    assert sorted((r.kind, r.tensors, r.dtype) for r in records) == [
        ("all_sum", 1, "bfloat16"),
        ("all_sum", 2, "bfloat16"),
    ]
    assert all(len(r.sources) == r.tensors for r in records)
    assert sum(r.emitted_bytes for r in records) == emitted_bytes(lowered.final.jaxpr.jaxpr)
    assert Origin.merge([Origin(1, ("a",)), Origin(2, ("b", "c"))]) == Origin(3, ("a", "b", "c"))
