"""ZeRO stages 2 and 3 (``PassManager.default(zero=...)``): graph, numbers against one device, memory.

The reference is the same step under ``jax.jit`` on one device with the global
batch (``rp.all_mean`` is the identity there).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from utils import sum_rounding_scale, train_on_global_batches

import replicator as rp
from replicator.cost.memory import state_bytes_per_device
from replicator.passes import count_primitives
from replicator.runtime.execution import build_executable

WIDTH, DEPTH = 256, 4  # 256 KiB weights, over the default threshold; 1 KiB biases stay whole
TOL = 5e-5  # on 8 devices; tol(n) on n


def tol(n_devices: int) -> float:
    return TOL * sum_rounding_scale(n_devices)


def _params(rng, width=WIDTH, depth=DEPTH):
    return [
        {"w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), "b": np.zeros(width, np.float32)}
        for _ in range(depth)
    ]


def _loss(params, x, y, dtype=jnp.float32):
    for layer in params:
        x = jnp.tanh(x.astype(dtype) @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
    return jnp.mean((x.astype(jnp.float32) - y) ** 2)


def _make_step(tx, loss=_loss, mean=None):
    def step(state, batch):
        average = mean or rp.all_mean  # looked up when called: the vmap simulation swaps it
        params, opt = state
        value, g = jax.value_and_grad(loss)(params, batch["x"], batch["y"])
        g = average(g)
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {"loss": average(value)}

    return step


def _batches(rows, steps=3, width=WIDTH):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.normal(size=(rows, width)).astype(np.float32), "y": rng.normal(size=(rows, width)).astype(np.float32)}
        for _ in range(steps)
    ]


def _reference(tx, state, batches, loss=_loss):
    step = jax.jit(_make_step(tx, loss, mean=lambda x: x))
    for b in batches:
        state, _ = step(state, b)
    return state


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _lower(repl, step, state):
    """The step lowered for one worker's batch of 4 rows per replica."""
    return repl.lower(step, _batches(4 * repl.cores_per_worker, 1)[0], state)


def _setup(tx=None):
    tx = tx or optax.adam(1e-2)
    params = _params(np.random.default_rng(0))
    return tx, (params, tx.init(params))


# -- options ----------------------------------------------------------------------------------


def test_the_zero_option_builds_the_pass_with_its_level():
    (p,) = [p for p in rp.PassManager.default(zero=3).passes if p.name == "shard-optimizer-update"]
    assert p.stage == 3
    (p,) = [p for p in rp.PassManager.default(shard_optimizer=True).passes if p.name == "shard-optimizer-update"]
    assert p.stage == 1
    assert "shard-optimizer-update" not in rp.PassManager.default(zero=0).names
    with pytest.raises(ValueError, match="levels are 0 .off., 1, 2 and 3"):
        rp.PassManager.default(zero=4)


# -- stage 3: parameters stored sharded --------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_three_adam_steps_equal_one_device(n_devices, stage):
    tx, state = _setup()
    batches = _batches(4 * n_devices)
    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=stage))
    got = train_on_global_batches(repl, _make_step(tx), state, batches)
    ref = _reference(tx, state, batches)
    assert _max_diff(ref[0], state[0]) > 1e-3  # training moved the parameters: the check below can fail
    assert _max_diff(got, ref) < tol(n_devices)


def test_stage3_stores_parameters_sharded_and_gathers_them_for_each_use(n_devices):
    tx, state = _setup()
    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=3))
    lowered = _lower(repl, _make_step(tx), state)
    final = lowered.final
    paths = [final.state_paths[i] for i in sorted(final.sharded_state)]
    weights = [p for p in paths if p.endswith("['w']")]
    assert len(weights) == 3 * DEPTH, paths  # w, Adam's mu and nu of every layer
    assert not any(p.endswith("['b']") for p in paths), paths  # under the threshold
    # every layer's w in the forward pass, and again in the backward pass (the first layer's
    # input needs no gradient): 2 * DEPTH - 1 gathers, none merged by XLA
    zero = lowered.after("shard-optimizer-update")
    gathers = count_primitives(zero.jaxpr)["rp.all_gather"]
    assert gathers == 2 * DEPTH - 1, count_primitives(zero.jaxpr)
    hlo = _compiled_text(repl, lowered)
    assert len(re.findall(r" all-gather(-start)?\(", hlo)) == gathers


