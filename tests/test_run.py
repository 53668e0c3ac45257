"""Replicator.run: semantics, caching, and errors on bad input."""

import os
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import replicator as rp


def _forever(batch):
    def input_fn(ctx):
        while True:
            yield batch

    return input_fn


class TestSemantics:
    def test_without_state_outputs_are_stacked_in_replica_order(self, repl2d):
        n, c = repl2d.num_replicas, repl2d.cores_per_worker
        seen = []

        def input_fn(ctx):
            seen.append(ctx.worker_id)
            base = 1000 * ctx.worker_id
            while True:
                yield {"x": base + np.arange(2 * c, dtype=np.float32)}

        out = repl2d.run(lambda b: {"rows": b["x"], "rid": rp.replica_id()}, input_fn)
        assert seen == list(range(repl2d.num_workers))  # once per worker
        np.testing.assert_array_equal(out["rid"], np.arange(n))
        for r in range(n):
            w, core = divmod(r, c)
            np.testing.assert_array_equal(out["rows"][r], 1000 * w + np.arange(2 * core, 2 * core + 2))

    def test_state_comes_back_once_and_stays_on_the_mesh(self, repl):
        state = {"w": jnp.ones(3), "count": jnp.int32(0)}

        def step(s, b):
            return {"w": s["w"] + rp.all_mean(b["x"]).sum(0), "count": s["count"] + 1}, {}

        batch = {"x": np.ones((repl.num_replicas, 3), np.float32)}
        state, out = repl.run(step, _forever(batch), state)
        assert out == {}
        assert state["w"].shape == (3,) and int(state["count"]) == 1
        assert isinstance(state["w"].sharding, NamedSharding) and state["w"].sharding.mesh == repl.mesh
        assert state["w"].sharding.is_fully_replicated
        np.testing.assert_allclose(state["w"], 2.0)

    def test_input_fn_is_continued_across_calls(self, repl):
        n = repl.num_replicas
        calls = []

        def input_fn(ctx):
            calls.append(ctx)
            for i in range(3):
                yield {"x": np.full((n,), i, np.float32)}

        firsts = [float(repl.run(lambda b: b["x"], input_fn)[0, 0]) for _ in range(3)]
        assert firsts == [0.0, 1.0, 2.0] and len(calls) == 1
        with pytest.raises(rp.InputExhausted, match="exhausted after 3 batches") as info:
            repl.run(lambda b: b["x"], input_fn)
        assert not isinstance(info.value, StopIteration)  # PEP 479 would turn one into RuntimeError
        with pytest.raises(rp.InputExhausted, match=r"catch replicator\.InputExhausted"):  # and stays exhausted
            repl.run(lambda b: b["x"], input_fn)

    def test_input_exhausted_propagates_out_of_generators(self, repl):
        """A generator that runs steps, or an input_fn fed by one, sees InputExhausted, not RuntimeError."""
        n = repl.num_replicas

        def raw(ctx):
            for i in range(2):
                yield {"x": np.full((n,), i, np.float32)}

        def step_outputs():  # a generator consumer of steps
            while True:
                yield float(repl.run(lambda b: b["x"], raw)[0, 0])

        outputs = step_outputs()
        assert [next(outputs), next(outputs)] == [0.0, 1.0]
        with pytest.raises(rp.InputExhausted, match="exhausted after 2 batches"):
            next(outputs)

        def doubled(ctx):  # a generator input_fn whose batches come from steps over another input_fn
            while True:
                yield {"x": np.asarray(repl.run(lambda b: 2 * b["x"], raw)).ravel()}

        repl.forget_input(raw)
        assert [float(repl.run(lambda b: b["x"], doubled)[0, 0]) for _ in range(2)] == [0.0, 2.0]
        with pytest.raises(rp.InputExhausted, match="exhausted after 2 batches"):
            repl.run(lambda b: b["x"], doubled)

    def test_forget_input_starts_over(self, repl):
        n = repl.num_replicas

        def input_fn(ctx):
            for i in range(3):
                yield {"x": np.full((n,), i, np.float32)}

        step = lambda b: b["x"]  # noqa: E731
        assert [float(repl.run(step, input_fn)[0, 0]) for _ in range(2)] == [0.0, 1.0]
        repl.forget_input(input_fn)
        assert float(repl.run(step, input_fn)[0, 0]) == 0.0
        assert input_fn in repl._inputs

    def test_input_context(self, repl2d):
        contexts = []

        def input_fn(ctx):
            contexts.append(ctx)
            yield {"x": np.zeros((ctx.cores_per_worker,), np.float32)}

        repl2d.run(lambda b: b["x"], input_fn)
        ctx = contexts[-1]
        assert ctx.num_replicas == repl2d.num_replicas and ctx.num_workers == repl2d.num_workers
        assert list(ctx.replica_ids) == list(
            range(ctx.worker_id * ctx.cores_per_worker, (ctx.worker_id + 1) * ctx.cores_per_worker)
        )
        assert ctx.get_per_replica_batch_size(8 * repl2d.num_replicas) == 8


