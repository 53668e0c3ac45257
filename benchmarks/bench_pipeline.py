"""Pipeline parallelism: replicator's pipelined step against one device and a hand-written JAX pipeline.

One process, N emulated CPU devices. The workload is an MLP of ``--layers``
identical ``tanh`` layers of width ``--width`` (mean squared error against a
target, Adam via optax), cut into ``S`` stages of ``layers / S`` layers by
``S - 1`` ``rp.stage_boundary`` markers. For each ``S`` in ``--stages`` (those
that fit in ``--devices``) the pipeline runs on ``S`` devices, one
data-parallel replica (``Replicator(1, S, parallelism=rp.Parallelism(stages=S))``).

1. Step time (medians of ``--rounds`` interleaved rounds of ``--steps`` steps,
   every variant of one ``S`` interleaved within each round, ``benchmarks/timing.py``):

   * ``one device``       ``jax.jit`` of the whole step on the global batch (the floor);
   * ``hand GPipe``       a hand-written pipeline: ``jax.shard_map`` over a ``'stages'``
     axis, ``lax.scan`` over the ``M + S - 1`` ticks, ``lax.ppermute`` shifting the
     activations each tick, its backward by autodiff of the loop (GPipe order: the
     MaxText pattern), Adam on the stacked per-stage weights outside ``shard_map``;
   * ``hand GPipe, no exchange``  the same step with each tick's ``ppermute`` left out
     (each stage keeps its own result): a control, not a pipeline. Its ticks compute
     what the hand pipeline's do, but no device waits for another, so
     ``hand GPipe`` minus this row is what waiting at the exchanges costs, and this row
     over ``ideal' + u'`` is what the step's loop costs beyond its micro-batches' work;
   * ``rp gpipe`` / ``rp 1f1b`` / ``rp 1f1b-fused``  replicator's pipelined step (``run_pipelined``'s program)
     with its state kept packed across steps (``PipelineTrainStep.pack``/``step``);
   * ``rp gpipe, run_pipelined``  the public call, which packs and unpacks the global
     state every call (largest ``M`` only: what that costs);
   * ``stage micro-batch``  ``jax.jit`` on one device of one stage's forward and
     backward (the last stage: its layers and the loss, gradients for its
     parameters and its input) on one micro-batch of ``batch / M`` rows: the
     *tick* ``t_M`` of the estimates below;
   * ``stage micro-batch, beside``  the same on all ``S`` devices at once (each its own
     copy, one ``shard_map``): the tick ``t'_M`` as a stage runs it while the others
     run theirs, on the cores they share (on emulated CPU devices, ``t_M`` alone has
     every core to itself);
   * ``exchange``  the pipeline's sends alone: ``2 (M + S - 1)`` ``ppermute`` of one
     micro-batch's activation around the ``S`` devices (a forward sweep of ``M + S - 1``
     ticks, then a backward one, as the schedules send), no compute: ``x_M``, what a
     tick's exchange costs on these devices (on emulated CPU devices, a rendezvous of
     the devices' threads);
   * ``update, beside``  the Adam update of one stage's parameters (``layers / S``), on
     all ``S`` devices at once: ``u'``, what every schedule adds to its ticks once per
     step (the one-device step has it too).

   Every variant gets the same batch, already on its devices (no host transfer).
   Before timing, the hand-written pipeline's gradients and its parameters after two
   Adam steps are asserted equal to one device's (and replicator's parameters after
   two steps), to ``--tolerance``.

   The estimates, for each pipelined row: ``ideal = (M + S - 1) t_M`` (every stage
   busy for the ``M`` micro-batches, plus the fill and drain of ``S - 1`` ticks; GPipe and
   1F1B run ``2 (M + S - 1)`` half-ticks of one forward or one backward, 1F1B-fused ``M + 2(S - 1)``
   ticks of up to one forward and one backward each), the
   ratio ``measured / ideal``, the ideal bubble ``(S-1)/(M+S-1)`` and the measured
   one, ``1 - M t_M / T``: the fraction of the step ``T`` a stage is not computing its
   own micro-batches. It charges everything else to the bubble: the optimizer
   update, the ``ppermute`` of each tick, the loop's dispatch (``lax.switch`` over
   the stages' programs), the padding of the rings. On emulated CPU devices the
   ``S`` devices share the host's cores, so a stage's micro-batch timed alone (on all
   cores) is faster than it is beside the other stages: read the measured bubble
   as an upper bound. The ``t'_M`` columns give the same estimates from the tick timed
   beside the other stages: ``ideal' = (M + S - 1) t'_M``, the schedule's ideal on
   these shared cores; ``ideal' + x_M`` adds the exchanges that any pipeline on these
   devices sends (the hand-written one too); ``ideal' + x_M + u'`` the optimizer's update
   too: the whole step's floor on these devices, with the schedule's ticks at ``t'_M``.

1b. The stacked form (``--stacked-rows``, ``--stacked-m``; ``--only-stacked`` runs this section alone): the
   same MLP written as one ``lax.scan`` over its stacked weights ``(L, W, W)`` (how Flax and MaxText write a
   transformer; the Replicator cuts the scan into its stages), and as one leaf per layer, under replicator's
   GPipe and 1F1B, against the hand GPipe (written on the stacked weights), at ``M = 8`` and 16 and 64 rows
   per micro-batch (small micro-batches show the per-tick cost): paired ratios of interleaved rounds, each
   form's stash per micro-batch (the largest stage's residuals) and XLA's temporaries. Before replicator's
   stash kept only what depends on the micro-batch, the stacked form stashed a copy of its stage's weights
   per micro-batch (issue #41).

2. Per-device memory from XLA's compiled memory analysis of each program
   (``.lower(...).compile().memory_analysis()``; peak = arguments + outputs -
   aliased + temporaries, as ``replicator.runtime.memory.MemoryUsage``), for
   ``M = S, 2S, 4S, 8S``: one device, the hand-written pipeline, replicator's GPipe,
   1F1B, and GPipe with ``Parallelism(recompute=True)``. Replicator exposes no compiled
   executable of a pipelined step; this reads the jitted program the
   ``Replicator`` caches: ``repl.pipelined.step_for(loss, opt).built(params, x, y).step``.

3. Parameters and optimizer state bytes per device against ``S = 1, 2, 4`` (those
   dividing ``--devices``; ``D = devices / S`` replicas), without ZeRO and with ZeRO 1
   and 3 over each stage's replicas: the addressable shards on device 0 of the packed
   state, against the replicated figure (every leaf whole), and against
   ``describe_pipeline``'s ``row_bytes`` (the packed row holds both since the
   loss-and-optimizer step is built as the user's own step).

Usage::

    python benchmarks/bench_pipeline.py --devices 8                      # S = 2 and 4
    python benchmarks/bench_pipeline.py --devices 4 --quick --out pipeline.md   # smoke run
    python benchmarks/bench_pipeline.py --stages 4 --microbatches 4,8,16 --layers 16 --width 1024
    python benchmarks/bench_pipeline.py --devices 2 --stages 2 --only-stacked    # section 1b alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    p.add_argument("--stages", default="2,4", help="pipeline stages S to time (those <= --devices)")
    p.add_argument("--microbatches", default="1,2,4,8,16", help="micro-batch counts M to time")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    p.add_argument("--steps", type=int, default=5, help="steps timed per variant per round")
    p.add_argument("--layers", type=int, default=8, help="MLP layers (a multiple of every S)")
    p.add_argument("--width", type=int, default=512, help="MLP width")
    p.add_argument("--batch", type=int, default=512, help="global batch (a multiple of 8 S and every M)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="of the hand-written pipeline against one device")
    p.add_argument("--stacked-rows", default="16,64", help="rows per micro-batch of the stacked-scan section (1b)")
    p.add_argument("--stacked-m", type=int, default=8, help="micro-batches of the stacked-scan section (1b)")
    p.add_argument("--only-stacked", action="store_true", help="run the stacked-scan section (1b) alone")
    p.add_argument("--quick", action="store_true", help="tiny sizes, S = 2, M up to 4, 2 rounds: a smoke run")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.microbatches, args.rounds, args.steps = "2", "1,2,4", 2, 2
        args.layers, args.width, args.batch = 4, 32, 64
        args.stacked_rows, args.stacked_m = "4", 4
    return args


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from timing import interleaved_samples  # noqa: E402

from replicator.runtime.memory import MemoryUsage  # noqa: E402
from replicator.stages import DATA_AXES  # noqa: E402

Runner = Callable[[], object]  # one step; returns something to block on
Params = list[dict]
TX = optax.adam(1e-3)
SCHEDULES = ("gpipe", "1f1b", "1f1b-fused")  # replicator's, each timed at every M
LINES: list[str] = []  # everything printed, for --out


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


# -- the workload ----------------------------------------------------------------------------------


def mlp_init(layers: int, width: int, seed: int = 0) -> Params:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
            "b": (0.1 * rng.normal(size=width)).astype(np.float32),
        }
        for _ in range(layers)
    ]


def batch_of(batch: int, width: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, width)).astype(np.float32), rng.normal(size=(batch, width)).astype(np.float32)


def layers_fwd(params: Params, h: jax.Array) -> jax.Array:
    for layer in params:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return h


def make_loss(stages: int) -> Callable:
    """The MLP's loss cut into ``stages`` equal stages by ``stages - 1`` markers (identity outside a pipeline)."""

    def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        per = len(params) // stages
        h = x
        for s in range(stages):
            h = layers_fwd(params[s * per : (s + 1) * per], h)
            if s < stages - 1:
                h = rp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    return loss