def _compiled_text(repl, lowered) -> str:
    from jax.sharding import NamedSharding

    from replicator.runtime.execution import sharded, state_spec

    final, traced = lowered.final, lowered.traced
    avals = [v.aval for v in traced.jaxpr.jaxpr.invars]
    n = traced.num_state
    state = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(repl.mesh, state_spec(i, final.sharded_state)))
        for i, a in enumerate(avals[:n])
    ]
    rows = traced.context.num_replicas
    batch = [
        jax.ShapeDtypeStruct((rows * a.shape[0], *a.shape[1:]), a.dtype, sharding=sharded(repl.mesh)) for a in avals[n:]
    ]
    return build_executable(final, repl.mesh).lower(state, batch).compile().as_text()


def test_memory_per_device_falls_with_each_stage(n_devices):
    tx, state = _setup()
    whole = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    usage, stored = {}, {}
    for stage in (0, 1, 3):
        repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=stage))
        lowered = _lower(repl, _make_step(tx), state)
        usage[stage], stored[stage] = lowered.memory(), state_bytes_per_device(lowered.final)
    assert stored[0] == whole
    # stage 1: mu and nu in 1/N; stage 3: the weights too (biases and counters stay whole)
    weights = DEPTH * WIDTH * WIDTH * 4
    assert stored[1] == whole - 2 * weights + 2 * weights // n_devices
    assert stored[3] == whole - 3 * weights + 3 * weights // n_devices
    # XLA's accounting: the state arguments shrink as predicted, and stage 3's temporaries
    # hold one gathered weight at a time (and a few activations), not every weight
    assert usage[0].peak > usage[1].peak > usage[3].peak
    assert usage[3].arguments < usage[1].arguments < usage[0].arguments
    assert usage[3].temporaries < 1.5 * WIDTH * WIDTH * 4, usage[3]


def test_unsharded_parameter_stays_replicated_with_a_note(n_devices):
    """A parameter whose update is not element-wise is left whole, and the pipeline says why."""
    rng = np.random.default_rng(0)
    state = {"w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32), "v": np.ones((WIDTH, WIDTH), np.float32)}

    def step(s, b):
        g = rp.all_mean(jax.grad(lambda w: jnp.sum(jnp.tanh(b["x"] @ w)))(s["w"]))
        return {"w": s["w"] - 0.1 * g, "v": jnp.roll(s["v"], 1, axis=1) + 0.5}, {}

    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=3))
    lowered = repl.lower(step, {"x": np.ones((2 * n_devices, WIDTH), np.float32)}, state)
    paths = [lowered.final.state_paths[i] for i in lowered.final.sharded_state]
    assert paths == ["state['w']"], paths
    (note,) = [n for n in lowered.notes if "state['v']" in n]
    assert "stays replicated" in note and "element by element" in note
    assert "['v']" in str(repl.explain(step, {"x": np.ones((2 * n_devices, WIDTH), np.float32)}, state))


def test_stage3_with_bf16_compute_gathers_in_bf16(n_devices):
    tx, state = _setup(optax.sgd(5.0))  # Adam would turn bf16 roundings into steps of its learning rate

    def bf16_loss(p, x, y):
        return _loss(p, x, y, dtype=jnp.bfloat16)

    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=3))
    zero = _lower(repl, _make_step(tx, bf16_loss), state).after("shard-optimizer-update")
    gathered = [e.invars[0].aval.dtype for e in zero.jaxpr.jaxpr.eqns if e.primitive.name == "rp.all_gather"]
    assert gathered and all(d == jnp.bfloat16 for d in gathered), gathered
    batches = _batches(4 * n_devices)
    got = train_on_global_batches(repl, _make_step(tx, bf16_loss), state, batches)
    ref = _reference(tx, state, batches, bf16_loss)
    moved = _max_diff(ref[0], state[0])
    assert moved > 1e-2
    # bf16 products (8 bits of mantissa) summed in another order: within 5% of how far training moved
    assert _max_diff(got, ref) < 0.05 * moved, (_max_diff(got, ref), moved)