def test_steps_in_flight_are_bounded(n_devices):
    repl = rp.Replicator(1, n_devices, max_in_flight=2)
    seen = []
    step = lambda b: rp.all_sum(b["x"]).sum()  # noqa: E731
    input_fn = _forever({"x": np.ones((n_devices, 16), np.float32)})
    for _ in range(20):
        out = repl.run(step, input_fn)
        seen.append(len(repl._in_flight))
    assert max(seen) == 2 and float(out[0]) == 16 * n_devices
    assert rp.Replicator(1, n_devices).max_in_flight == 2  # the CPU default
    with pytest.raises(ValueError, match="max_in_flight"):
        rp.Replicator(1, n_devices, max_in_flight=-1)


def test_donated_state_in_flight(n_devices):
    repl = rp.Replicator(1, n_devices, donate_state=True, max_in_flight=2)
    state = jnp.zeros(4)
    input_fn = _forever({"x": np.ones((n_devices, 4), np.float32)})
    step = lambda s, b: (s + rp.all_mean(b["x"]).sum(0), {})  # noqa: E731
    for _ in range(6):
        state, _ = repl.run(step, input_fn, state)
    np.testing.assert_allclose(state, 6.0)
    assert repl.trace_count == 1


def test_typed_prng_keys_in_state(repl):
    def step(s, b):
        key, sub = jax.random.split(s["key"])
        return {"key": key, "w": s["w"] + jax.random.normal(sub, (3,))}, {}

    state = {"key": jax.random.key(0), "w": jnp.zeros(3)}
    input_fn = _forever({"x": np.ones(repl.num_replicas)})
    before = repl.trace_count
    for _ in range(3):
        state, _ = repl.run(step, input_fn, state)
    key, w = jax.random.key(0), jnp.zeros(3)
    for _ in range(3):
        key, sub = jax.random.split(key)
        w = w + jax.random.normal(sub, (3,))
    np.testing.assert_allclose(state["w"], w, rtol=1e-6)
    assert repl.trace_count == before + 1


class TestCompileOnce:
    def test_repeated_calls_neither_retrace_nor_recompile(self, n_devices):
        repl = rp.Replicator(1, n_devices)
        traces = []

        def step(s, b):
            traces.append(1)
            return s + rp.all_sum(b["x"]).sum(), {"m": rp.all_mean(b["x"])}

        state = jnp.float32(0)  # weak-typed scalars must not cause a second trace either
        input_fn = _forever({"x": np.ones((2 * n_devices, 2), np.float32)})
        for _ in range(4):
            state, _ = repl.run(step, input_fn, state)
        assert len(traces) == 1 and repl.trace_count == 1
        (compiled,) = repl._compiled.values()
        assert compiled.executable._cache_size() == 1
        assert float(state) == 4 * 2 * 2 * n_devices

    def test_a_new_batch_shape_compiles_a_new_step(self, repl):
        n = repl.num_replicas
        before = repl.trace_count
        f = lambda b: b["x"] * 2  # noqa: E731
        repl.run(f, _forever({"x": np.ones((n,), np.float32)}))
        repl.run(f, _forever({"x": np.ones((2 * n,), np.float32)}))
        assert repl.trace_count == before + 2


