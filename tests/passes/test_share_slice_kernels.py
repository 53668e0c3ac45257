"""share-slice-kernels: same-shaped slices of one array start at runtime constants.

Graph checks look at what the pass rewrote (slices -> dynamic slices reading new
runtime constants) and what it left alone; numeric checks run steps through
``Replicator.run`` and compare with ``tests.utils.simulate`` (every replica at once
under ``jax.vmap`` with ``jax.lax`` collectives, no pass of the library) or with
one-device ``jax.jit`` on the global batch; the compile check reads XLA's
compiled program.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from utils import assert_trees_close, check_against_simulation

import replicator as rp
from replicator.passes import PassManager, count_primitives
from replicator.passes.share_slice_kernels import ShareSliceKernels
from replicator.runtime.execution import build_executable, place_state, sharded


def _grads_step(batch):
    """Four 3x4 all-means, one 5-long and one 7-long (one fused buffer: four same-shaped pieces, two others)."""
    x = batch.sum(0)  # (3, 4)
    same = {f"w{i}": x * (i + 1) for i in range(4)}
    other = {"b": jnp.concatenate([x[0], x[1, :1]]), "c": jnp.concatenate([x[0], x[1, :3]])}
    return rp.all_mean({**same, **other})


def _batch(n):
    return np.arange(n * 2 * 3 * 4, dtype=np.float32).reshape(n * 2, 3, 4) / 7


class TestGraph:
    def test_same_shaped_pieces_start_at_runtime_constants(self, repl, n_devices):
        final = repl.lower(_grads_step, _batch(n_devices)).final
        jaxpr = final.jaxpr.jaxpr
        counts = count_primitives(final.jaxpr, ["slice", "dynamic_slice"])
        assert counts.get("dynamic_slice") == 4  # the four 3x4 pieces
        assert counts.get("slice", 0) >= 2  # the 5-long and the 7-long piece: one of each shape, left alone
        dynamic = [e for e in jaxpr.eqns if e.primitive.name == "dynamic_slice"]
        offsets = [e.invars[1] for e in dynamic]
        assert set(offsets) <= final.runtime_constants
        values = dict(zip(jaxpr.constvars, final.jaxpr.consts, strict=True))
        # the buffer holds b (5), c (7), w0..w3 (12 each): the pieces start at 12, 24, 36, 48
        assert sorted(int(values[v]) for v in offsets) == [12, 24, 36, 48]
        assert all(e.invars[0] is dynamic[0].invars[0] for e in dynamic)  # all from the one fused buffer

    def test_without_the_pass_the_pieces_are_static_slices(self, repl, n_devices):
        off = rp.Replicator(1, n_devices, passes=PassManager.default(disable=["share-slice-kernels"]))
        final = off.lower(_grads_step, _batch(n_devices)).final
        assert count_primitives(final.jaxpr, ["dynamic_slice"]).get("dynamic_slice", 0) == 0
        assert not final.runtime_constants

    @pytest.mark.parametrize(
        "step",
        [
            pytest.param(lambda b: rp.all_mean({"a": b.sum(0), "b": b[0, :3]}), id="different-shapes"),
            pytest.param(lambda b: (lambda s: {"a": s[::2], "b": s[1::2]})(rp.all_sum(b[0])), id="strided"),
            pytest.param(lambda b: {"a": b[:2] * 2, "b": b[2:4] * 3}, id="not-a-collective-result"),
            pytest.param(lambda b: (lambda s: {"a": s[:2], "b": s[:2] + 1})(rp.all_sum(b[0])), id="the-same-slice"),
            pytest.param(
                lambda b: (lambda s, m: {"a": s[:2], "b": m[2:]})(rp.all_sum(b[0]), rp.all_max(b[0])),
                id="one-slice-each-of-two-collective-results",
            ),
            pytest.param(
                lambda b: lax.scan(lambda c, x: (c + rp.all_sum(x)[:2].sum() + rp.all_sum(x)[2:].sum(), None), 0.0, b)[
                    0
                ],
                id="in-a-scan",
            ),
        ],
    )
    def test_left_alone(self, step, n_devices):
        repl = rp.Replicator(1, n_devices, passes=PassManager.default(disable=["share-slice-kernels"]))
        graph = repl.lower(step, np.ones((n_devices * 4, 4), np.float32)).after("fuse-collectives")
        result = ShareSliceKernels().run(graph)
        assert not result.changed and result.graph is graph

    def test_a_reduce_scattered_buffer_is_cut_along_its_columns_only(self, n_devices):
        """ZeRO-1's fused reduce-scatter gives each replica a (1, K) row: the pieces start at row 0 (a literal)
        and at their own column (a runtime constant)."""
        params = {f"w{i}": np.ones((n_devices, 4), np.float32) * i for i in range(4)}
        tx = optax.adam(1e-2)

        def step(state, batch):
            p, opt = state
            g = rp.all_mean(jax.tree.map(lambda w: w * batch.sum(), p))
            u, opt = tx.update(g, opt, p)
            return (optax.apply_updates(p, u), opt), {}

        passes = PassManager.default(zero=1, shard_optimizer_min_bytes=0)
        lowered = rp.Replicator(1, n_devices, passes=passes).lower(
            step, np.ones((n_devices, 1), np.float32), (params, tx.init(params))
        )
        graph = lowered.after("share-slice-kernels")
        scattered = {e.outvars[0] for e in graph.jaxpr.jaxpr.eqns if e.primitive.name == "rp.reduce_scatter"}
        dynamic = [
            e for e in graph.jaxpr.jaxpr.eqns if e.primitive.name == "dynamic_slice" and e.invars[0] in scattered
        ]
        assert len(dynamic) == 4
        assert all(e.invars[1].val == 0 for e in dynamic)  # axis 0: a literal
        assert all(e.invars[2] in graph.runtime_constants for e in dynamic)

    def test_slices_of_different_collective_results_are_grouped_apart(self, repl):
        """Two same-shaped slices of each of two all-reduce results: two groups, each piece cut from its own
        result (one group would cut all four from the first result)."""
        graph = repl.lower(_two_results_step, np.ones((repl.num_replicas, 4), np.float32)).after("fuse-collectives")
        sliced = [e.invars[0] for e in graph.jaxpr.jaxpr.eqns if e.primitive.name == "slice"]
        assert len(sliced) == 4 and len(set(sliced)) == 2  # two slices of each of two results
        result = ShareSliceKernels().run(graph)
        assert result.changed
        dynamic = [e for e in result.graph.jaxpr.jaxpr.eqns if e.primitive.name == "dynamic_slice"]
        assert [e.invars[0] for e in dynamic] == sliced  # every piece from the result its slice read
        assert len(result.graph.runtime_constants) == 4

    def test_running_it_twice_changes_nothing(self, repl, n_devices):
        final = repl.lower(_grads_step, _batch(n_devices)).final
        assert not ShareSliceKernels().run(final).changed

    def test_min_group(self, repl, n_devices):
        graph = rp.Replicator(1, n_devices, passes=PassManager.default(disable=["share-slice-kernels"]))
        graph = graph.lower(_grads_step, _batch(n_devices)).after("fuse-collectives")
        assert ShareSliceKernels(min_group=5).run(graph).changed is False
        assert ShareSliceKernels(min_group=4).run(graph).changed is True
        with pytest.raises(ValueError, match="min_group"):
            ShareSliceKernels(min_group=1)


def _two_results_step(batch):
    """Same-shaped halves of two all-reduce results that fusion keeps apart (another group, another op)."""
    x = batch.sum(0)  # (4,)
    s = rp.all_sum(x)
    m = rp.all_max(x * 2, group="cores")
    return {"s0": s[:2], "s1": s[2:], "m0": m[:2], "m1": m[2:]}


class TestNumbers:
    def test_slices_of_different_collective_results(self, mesh2d):
        """Each piece holds its own result's elements (on a square mesh too)."""
        workers, cores = mesh2d
        rng = np.random.default_rng(2)
        batches = [rng.normal(size=(2 * workers * cores, 4)).astype(np.float32)]
        repl = rp.Replicator(workers, cores)
        assert repl.lower(_two_results_step, batches[0][: 2 * cores]).final.runtime_constants  # the pass fired
        check_against_simulation(repl, _two_results_step, batches)

    def test_fused_gradients_equal_the_simulation(self, repl, n_devices):
        batches = [_batch(n_devices) * (s + 1) for s in range(2)]
        check_against_simulation(repl, _grads_step, batches)

    def test_on_a_2d_mesh(self, mesh2d):
        workers, cores = mesh2d
        check_against_simulation(rp.Replicator(workers, cores), _grads_step, [_batch(workers * cores)])

    def test_folded(self, n_devices):
        if n_devices % 2:
            pytest.skip("two replicas per device need an even device count")
        folded = rp.Replicator(
            1, n_devices, parallelism=rp.Parallelism(replicas_per_device=2), devices=jax.devices()[: n_devices // 2]
        )
        check_against_simulation(folded, _grads_step, [_batch(n_devices)])

    @pytest.mark.parametrize("zero_stage", [0, 1, 3])
    def test_adam_on_a_deep_mlp_equals_one_device(self, n_devices, zero_stage):
        """16 same-shaped layers, Adam, 3 steps: parameters equal one-device jit on the global batch."""
        rng = np.random.default_rng(0)
        params = [
            {"w": rng.normal(size=(16, 16)).astype(np.float32) / 4, "b": np.zeros(16, np.float32)} for _ in range(16)
        ]
        tx = optax.adam(1e-2)

        def loss_fn(p, x):
            for layer in p:
                x = jnp.tanh(x @ layer["w"] + layer["b"])
            return jnp.mean(x**2)

        def one_device(state, x):
            p, opt = state
            g = jax.grad(loss_fn)(p, x)
            u, opt = tx.update(g, opt, p)
            return optax.apply_updates(p, u), opt

        def step(state, batch):
            p, opt = state
            g = rp.all_mean(jax.grad(loss_fn)(p, batch))
            u, opt = tx.update(g, opt, p)
            return (optax.apply_updates(p, u), opt), {}

        repl = rp.Replicator(1, n_devices, passes=PassManager.default(zero=zero_stage, shard_optimizer_min_bytes=0))
        final = repl.lower(step, rng.normal(size=(n_devices * 2, 16)).astype(np.float32), (params, tx.init(params)))
        assert final.final.runtime_constants  # the pass fired
        batches = [rng.normal(size=(n_devices * 2, 16)).astype(np.float32) for _ in range(3)]
        want = (params, tx.init(params))
        for x in batches:
            want = jax.jit(one_device)(want, x)
        state = (params, tx.init(params))
        for x in batches:
            state, _ = repl.run(step, x, state)
        assert_trees_close(jax.tree.map(np.asarray, rp.gather_outputs(state)[0]), want[0], atol=5e-6, rtol=5e-5)


# Run by test_in_64_bit_mode in a process of its own: JAX's 64-bit mode, once on, changes what later steps
# of a process trace (and the library caches compiled steps by dtype). argv[1]: the device count.
_X64_CHILD = """
import json, sys
import numpy as np
import replicator as rp
rp.force_cpu_devices(int(sys.argv[1]))
import jax
from replicator.passes import count_primitives

def step(state, batch):
    s = rp.all_sum(batch.sum(0))  # (4, 3): three (2, 3) pieces, at rows 0, 2 and 1 (column 0: a literal start)
    return state + s[:2] * s[2:], s[1:3].sum()

with jax.enable_x64(True):
    n = jax.device_count()
    batch = np.arange(n * 2 * 4 * 3, dtype=np.float64).reshape(n * 2, 4, 3) / 7
    state = np.full((2, 3), 1 / 3)
    repl = rp.Replicator(1, n)
    final = repl.lower(step, batch, state).final
    new, out = repl.run(step, batch, state)
    print(json.dumps({
        "dynamic_slices": count_primitives(final.jaxpr, ["dynamic_slice"]).get("dynamic_slice", 0),
        "offsets": sorted(str(v.aval.dtype) for v in final.runtime_constants),
        "dtypes": [str(new.dtype), str(out.dtype)],
        "state": np.asarray(new).tolist(),
        "out": np.asarray(out).tolist(),
    }))
"""


def test_in_64_bit_mode(n_devices):
    """Under ``jax.enable_x64(True)`` a piece's literal starts (here its column, the same for every piece)
    are int64 and its runtime offsets int32: ``dynamic_slice`` refused the mix. Run in a process of its
    own; float64 numbers equal NumPy's on the global batch to 1e-12 (float32 would be 1e-7 off)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _X64_CHILD, str(n_devices)], capture_output=True, text=True, timeout=600, cwd=root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dynamic_slices"] == 3  # the pass fired: the three pieces start at runtime offsets
    assert got["offsets"] == ["int32"] * 3
    assert got["dtypes"] == ["float64", "float64"]
    batch = np.arange(n_devices * 2 * 4 * 3, dtype=np.float64).reshape(n_devices * 2, 4, 3) / 7
    s = batch.sum(0)
    np.testing.assert_allclose(got["state"], np.full((2, 3), 1 / 3) + s[:2] * s[2:], rtol=1e-12)
    np.testing.assert_allclose(got["out"], np.full(n_devices, s[1:3].sum()), rtol=1e-12)


def _distinct_fusions(hlo: str) -> int:
    """How many different fused computations a compiled HLO module has (names and metadata ignored)."""
    bodies = re.findall(r"^%fused_computation[\w.]* \((.*?)\) -> (.*?) \{\n(.*?)\n\}", hlo, re.S | re.M)
    names = r"metadata=\{[^}]*\}|%[\w.\-]+|\bparam_[\d.]+"
    norm = {re.sub(names, "", params + ret + body) for params, ret, body in bodies}
    return len(norm)


def test_readers_of_same_shaped_pieces_compile_to_one_kernel(n_devices):
    """16 all-reduced 8x8 tensors, each then updated as ``y * 0.5 + 1``: with static slices XLA compiles one
    reader per tensor; with runtime offsets the readers are one fusion, compiled once."""
    xs = {f"w{i}": np.full((8, 8), i, np.float32) for i in range(16)}

    def step(state, batch):
        g = rp.all_mean(jax.tree.map(lambda w: w * batch.sum(), state))
        return jax.tree.map(lambda w, d: w * 0.5 + d, state, g), {}

    batch = np.ones((n_devices, 1), np.float32)
    distinct = {}
    for name, disable in [("static", ["share-slice-kernels"]), ("runtime", [])]:
        repl = rp.Replicator(1, n_devices, passes=PassManager.default(disable=disable))
        final = repl.lower(step, batch, xs).final
        exe = build_executable(final, repl.mesh)
        state = place_state(jax.tree.leaves(xs), repl.mesh)
        compiled = exe.lower(state, [jax.device_put(batch, sharded(repl.mesh))]).compile()
        distinct[name] = _distinct_fusions(compiled.as_text())
    assert distinct["runtime"] + 10 <= distinct["static"], distinct