def stacked_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """The same MLP as one ``lax.scan`` over its stacked layers (``{'w': (L, W, W), 'b': (L, W)}``), unmarked:
    a pipelined Replicator cuts the scan into its stages (``rp.split_scan``)."""
    h, _ = lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), x, (params["w"], params["b"]))
    return jnp.mean((h - y) ** 2)


def stacked_params(params: Params) -> dict:
    return {k: np.stack([p[k] for p in params]) for k in "wb"}


def one_device_step(loss: Callable) -> Callable:
    def step(params: Params, opt: Any, x: jax.Array, y: jax.Array) -> tuple:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt = TX.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return jax.jit(step)


# -- the hand-written pipeline (GPipe, the MaxText pattern) --------------------------------------------


def stack(params: Params, stages: int) -> dict:
    """The layers as ``{'w': (S, L/S, W, W), 'b': (S, L/S, W)}``: stage ``s``'s layers in row ``s``."""
    per = len(params) // stages
    return {
        k: np.stack([np.stack([p[k] for p in params[s * per : (s + 1) * per]]) for s in range(stages)]) for k in "wb"
    }


def unstack(stacked: dict) -> Params:
    w, b = np.asarray(stacked["w"]), np.asarray(stacked["b"])
    return [{"w": w[s, i], "b": b[s, i]} for s in range(w.shape[0]) for i in range(w.shape[1])]