def test_stage3_with_jax_checkpoint_and_clipping(n_devices):
    tx, state = _setup(optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)))

    def remat_loss(p, x, y):
        for layer in p:
            x = jax.checkpoint(lambda x, layer: jnp.tanh(x @ layer["w"] + layer["b"]))(x, layer)
        return jnp.mean((x - y) ** 2)

    batches = _batches(4 * n_devices)
    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=3))
    got = train_on_global_batches(repl, _make_step(tx, remat_loss), state, batches)
    assert _max_diff(got, _reference(tx, state, batches, remat_loss)) < tol(n_devices)


def test_stage2_computes_the_global_norm_on_shards(n_devices):
    """clip_by_global_norm's sum of squares: partial sums and an all-reduce, no gathered gradient."""
    tx, state = _setup(optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)))
    counts = {}
    for stage in (1, 2):
        repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=stage))
        counts[stage] = count_primitives(_lower(repl, _make_step(tx), state).after("shard-optimizer-update").jaxpr)
    # stage 1 gathers each weight's squared gradient for the norm, and the new weights;
    # stage 2 only the new weights
    assert counts[1]["rp.all_gather"] == 2 * DEPTH
    assert counts[2]["rp.all_gather"] == DEPTH
    assert counts[2]["rp.all_reduce"] == counts[1]["rp.all_reduce"] + DEPTH
    batches = _batches(4 * n_devices)
    got = train_on_global_batches(repl, _make_step(tx), state, batches)
    assert _max_diff(got, _reference(tx, state, batches)) < tol(n_devices)


def _extremes_step(tx, mean=None):
    """A step whose update reads the largest and the smallest element of each reduced gradient.

    Each gradient is scaled by its largest magnitude (a clipping rule) and shifted by its
    smallest element: at stage 2 both are partial reductions of chunks completed by an
    all-reduce (max, min), and a max taken for a min (or the reverse) changes the update.
    """

    def step(state, batch):
        average = mean or rp.all_mean
        params, opt = state
        value, g = jax.value_and_grad(_loss)(params, batch["x"], batch["y"])
        g = jax.tree.map(lambda t: t / jnp.max(jnp.abs(t)) + 0.5 * jnp.min(t), average(g))
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {"loss": average(value)}

    return step