class TestBadInput:
    def test_leading_axis_not_divisible(self, repl):
        n = repl.num_replicas
        with pytest.raises(ValueError, match=rf"{n + 1} rows, not divisible by cores_per_worker={n}"):
            repl.run(lambda b: b, _forever({"x": np.ones((n + 1, 2), np.float32)}))

    def test_a_leaf_whose_rows_do_not_divide_is_named(self, repl):
        n = repl.num_replicas  # leaves may have different numbers of rows, each a multiple of the cores
        batch = {"x": np.ones((n, 2), np.float32), "y": np.ones((n + 2,), np.float32)}
        with pytest.raises(ValueError, match=rf"batch leaf batch\['y'\] has {n + 2} rows, not divisible by"):
            repl.run(lambda b: b, _forever(batch))

    def test_scalar_batch_leaf(self, repl):
        with pytest.raises(ValueError, match=r"batch\['lr'\] is a scalar"):
            repl.run(lambda b: b, _forever({"lr": 0.1, "x": np.ones(repl.num_replicas)}))

    def test_non_numeric_batch_leaf(self, repl):
        n = repl.num_replicas
        with pytest.raises(TypeError, match=r"batch\['name'\] is not a numeric array \(dtype <U1\)"):
            repl.run(lambda b: b["x"], _forever({"name": np.array(["a"] * n), "x": np.ones(n)}))

    def test_outputs_that_are_not_arrays(self, repl):
        with pytest.raises(TypeError, match=r"outputs\['name'\] is a str, not an array"):
            repl.run(lambda b: {"name": "loss", "x": b["x"]}, _forever({"x": np.ones(repl.num_replicas)}))

    def test_state_shape_change(self, repl):
        batch = {"x": np.ones(repl.num_replicas, np.float32)}
        with pytest.raises(ValueError, match=r"changed state\['w'\] from \(3,\) float32 to \(4,\) float32"):
            repl.run(lambda s, b: ({"w": jnp.zeros(4)}, {}), _forever(batch), {"w": jnp.zeros(3)})

    def test_state_dtype_change(self, repl):
        batch = {"x": np.ones(repl.num_replicas, np.float32)}
        with pytest.raises(ValueError, match=r"state\['n'\] from \(\) int32 to \(\) float32.*astype\(int32\)"):
            repl.run(lambda s, b: ({"n": s["n"] * 0.5}, {}), _forever(batch), {"n": jnp.int32(1)})

    def test_state_structure_change(self, repl):
        batch = {"x": np.ones(repl.num_replicas, np.float32)}
        with pytest.raises(ValueError, match="structure differs"):
            repl.run(lambda s, b: ({"w": s["w"], "extra": s["w"]}, {}), _forever(batch), {"w": jnp.zeros(3)})

    def test_step_with_state_must_return_a_pair(self, repl):
        batch = {"x": np.ones(repl.num_replicas, np.float32)}
        with pytest.raises(TypeError, match=r"pair \(new_state, outputs\)"):
            repl.run(lambda s, b: s, _forever(batch), jnp.zeros(3))

    def test_input_fn_must_be_callable_returning_iterable(self, repl):
        with pytest.raises(TypeError, match="takes an input_fn .*, an iterator of batches, or one batch"):
            repl.run(lambda b: b, None)
        with pytest.raises(ValueError, match=r"batch is a Python list or tuple of numbers"):  # taken as a batch
            repl.run(lambda b: b, [1, 2])
        with pytest.raises(TypeError, match=r"a range, an iterable that is not an iterator: pass iter\(it\)"):
            repl.run(lambda b: b, range(3))
        with pytest.raises(TypeError, match="must return an iterable"):
            repl.run(lambda b: b, lambda ctx: 3)

    def test_more_replicas_than_devices(self, n_devices):
        with pytest.raises(ValueError, match=rf"needs {2 * n_devices} devices but only {n_devices}.*force_cpu_devices"):
            rp.Replicator(num_workers=2, cores_per_worker=n_devices)

    def test_force_cpu_devices_after_start(self, n_devices):
        rp.force_cpu_devices(n_devices)  # enough already: nothing to do
        with pytest.raises(RuntimeError, match=rf"(?s)already started with {n_devices} CPU.*XLA_FLAGS="):
            rp.force_cpu_devices(n_devices + 1)