class HandPipeline:
    """GPipe written by hand: ``M + S - 1`` ticks; at tick ``t`` stage 0 takes micro-batch ``t``, every stage
    runs its layers on what it holds and ``ppermute`` shifts the results one stage on; the last stage's output
    at tick ``t`` is micro-batch ``t - S + 1``'s, whose loss it adds. The backward is autodiff of the loop.

    ``exchange=False`` keeps each stage's result where it is instead of shifting it (a timing control, not a
    pipeline: the same ticks' compute, no device waiting for another; its gradients are not the model's)."""

    def __init__(self, stages: int, m: int, devices: list, exchange: bool = True) -> None:
        self.stages, self.m = stages, m
        self.mesh = Mesh(np.array(devices[:stages]), ("stages",))
        self.on_stages = NamedSharding(self.mesh, P("stages"))
        self.replicated = NamedSharding(self.mesh, P())
        shift = [(i, (i + 1) % stages) for i in range(stages)]

        def per_stage(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
            # p: this stage's {'w': (1, L/S, W, W), 'b': (1, L/S, W)}; x, y: (M, rows, W), every stage.
            s = lax.axis_index("stages")
            w, b = p["w"][0], p["b"][0]

            def tick(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
                h = jnp.where(s == 0, x[jnp.minimum(t, m - 1)], h)
                for i in range(w.shape[0]):
                    h = jnp.tanh(h @ w[i] + b[i])
                k = t - (stages - 1)  # the micro-batch leaving the last stage
                part = jnp.where((s == stages - 1) & (k >= 0), jnp.mean((h - y[jnp.clip(k, 0, m - 1)]) ** 2), 0.0)
                return (lax.ppermute(h, "stages", shift) if exchange else h), part

            start = lax.pcast(jnp.zeros_like(x[0]), "stages", to="varying")
            _, parts = lax.scan(tick, start, jnp.arange(m + stages - 1))
            return lax.psum(jnp.sum(parts), "stages") / m

        self.loss = jax.shard_map(per_stage, mesh=self.mesh, in_specs=(P("stages"), P(), P()), out_specs=P())

        def step(p: dict, opt: Any, x: jax.Array, y: jax.Array) -> tuple:
            value, grads = jax.value_and_grad(self.loss)(p, x, y)
            updates, opt = TX.update(grads, opt, p)
            return optax.apply_updates(p, updates), opt, value

        self.step = jax.jit(step)
        self.value_and_grad = jax.jit(jax.value_and_grad(self.loss))

    def micro(self, a: np.ndarray) -> jax.Array:
        """A batch leaf ``(B, ...)`` as ``(M, B / M, ...)`` on every stage."""
        return jax.device_put(a.reshape(self.m, a.shape[0] // self.m, *a.shape[1:]), self.replicated)

    def place(self, params: Params) -> tuple[dict, Any]:
        p = jax.device_put(stack(params, self.stages), self.on_stages)
        return p, TX.init(p)


# -- the variants --------------------------------------------------------------------------------------


def max_rel(a: Any, b: Any) -> float:
    """Largest ``|a - b| / (|b|_max + 1e-12)`` over the leaves (each leaf scaled by its own largest value)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)))
    return worst


def reference(params: Params, x: np.ndarray, y: np.ndarray, steps: int) -> tuple[Params, Params]:
    """One device's gradients at ``params`` and its parameters after ``steps`` Adam steps."""
    loss = make_loss(1)
    grads = jax.jit(jax.grad(loss))(params, x, y)
    step, p, opt = one_device_step(loss), params, TX.init(params)
    for _ in range(steps):
        p, opt, _ = step(p, opt, x, y)
    return grads, p


def single_runner(params: Params, x: np.ndarray, y: np.ndarray) -> Runner:
    dev = jax.devices()[0]
    step = one_device_step(make_loss(1))
    state = [jax.device_put(params, dev), jax.device_put(TX.init(params), dev)]
    xd, yd = jax.device_put(x, dev), jax.device_put(y, dev)

    def run() -> object:
        state[0], state[1], value = step(state[0], state[1], xd, yd)
        return value

    return run


def stage_runner(params: Params, stages: int, m: int, x: np.ndarray, y: np.ndarray) -> Runner:
    """One stage's forward and backward of one micro-batch on one device (the last stage: its layers, the loss)."""
    per = len(params) // stages
    dev = jax.devices()[0]
    mine = jax.device_put(params[-per:], dev)
    rows = x.shape[0] // m
    h, t = jax.device_put(np.tanh(x[:rows]), dev), jax.device_put(y[:rows], dev)
    f = jax.jit(jax.value_and_grad(lambda p, h, t: jnp.mean((layers_fwd(p, h) - t) ** 2), argnums=(0, 1)))
    return lambda: f(mine, h, t)


def stage_beside_runner(params: Params, stages: int, m: int, x: np.ndarray, y: np.ndarray) -> Runner:
    """:func:`stage_runner`'s tick on all ``stages`` devices at once, each its own copy: one ``shard_map``."""
    per = len(params) // stages
    mesh = Mesh(np.array(jax.devices()[:stages]), ("s",))
    everywhere = NamedSharding(mesh, P())
    mine = jax.device_put(params[-per:], everywhere)
    rows = x.shape[0] // m
    h, t = (jax.device_put(a, everywhere) for a in (np.tanh(x[:rows]), y[:rows]))
    tick = jax.value_and_grad(lambda p, h, t: jnp.mean((layers_fwd(p, h) - t) ** 2), argnums=(0, 1))
    f = jax.jit(jax.shard_map(tick, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    return lambda: f(mine, h, t)


def exchange_runner(stages: int, m: int, x: np.ndarray) -> Runner:
    """The exchanges of a pipeline's step alone: ``M + S - 1`` ticks sending one micro-batch's activation one
    stage on, then ``M + S - 1`` sending it one stage back (a ``ppermute`` each, in a ``lax.scan``), no compute."""
    mesh = Mesh(np.array(jax.devices()[:stages]), ("s",))
    forward = [(i, (i + 1) % stages) for i in range(stages)]
    backward = [(j, i) for i, j in forward]

    def sweeps(h: jax.Array) -> jax.Array:
        for pairs in (forward, backward):
            h, _ = lax.scan(lambda h, _, pairs=pairs: (lax.ppermute(h, "s", pairs), None), h, None, m + stages - 1)
        return h

    f = jax.jit(jax.shard_map(sweeps, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    h = jax.device_put(np.tanh(x[: x.shape[0] // m]), NamedSharding(mesh, P()))
    return lambda: f(h)


def update_beside_runner(params: Params, stages: int) -> Runner:
    """The Adam update of one stage's parameters (``layers / S`` layers), on all ``stages`` devices at once."""
    mesh = Mesh(np.array(jax.devices()[:stages]), ("s",))
    everywhere = NamedSharding(mesh, P())
    mine = jax.device_put(params[-(len(params) // stages) :], everywhere)
    state = [mine, jax.device_put(TX.init(mine), everywhere)]

    def update(p: Params, opt: Any, g: Params) -> tuple:
        updates, opt = TX.update(g, opt, p)
        return optax.apply_updates(p, updates), opt

    f = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))

    def run() -> object:
        state[0], state[1] = f(state[0], state[1], mine)
        return state[0]

    return run


def hand_runner(
    params: Params, stages: int, m: int, x: np.ndarray, y: np.ndarray, want: tuple[Params, Params]
) -> tuple[Runner, HandPipeline]:
    """The hand-written pipeline's step, after asserting its gradients and 2 steps' parameters equal one device's."""
    hand = HandPipeline(stages, m, jax.devices())
    xm, ym = hand.micro(x), hand.micro(y)
    p, opt = hand.place(params)
    want_grads, want_params = want
    _, grads = hand.value_and_grad(p, xm, ym)
    err = max_rel(unstack(grads), want_grads)
    assert err < ARGS.tolerance, f"hand GPipe S={stages} M={m}: gradients off one device's by {err:.2e}"
    q, o = p, opt
    for _ in range(2):
        q, o, _ = hand.step(q, o, xm, ym)
    err = max_rel(unstack(q), want_params)
    assert err < ARGS.tolerance, f"hand GPipe S={stages} M={m}: parameters off one device's by {err:.2e}"
    state = [p, opt]

    def run() -> object:
        state[0], state[1], value = hand.step(state[0], state[1], xm, ym)
        return value

    return run, hand


def no_exchange_runner(params: Params, stages: int, m: int, x: np.ndarray, y: np.ndarray) -> Runner:
    """The hand pipeline's step with its ``ppermute`` left out (``HandPipeline(exchange=False)``)."""
    hand = HandPipeline(stages, m, jax.devices(), exchange=False)
    xm, ym = hand.micro(x), hand.micro(y)
    state = list(hand.place(params))

    def run() -> object:
        state[0], state[1], value = hand.step(state[0], state[1], xm, ym)
        return value

    return run


def replicator_for(stages: int, m: int, schedule: str, recompute: bool = False) -> rp.Replicator:
    return rp.Replicator(
        1,
        stages,
        devices=jax.devices()[:stages],
        parallelism=rp.Parallelism(stages=stages, microbatches=m, schedule=schedule, recompute=recompute),
    )


class RpPipeline:
    """Replicator's pipelined step (``run_pipelined``'s program), state packed across steps."""

    def __init__(
        self,
        params: Any,
        stages: int,
        m: int,
        schedule: str,
        x: np.ndarray,
        y: np.ndarray,
        loss: Callable | None = None,
        **kw: Any,
    ):
        self.repl = replicator_for(stages, m, schedule, **kw)
        self.loss = loss or make_loss(stages)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # M < S: "most of the step is bubble", known
            self.train = self.repl.pipelined.step_for(self.loss, TX)
            # The narrowest hook to the program: the PipelineTrainStep's built step for these shapes.
            self.built = self.train.built(params, x, y)
        self.rows = self.train.pack(params, TX.init(params))
        spec = NamedSharding(self.built.mesh, P(DATA_AXES))
        self.micro = [jax.device_put(a, spec) for a in self.built.micro_leaves((x, y))]

    def run(self) -> object:
        self.rows, outputs = self.built.step(self.rows, self.micro)
        return outputs[0]

    def params(self, like: Any) -> Any:
        return self.train.unpack(like, self.rows)[0]

    def stash_bytes(self) -> int:
        """The largest stage's stash per micro-batch (its programs' residuals)."""
        return max(sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in p.residuals) for p in self.built.programs)

    def memory(self) -> MemoryUsage:
        return memory_of(self.built.step, self.rows, self.micro)


def memory_of(fn: Any, *args: Any) -> MemoryUsage:
    stats = fn.lower(*args).compile().memory_analysis()
    return MemoryUsage(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
    )


def rp_runner(
    params: Params, stages: int, m: int, schedule: str, x: np.ndarray, y: np.ndarray, want_params: Params
) -> Runner:
    pipe = RpPipeline(params, stages, m, schedule, x, y)
    for _ in range(2):
        pipe.run()
    err = max_rel(pipe.params(params), want_params)
    assert err < ARGS.tolerance, f"rp {schedule} S={stages} M={m}: parameters off one device's by {err:.2e}"
    return pipe.run


def run_pipelined_runner(params: Params, stages: int, m: int, x: np.ndarray, y: np.ndarray) -> Runner:
    """The public call: global state in and out of every step (packed and unpacked each call)."""
    repl, loss = replicator_for(stages, m, "gpipe"), make_loss(stages)
    state = [(params, TX.init(params))]
    xd, yd = jnp.asarray(x), jnp.asarray(y)

    def run() -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state[0], value = repl.run_pipelined(loss, TX, (xd, yd), state[0])
        return value

    return run


# -- 1. step time ----------------------------------------------------------------------------------------


def fmt_ms(t: float) -> str:
    return f"{t * 1e3:.2f}" if t < 10 else f"{t * 1e3:.0f}"


def paired(times: list[float], bases: list[float]) -> str:
    """The median, over the rounds, of each round's ``time / base``, with the first and third quartiles."""
    ratios = sorted(t / b for t, b in zip(times, bases, strict=True))
    if len(ratios) < 4:
        return f"{statistics.median(ratios):.2f}"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.2f} [{q1:.2f}, {q3:.2f}]"


def time_stages(stages: int, ms: list[int], params: Params, x: np.ndarray, y: np.ndarray) -> None:
    want = reference(params, x, y, 2)
    variants: dict[str, Runner] = {
        "one device": single_runner(params, x, y),
        "update beside": update_beside_runner(params, stages),
    }
    t0 = time.perf_counter()
    for m in ms:
        variants[f"stage micro-batch M={m}"] = stage_runner(params, stages, m, x, y)
        variants[f"stage micro-batch beside M={m}"] = stage_beside_runner(params, stages, m, x, y)
        variants[f"exchange M={m}"] = exchange_runner(stages, m, x)
        variants[f"hand GPipe M={m}"] = hand_runner(params, stages, m, x, y, want)[0]
        variants[f"hand GPipe, no exchange M={m}"] = no_exchange_runner(params, stages, m, x, y)
        for schedule in SCHEDULES:
            variants[f"rp {schedule} M={m}"] = rp_runner(params, stages, m, schedule, x, y, want[1])
    variants[f"rp gpipe, run_pipelined M={ms[-1]}"] = run_pipelined_runner(params, stages, ms[-1], x, y)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    samples = interleaved_samples(variants, ARGS.rounds, ARGS.steps)
    med = {k: statistics.median(v) for k, v in samples.items()}
    say(
        f"\n### 1. Step time, S = {stages} stages on {stages} devices, mlp{ARGS.layers}x{ARGS.width}, Adam, "
        f"global batch {ARGS.batch}\n"
    )
    say(
        f"(built, checked against one device and compiled in {built:.1f} s; timed in "
        f"{time.perf_counter() - t0:.1f} s. Hand GPipe's gradients and 2 steps' parameters, and replicator's "
        f"parameters, equal one device's to {ARGS.tolerance:g}, relative to each leaf's largest value.)\n"
    )
    say(
        "tick t_M: one stage's forward and backward of one micro-batch (batch / M rows) on one device, timed in "
        "the same rounds; ideal = (M + S - 1) t_M; bubble measured = 1 - M t_M / step (everything but the "
        "stage's own compute counts as bubble; at tiny sizes t_M is mostly one call's dispatch). t'_M: the same "
        "tick run on all S devices at once (each stage's cores shared as in the pipeline); ideal' = (M + S - 1) "
        "t'_M. x_M: the step's 2 (M + S - 1) exchanges alone (ppermute of one micro-batch's activation, no "
        "compute). u': the Adam update of one stage's parameters, on all S devices at once.\n"
    )
    one, update = med["one device"], med["update beside"]
    say(f"u' = {fmt_ms(update)} ms.\n")
    say(
        "The paired columns divide each round's step by the same round's hand GPipe step (or `ideal' + x_M + u'` "
        "from the same round's `t'_M`, `x_M`, `u'`), then give the median over the rounds and, in brackets, "
        "their first and third quartiles: what the machine's drift between rounds does not move.\n"
    )
    say(
        "| M | variant | median step (ms) | / one device | / hand GPipe | paired / hand GPipe | tick t_M (ms) "
        "| ideal (M+S-1) t_M (ms) | measured / ideal | t'_M beside (ms) | measured / ideal' | x_M (ms) "
        "| measured / (ideal' + x_M) | measured / (ideal' + x_M + u') | paired / (ideal' + x_M + u') "
        "| bubble ideal | bubble measured |"
    )
    say("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    say(f"| - | one device | {fmt_ms(one)} | 1.00x | | | | | | | | | | | | | |")
    for m in ms:
        tick = med[f"stage micro-batch M={m}"]
        beside = med[f"stage micro-batch beside M={m}"]
        exchange = med[f"exchange M={m}"]
        hand = med[f"hand GPipe M={m}"]
        ideal = (m + stages - 1) * tick
        bubble = (stages - 1) / (m + stages - 1)
        names = [
            f"hand GPipe M={m}",
            f"hand GPipe, no exchange M={m}",
            *(f"rp {schedule} M={m}" for schedule in SCHEDULES),
        ]
        if m == ms[-1]:
            names.append(f"rp gpipe, run_pipelined M={m}")
        floors = [
            (m + stages - 1) * b + x + u
            for b, x, u in zip(
                samples[f"stage micro-batch beside M={m}"],
                samples[f"exchange M={m}"],
                samples["update beside"],
                strict=True,
            )
        ]
        for name in names:
            t = med[name]
            say(
                f"| {m} | {name.rsplit(' M=', 1)[0]} | {fmt_ms(t)} | {t / one:.2f}x | {t / hand:.2f}x | "
                f"{paired(samples[name], samples[f'hand GPipe M={m}'])} | "
                f"{fmt_ms(tick)} | {fmt_ms(ideal)} | {t / ideal:.2f} | {fmt_ms(beside)} | "
                f"{t / ((m + stages - 1) * beside):.2f} | {fmt_ms(exchange)} | "
                f"{t / ((m + stages - 1) * beside + exchange):.2f} | "
                f"{t / ((m + stages - 1) * beside + exchange + update):.2f} | {paired(samples[name], floors)} | "
                f"{bubble:.3f} | {1 - m * tick / t:.3f} |"
            )


def time_stacked(stages: int, m: int, params: Params) -> None:
    """The stacked MLP (one ``lax.scan``) and the one-leaf-per-layer MLP under replicator's GPipe and 1F1B,
    against the hand GPipe (itself written on the stacked weights), at each of ``--stacked-rows`` rows per
    micro-batch: paired ratios of the same rounds, interleaved; and each program's stash per micro-batch (the
    largest stage's) and XLA's temporaries."""
    stacked = stacked_params(params)
    for rows in map(int, ARGS.stacked_rows.split(",")):
        x, y = batch_of(rows * m, ARGS.width)
        want = reference(params, x, y, 2)
        hand = hand_runner(params, stages, m, x, y, want)[0]
        variants: dict[str, Runner] = {"hand GPipe": hand}
        pipes: dict[str, RpPipeline] = {}
        t0 = time.perf_counter()
        for schedule in ("gpipe", "1f1b"):
            for form, p, loss in (("stacked", stacked, stacked_loss), ("one leaf per layer", params, None)):
                pipe = RpPipeline(p, stages, m, schedule, x, y, loss=loss)
                for _ in range(2):
                    pipe.run()
                got = pipe.params(p)
                got = [{"w": got["w"][i], "b": got["b"][i]} for i in range(len(params))] if form == "stacked" else got
                err = max_rel(got, want[1])
                assert err < ARGS.tolerance, f"rp {schedule} {form}: parameters off one device's by {err:.2e}"
                name = f"rp {schedule}, {form}"
                pipes[name], variants[name] = pipe, pipe.run
        built = time.perf_counter() - t0
        samples = interleaved_samples(variants, ARGS.rounds, ARGS.steps)
        med = {k: statistics.median(v) for k, v in samples.items()}
        say(
            f"\n### 1b. Stacked scan against one leaf per layer, S = {stages}, M = {m}, {rows} rows per "
            f"micro-batch (global batch {rows * m}), mlp{ARGS.layers}x{ARGS.width}, Adam\n"
        )
        say(
            f"(built, checked against one device and compiled in {built:.1f} s. Paired: each round's step over the "
            "same round's hand GPipe step; median [quartiles] over the rounds. Stash: the largest stage's residuals "
            "per micro-batch; temporaries: XLA's memory analysis of the compiled step.)\n"
        )
        say("| variant | median step (ms) | paired / hand GPipe | stash / micro-batch (KiB) | temporaries (KiB) |")
        say("|---|---:|---:|---:|---:|")
        say(f"| hand GPipe (stacked weights) | {fmt_ms(med['hand GPipe'])} | 1.00 | | |")
        for name, pipe in pipes.items():
            say(
                f"| {name} | {fmt_ms(med[name])} | {paired(samples[name], samples['hand GPipe'])} | "
                f"{kib(pipe.stash_bytes())} | {kib(pipe.memory().temporaries)} |"
            )


# -- 2. memory ---------------------------------------------------------------------------------------------


def kib(n: int) -> str:
    return f"{n / 2**10:.1f}"


def memory_table(stages: int, params: Params, x: np.ndarray, y: np.ndarray) -> None:
    ms = [stages * k for k in ((1, 2) if ARGS.quick else (1, 2, 4, 8)) if ARGS.batch % (stages * k) == 0]
    say(f"\n### 2. Per-device memory, S = {stages}, XLA's compiled memory analysis (KiB)\n")
    say("| M | program | arguments | outputs | aliased | temporaries | peak |")
    say("|---:|---|---:|---:|---:|---:|---:|")

    def row(m: Any, name: str, u: MemoryUsage) -> None:
        cells = (u.arguments, u.outputs, u.aliased, u.temporaries, u.peak)
        say(f"| {m} | {name} | " + " | ".join(kib(c) for c in cells) + " |")

    dev = jax.devices()[0]
    one = jax.device_put((params, TX.init(params)), dev)
    row("-", "one device", memory_of(one_device_step(make_loss(1)), *one, *jax.device_put((x, y), dev)))
    for m in ms:
        hand = HandPipeline(stages, m, jax.devices())
        row(m, "hand GPipe", memory_of(hand.step, *hand.place(params), hand.micro(x), hand.micro(y)))
        for name, schedule, recompute in (
            ("rp gpipe", "gpipe", False),
            ("rp 1f1b", "1f1b", False),
            ("rp 1f1b-fused", "1f1b-fused", False),
            ("rp gpipe + recompute", "gpipe", True),
        ):
            row(m, name, RpPipeline(params, stages, m, schedule, x, y, recompute=recompute).memory())


# -- 3. state bytes per device -------------------------------------------------------------------------------


def device0_bytes(tree: Any) -> int:
    dev = jax.devices()[0]
    return sum(
        shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards if shard.device == dev
    )


def state_table(params: Params, x: np.ndarray, y: np.ndarray) -> None:
    n = jax.device_count()
    whole_p = sum(np.asarray(a).nbytes for a in jax.tree.leaves(params))
    whole_o = sum(np.asarray(a).nbytes for a in jax.tree.leaves(TX.init(params)))
    say(f"\n### 3. Parameters and Adam state per device (bytes on device 0), {n} devices\n")
    say("| S | replicas D | ZeRO | parameters and optimizer state | / replicated | describe_pipeline: row_bytes |")
    say("|---:|---:|---:|---:|---:|---|")
    say(f"| replicated | - | - | {whole_p + whole_o} | 1.00 | |")
    for stages in (1, 2, 4):
        if n % stages or len(params) % stages:
            continue
        for zero in (0, 1, 3) if n > stages else (0,):  # ZeRO over each stage's D = n / S replicas
            passes = rp.PassManager.default(zero=zero) if zero else None
            repl = rp.Replicator(1, n, parallelism=rp.Parallelism(stages=stages, microbatches=stages), passes=passes)
            loss, opt_state = make_loss(stages), TX.init(params)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                train = repl.pipelined.step_for(loss, TX)
                train.built(params, x, y)
                report = repl.describe_pipeline(loss, TX, (x, y), (params, opt_state))
            got = device0_bytes(train.pack(params, opt_state))
            say(f"| {stages} | {n // stages} | {zero} | {got} | {got / (whole_p + whole_o):.2f} | {report.row_bytes} |")


def main() -> None:
    n = jax.device_count()
    stages = [s for s in map(int, ARGS.stages.split(",")) if s <= n]
    ms = [int(m) for m in ARGS.microbatches.split(",")]
    say(
        f"# pipeline benchmark: jax {jax.__version__}, {n} emulated CPU devices, {os.cpu_count()} host cores; "
        f"mlp{ARGS.layers}x{ARGS.width}, global batch {ARGS.batch}; {ARGS.rounds} interleaved rounds x "
        f"{ARGS.steps} steps, medians"
    )
    params = mlp_init(ARGS.layers, ARGS.width)
    x, y = batch_of(ARGS.batch, ARGS.width)
    for s in stages:
        if ARGS.layers % s or any(ARGS.batch % m for m in ms):
            raise SystemExit(f"--layers must be a multiple of S={s} and --batch of every M in {ms}.")
        if not ARGS.only_stacked:
            time_stages(s, ms, params, x, y)
        time_stacked(s, ARGS.stacked_m, params)
    if not ARGS.only_stacked:
        for s in stages:
            memory_table(s, params, x, y)
        state_table(params, x, y)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write("\n".join(LINES) + "\n")
        print(f"\ntables written to {ARGS.out}")


if __name__ == "__main__":
    main()
