"""Train an MLP data-parallel with replicator, then check it against one device.

The step function below is written for ONE replica: it sees its share of the
global batch, computes gradients, averages them across replicas with
``rp.all_mean`` and applies an optax update. ``Replicator.run`` runs it on
every device of a ``('workers', 'cores')`` mesh. At the end the same training
is repeated on a single device with plain ``jax.jit`` on the same global
batches, and the two sets of parameters are compared.

Run it (8 emulated CPU devices by default)::

    python examples/train_mlp.py
    python examples/train_mlp.py --devices 8 --workers 2 --steps 100
"""

from __future__ import annotations

import argparse
import itertools
import time

# Importing jax does not start its backend; the first jax.devices() or array
# operation does. rp.force_cpu_devices() must run before that (see main()).
import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp

GLOBAL_BATCH = 256  # rows per step, summed over all replicas
HIDDEN = 64
LEARNING_RATE = 1e-2
TOLERANCE = 1e-4  # max |replicated - single-device| parameter difference allowed


# -- data: two interleaved spirals, generated with numpy ------------------------


def spiral_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: points of two spirals and their class (0/1).

    Deterministic in ``step``, so both runs below see exactly the same data.
    """
    rng = np.random.default_rng(step)
    label = rng.integers(0, 2, size)
    t = rng.uniform(0.0, 1.0, size)
    angle = 2.0 * np.pi * t + np.pi * label  # the second spiral is the first turned by 180 degrees
    radius = 2.0 * t
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    x += rng.normal(scale=0.05, size=x.shape)
    return x.astype(np.float32), label.astype(np.int32)


def input_fn(ctx: rp.InputContext):
    """One worker's batches: its contiguous slice of every global batch.

    Replicator splits this worker's rows over its cores in order, so replica
    ``worker * cores_per_worker + core`` sees rows of the global batch in
    replica order, and together the replicas see the whole global batch.
    """
    rows = ctx.worker_batch_size(GLOBAL_BATCH)
    start = ctx.worker_id * rows
    for step in itertools.count():
        x, y = spiral_batch(step)
        yield {"x": x[start : start + rows], "y": y[start : start + rows]}


# -- model: a plain-JAX MLP ------------------------------------------------------


def init_params(key: jax.Array, sizes=(2, HIDDEN, HIDDEN, 2)) -> list[dict[str, jax.Array]]:
    params = []
    for n_in, n_out, k in zip(sizes[:-1], sizes[1:], jax.random.split(key, len(sizes) - 1), strict=True):
        w = jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in)
        params.append({"w": w, "b": jnp.zeros(n_out)})
    return params


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
    logits = mlp(params, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = (logits.argmax(-1) == batch["y"]).mean()
    return loss, accuracy


optimizer = optax.adam(LEARNING_RATE)


# -- the step, written for one replica ------------------------------------------


def step_fn(state, batch):
    params, opt_state = state
    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    grads = rp.all_mean(grads)  # the only line that is about replication
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = rp.all_mean({"loss": loss, "accuracy": accuracy})
    return (params, opt_state), metrics


@jax.jit
def single_device_step(state, batch):
    """The same update on the whole global batch, no replication."""
    params, opt_state = state
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


# -- main ----------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
    parser.add_argument("--workers", type=int, default=1, help="workers; cores per worker = devices / workers")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
    args = parser.parse_args()
    if args.devices < 1 or args.workers < 1 or args.steps < 1 or args.log_every < 1:
        parser.error("--devices, --workers, --steps and --log-every must be positive")
    if args.devices % args.workers:
        parser.error(f"--devices {args.devices} is not divisible by --workers {args.workers}")
    if GLOBAL_BATCH % args.devices:
        parser.error(f"the global batch {GLOBAL_BATCH} is not divisible by --devices {args.devices}")
    return args


def main() -> None:
    args = parse_args()
    rp.force_cpu_devices(args.devices)  # before anything starts JAX's backend
    start = time.perf_counter()

    repl = rp.Replicator(num_workers=args.workers, cores_per_worker=args.devices // args.workers)
    print(repl)
    print(f"{repl.num_replicas} replicas, global batch {GLOBAL_BATCH}, {GLOBAL_BATCH // repl.num_replicas} rows each")

    params = init_params(jax.random.key(0))
    state0 = (params, optimizer.init(params))

    # What replicator compiles: placeholders in the traced graph, real
    # collectives after the `lower-collectives` pass. print(lowered) shows it all.
    worker_batch = next(input_fn(repl.input_context(0)))
    lowered = repl.lower(step_fn, worker_batch, state0)
    placeholders = sorted(p.name for p in rp.primitives.PLACEHOLDERS)
    collectives = placeholders + ["psum", "all_gather", "psum_scatter", "axis_index"]
    print(f"passes: {' -> '.join(snapshot.name for snapshot in lowered.snapshots)}")
    print(f"  traced per-replica graph: {rp.passes.count_primitives(lowered.traced.jaxpr, collectives)}")
    print(f"  after lower-collectives:  {rp.passes.count_primitives(lowered.final.jaxpr, collectives)}")
    for snapshot in (lowered.snapshots[0], lowered.snapshots[-1]):
        eqn = next((e for e in snapshot.graph.jaxpr.eqns if e.primitive.name in collectives), None)
        if eqn is None:  # e.g. one replica: simplify removed every collective
            print(f"  no collective left after {snapshot.name}")
            continue
        attrs = ", ".join(f"{k}={v}" for k, v in eqn.params.items())
        print(f"  first collective, {snapshot.name}: {eqn.primitive.name}[{attrs}] on {len(eqn.invars)} array(s)")

    # Data-parallel training.
    state = state0
    for step in range(1, args.steps + 1):
        state, metrics = repl.run(step_fn, input_fn, state)
        if step % args.log_every == 0 or step in (1, args.steps):
            # Outputs are stacked along a leading replica axis; all_mean made them equal.
            print(f"step {step:4d}  loss {float(metrics['loss'][0]):.4f}  accuracy {float(metrics['accuracy'][0]):.3f}")
    replicated_params = state[0]
    train_time = time.perf_counter() - start

    # The same training on one device, on the same global batches.
    ref_state = jax.device_put(state0, jax.devices()[0])
    for step in range(args.steps):
        x, y = spiral_batch(step)
        ref_state, ref_loss = single_device_step(ref_state, {"x": x, "y": y})
    print(f"single device: final loss {float(ref_loss):.4f}")

    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(replicated_params), jax.tree.leaves(ref_state[0]), strict=True)
    )
    print(f"max |replicated - single-device| parameter difference: {diff:.2e} (tolerance {TOLERANCE:.0e})")
    print(f"compiled {repl.trace_count} time(s); replicated run took {train_time:.1f} s incl. compiling")
    assert diff < TOLERANCE, f"replicated and single-device parameters differ by {diff:.2e} > {TOLERANCE:.0e}"
    print("PASS")


if __name__ == "__main__":
    main()