def test_force_cpu_devices_before_start_keeps_other_flags():
    code = (
        "import os, replicator as rp; rp.force_cpu_devices(3); print(os.environ['XLA_FLAGS']);"
        "import jax; print(jax.device_count())"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=5")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    flags, count = out.stdout.split("\n")[:2]
    assert flags.split() == ["--xla_cpu_enable_fast_math=false", "--xla_force_host_platform_device_count=3"]
    assert count == "3"


def test_collectives_outside_a_step_say_where_to_call_them():
    with pytest.raises(RuntimeError, match="Replicator.run"):
        rp.all_mean(jnp.ones(3))
    with pytest.raises(RuntimeError, match="Replicator.run"):
        rp.num_replicas()
    assert jax.device_count() >= 1


# -- runtime/mesh.py: the mesh a Replicator runs on ---------------------------------------------------------------


def test_replica_r_is_the_rth_device_by_id_whatever_order_the_devices_are_given_in(n_devices):
    from replicator.runtime.mesh import build_mesh

    if n_devices < 4:
        pytest.skip("needs 4 devices")
    devices = jax.devices()[:4]
    for given in (devices, devices[::-1]):
        mesh = build_mesh(2, 2, devices=list(given))
        assert mesh.axis_names == ("workers", "cores") and dict(mesh.shape) == {"workers": 2, "cores": 2}
        assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in devices)  # replica w * 2 + c


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None])
def test_a_worker_or_core_count_that_is_not_a_positive_int_is_refused(bad):
    from replicator.runtime.mesh import build_mesh, force_cpu_devices

    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        build_mesh(bad, 1)
    if bad is not None:  # None is a valid cores_per_worker: every local device
        with pytest.raises(ValueError, match="cores_per_worker must be a positive int or None"):
            build_mesh(1, bad)
        with pytest.raises(ValueError, match=r"force_cpu_devices\(n\): n must be a positive int"):
            force_cpu_devices(bad)


def test_cores_per_worker_none_is_every_local_device_or_the_workers_share_of_those_given(n_devices):
    from replicator.runtime.mesh import build_mesh

    assert dict(build_mesh(1).shape) == {"workers": 1, "cores": n_devices}
    if n_devices >= 4:
        assert dict(build_mesh(2, devices=jax.devices()[:4]).shape) == {"workers": 2, "cores": 2}


_OTHER_FLAGS = st.lists(st.sampled_from(["--xla_cpu_enable_fast_math=false", "--xla_dump_to=/tmp/x", "--xla_a=1"]))


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(_OTHER_FLAGS, st.integers(0, 3), st.lists(st.integers(1, 64), max_size=2), st.integers(1, 64))
def test_the_device_count_flag_is_set_once_other_flags_kept_in_order(others, at, before, n):
    from replicator.runtime.mesh import with_device_count

    flags = list(others)
    for count in before:  # any earlier counts, anywhere among the other flags
        flags.insert(min(at, len(flags)), f"--xla_force_host_platform_device_count={count}")
    got = with_device_count(" ".join(flags), n).split()
    assert got == [*others, f"--xla_force_host_platform_device_count={n}"]


def test_a_replicator_traces_as_usual_after_a_block_in_64_bit_mode(repl):
    """A float64 state leaf is float32 to JAX outside 64-bit mode; a `with jax.enable_x64(True)` block
    before must not leave the state signature float64 (found when the fuzzer's float64 judge ran in
    the test process: the next step was refused, its state 'changed' from float64 to float32)."""
    from replicator.core.tracing import canonical_dtype

    with jax.enable_x64(True):
        assert canonical_dtype(np.dtype(np.float64)) == np.float64
    assert canonical_dtype(np.dtype(np.float64)) == np.float32
    w, _ = repl.run(lambda w, b: (w + rp.all_mean(b["x"][0]), {}), {"x": np.ones((repl.num_replicas, 2))}, np.zeros(2))
    assert w.dtype == np.float32