@pytest.mark.parametrize("mesh", [(1, None), (2, 2)], ids=["1xN", "2x2"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_max_and_min_of_the_reduced_gradient_equal_one_device(n_devices, stage, mesh):
    """jnp.max / jnp.min over a reduced gradient (stage 2 and 3: on chunks, then an all-reduce of the partial
    results), SGD with momentum, 3 steps: parameters equal one-device jit on the global batch."""
    workers, cores = mesh
    cores = cores or n_devices
    tx = optax.sgd(0.05, momentum=0.9)
    params = _params(np.random.default_rng(0))
    state = (params, tx.init(params))
    batches = _batches(4 * workers * cores)
    repl = rp.Replicator(workers, cores, passes=rp.PassManager.default(zero=stage))
    if stage >= 2:  # the reductions run on chunks: each weight's max and min are all-reduces of partial results
        zero = _lower(repl, _extremes_step(tx), state).after("shard-optimizer-update").jaxpr.jaxpr
        ops = [e.params["op"] for e in zero.eqns if e.primitive.name == "rp.all_reduce"]
        assert ops.count("max") == ops.count("min") == DEPTH, ops
    got = train_on_global_batches(repl, _extremes_step(tx), state, batches)
    step = jax.jit(_extremes_step(tx, mean=lambda x: x))
    ref = state
    for b in batches:
        ref, _ = step(ref, b)
    assert _max_diff(ref[0], state[0]) > 1e-2  # training moved the parameters: the check below can fail
    assert _max_diff(got, ref) < tol(workers * cores), _max_diff(got, ref)


@pytest.mark.parametrize(("workers", "per_device"), [(2, 1), (1, 2), (2, 2)])
def test_stage3_on_a_2d_mesh_and_folded(n_devices, workers, per_device):
    tx, state = _setup()
    batches = _batches(4 * n_devices)
    repl = rp.Replicator(
        workers,
        n_devices // workers,
        parallelism=rp.Parallelism(replicas_per_device=per_device),
        passes=rp.PassManager.default(zero=3),
    )
    got = train_on_global_batches(repl, _make_step(tx), state, batches)
    assert _max_diff(got, _reference(tx, state, batches)) < tol(n_devices)
    w = got[0][0]["w"]
    assert not w.sharding.is_fully_replicated  # stored 1/N per device between steps
    assert w.shape == (WIDTH, WIDTH)  # the global shape the user gave


def test_gradient_accumulation_under_stage3(n_devices):
    tx, state = _setup()
    batches = _batches(4 * n_devices)

    def step(state, batch):
        params, opt = state
        _, g = rp.accumulate_gradients(lambda p, m: _loss(p, m["x"], m["y"]), params, batch, 2)
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {}

    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(zero=3))
    got = train_on_global_batches(repl, step, state, batches)
    assert _max_diff(got, _reference(tx, state, batches)) < tol(n_devices)


# -- the chunk axis: parameters whose leading axis does not divide -----------------------------

CONV_SHAPES = {"k1": (3, 3, 3, 16), "k2": (3, 3, 16, 24), "w": (24, 8)}  # HWIO kernels, a dense layer


def _conv_loss(params, x, y):
    def conv(h, k):
        return jax.nn.relu(
            jax.lax.conv_general_dilated(h, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        )

    h = jnp.mean(conv(conv(x, params["k1"]), params["k2"]), axis=(1, 2))
    return jnp.mean((h @ params["w"] - y) ** 2)


def _conv_setup(n_devices):
    rng = np.random.default_rng(0)
    params = {k: (rng.normal(size=s) / np.sqrt(np.prod(s[:-1]))).astype(np.float32) for k, s in CONV_SHAPES.items()}
    tx = optax.adam(1e-2)
    batches = [
        {"x": rng.normal(size=(2 * n_devices, 6, 6, 3)).astype(np.float32), "y": rng.normal(size=(2 * n_devices, 8))}
        for _ in range(3)
    ]
    return tx, (params, tx.init(params)), [jax.tree.map(lambda a: a.astype(np.float32), b) for b in batches]


def _first_dividing_axis(shape, n):
    return next(k for k, d in enumerate(shape) if d % n == 0)


@pytest.mark.parametrize(("workers", "per_device"), [(1, 1), (2, 2)])
def test_stage3_shards_conv_kernels_along_an_axis_that_divides(n_devices, workers, per_device):
    """(3, 3, C, F) kernels are stored split along C or F, gathered along it, and train as on one device."""
    tx, state, batches = _conv_setup(n_devices)
    repl = rp.Replicator(
        workers,
        n_devices // workers,
        parallelism=rp.Parallelism(replicas_per_device=per_device),
        passes=rp.PassManager.default(zero=3, shard_optimizer_min_bytes=0),
    )
    step = _make_step(tx, _conv_loss)
    lowered = repl.lower(step, jax.tree.map(lambda a: a[: len(a) // workers], batches[0]), state)
    final, n = lowered.final, n_devices
    axes = {k: _first_dividing_axis(s, n) for k, s in CONV_SHAPES.items()}
    if n == 8:
        assert axes == {"k1": 3, "k2": 2, "w": 0}  # F for k1, C for k2
    # each parameter and Adam's mu and nu of it: stored split along that axis
    for key, axis in axes.items():
        stored = [i for i in final.sharded_state if final.state_paths[i].endswith(f"['{key}']")]
        assert len(stored) == 3 and {final.sharded_state.axis(i) for i in stored} == {axis}, (key, stored)
    assert not [note for note in lowered.notes if "stays replicated" in note], lowered.notes
    # the kernels are gathered along their chunk axis, in the forward and the backward pass
    zero = lowered.after("shard-optimizer-update").jaxpr.jaxpr
    gathered = {(e.outvars[0].aval.shape, e.params["axis"]) for e in zero.eqns if e.primitive.name == "rp.all_gather"}
    assert {(CONV_SHAPES[k], axes[k]) for k in ("k1", "k2")} <= gathered, gathered
    # the prediction: every leaf stored in 1/N, the counter whole
    whole = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    split = 3 * sum(4 * int(np.prod(s)) for s in CONV_SHAPES.values())
    assert state_bytes_per_device(final) == whole - split + split // n

    got = train_on_global_batches(repl, step, state, batches)
    ref = _reference(tx, state, batches, _conv_loss)
    assert _max_diff(ref[0], state[0]) > 1e-3
    assert _max_diff(got, ref) < tol(n_devices)
    for key, axis in axes.items():  # returned with the global shape, split along the axis over every device
        leaf = got[0][key]
        assert leaf.shape == CONV_SHAPES[key]
        assert [k for k, names in enumerate(leaf.sharding.spec) if names is not None] == [axis], leaf.sharding
        assert leaf.addressable_shards[0].data.shape[axis] == CONV_SHAPES[key][axis] // (n // per_device)


# -- stage 3 and lax.scan: a stack of layers gathered slice by slice ---------------------------

LAYERS = 8  # divides by 8 replicas: the stack is still split along axis 1, not the scanned axis


def _stack_params(rng, width=128):
    return {
        "stack": (rng.normal(size=(LAYERS, width, width)) / np.sqrt(width)).astype(np.float32),
        "b": np.zeros((LAYERS, width), np.float32),
    }


def _scan_loss(params, x, y, remat=False):
    def layer(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None

    h, _ = jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, (params["stack"], params["b"]))
    return jnp.mean((h - y) ** 2)


def _remat_scan_loss(params, x, y):
    return _scan_loss(params, x, y, remat=True)


def _scan_setup(width=128):
    tx = optax.adam(1e-2)
    params = _stack_params(np.random.default_rng(0), width)
    return tx, (params, tx.init(params))


def _zero3(slice_scans=True, min_bytes=0):
    passes = [
        rp.passes.ShardOptimizerUpdate(stage=3, min_tensor_bytes=min_bytes, slice_scans=slice_scans)
        if p.name == "shard-optimizer-update"
        else p
        for p in rp.PassManager.default(zero=3).passes
    ]
    return rp.PassManager(passes)


def _scans(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "scan"]


def test_stage3_gathers_a_scanned_stack_slice_by_slice(n_devices):
    """Forward and backward scan read the stack's chunks as xs; each body gathers one layer's slice."""
    width, n = 128, n_devices
    tx, state = _scan_setup(width)
    repl = rp.Replicator(1, n, passes=_zero3())
    lowered = repl.lower(_make_step(tx, _scan_loss), _batches(4 * n, 1, width)[0], state)
    final = lowered.final
    stack = [i for i in final.sharded_state if "['stack']" in final.state_paths[i]]
    assert len(stack) == 3 and {final.sharded_state.axis(i) for i in stack} == {1}  # w, mu, nu along axis 1
    zero = lowered.after("shard-optimizer-update").jaxpr.jaxpr
    shapes = {(e.outvars[0].aval.shape, e.params["axis"]) for e in zero.eqns if e.primitive.name == "rp.all_gather"}
    assert not any(len(shape) == 3 for shape, _ in shapes), shapes  # no stack gathered whole outside the loop
    chunk = (LAYERS, width // n, width)
    forward, backward = _scans(zero)
    for scan in (forward, backward):
        assert chunk in [v.aval.shape for v in scan.invars], scan.invars  # the chunks go in as xs
        body = scan.params["jaxpr"].jaxpr
        gathers = [
            (e.outvars[0].aval.shape, e.params["axis"]) for e in body.eqns if e.primitive.name == "rp.all_gather"
        ]
        # one gather of the layer's weights per body (and its bias in the forward pass), along
        # the slice's axis 0 (the stack's axis 1)
        assert sorted(gathers) == ([((width,), 0)] if scan is forward else []) + [((width, width), 0)], gathers
    # the backward scan reduce-scatters each layer's weight gradient, and returns the chunks
    scatters = [e for e in backward.params["jaxpr"].jaxpr.eqns if e.primitive.name == "rp.reduce_scatter"]
    assert sorted((e.invars[0].aval.shape, e.params["axis"]) for e in scatters) == [((width,), 0), ((width, width), 0)]
    assert chunk in [v.aval.shape for v in backward.outvars]


@pytest.mark.parametrize(
    ("workers", "per_device", "loss"), [(1, 1, _scan_loss), (2, 2, _scan_loss), (1, 1, _remat_scan_loss)]
)
def test_stage3_scanned_stack_trains_as_on_one_device(n_devices, workers, per_device, loss):
    """Forward and backward scan; folded; with jax.checkpoint on the layer (the body gathers before the remat)."""
    width = 64
    tx, state = _scan_setup(width)
    batches = _batches(4 * n_devices, 3, width)
    repl = rp.Replicator(
        workers, n_devices // workers, parallelism=rp.Parallelism(replicas_per_device=per_device), passes=_zero3()
    )
    if loss is _remat_scan_loss:  # the slices are still gathered inside the loops only
        lowered = repl.lower(_make_step(tx, loss), _batches(4 * n_devices, 1, width)[0], state)
        zero = lowered.after("shard-optimizer-update").jaxpr.jaxpr
        assert not any(len(e.outvars[0].aval.shape) == 3 for e in zero.eqns if e.primitive.name == "rp.all_gather")
        assert all(count_primitives(scan.params["jaxpr"])["rp.all_gather"] for scan in _scans(zero))
    got = train_on_global_batches(repl, _make_step(tx, loss), state, batches)
    ref = _reference(tx, state, batches, loss)
    assert _max_diff(ref[0], state[0]) > 1e-3
    assert _max_diff(got, ref) < tol(n_devices)
    stack = got[0]["stack"]
    assert stack.shape == (LAYERS, width, width) and stack.sharding.spec[0] is None and stack.sharding.spec[1]


def test_stage3_scanned_stack_needs_less_memory_than_gathering_it_whole(n_devices):
    """XLA's accounting: without the whole stack (gathered, and its gradient) the temporaries fall."""
    width = 128
    tx, state = _scan_setup(width)
    stack_bytes = LAYERS * width * width * 4
    usage = {}
    for sliced in (False, True):
        repl = rp.Replicator(1, n_devices, passes=_zero3(slice_scans=sliced))
        lowered = repl.lower(_make_step(tx, _scan_loss), _batches(4 * n_devices, 1, width)[0], state)
        usage[sliced] = lowered.memory()
        whole = sorted(n for n in lowered.notes if "gathered whole before a lax.scan" in n)
        assert len(whole) == (0 if sliced else 2) and all("slice_scans=False" in n for n in whole), lowered.notes
    assert usage[True].arguments == usage[False].arguments  # the same state stored
    assert usage[True].temporaries + stack_bytes <= usage[False].temporaries, usage
    assert usage[True].temporaries < stack_bytes / 2, usage[True]  # no whole stack lives on a device


def test_stage3_stack_with_no_later_axis_that_divides_is_gathered_whole_with_a_note(n_devices):
    tx = optax.adam(1e-2)
    params = {"stack": np.full((n_devices, 3, 3), 0.1, np.float32), "b": np.zeros((n_devices, 3), np.float32)}
    lowered = rp.Replicator(1, n_devices, passes=_zero3()).lower(
        _make_step(tx, _scan_loss), _batches(2 * n_devices, 1, 3)[0], (params, tx.init(params))
    )
    final = lowered.final
    stack = [i for i in final.sharded_state if final.state_paths[i].endswith("['stack']")]
    assert [final.sharded_state.axis(i) for i in stack] == [0, 0, 0]  # split along the scanned axis
    zero = lowered.after("shard-optimizer-update").jaxpr.jaxpr
    assert (n_devices, 3, 3) in [e.outvars[0].aval.shape for e in zero.eqns if e.primitive.name == "rp.all_gather"]
    notes = [n for n in lowered.notes if "['stack']" in n and "gathered whole before a lax.scan" in n]
    assert len(notes) == 1 and "no axis after the scanned one divides" in notes[0], lowered.notes
