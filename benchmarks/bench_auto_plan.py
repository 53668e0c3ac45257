"""plan='auto' against the hand-written plans: bytes over the tensor axis and state per device, as ``explain`` counts them.

    python benchmarks/bench_auto_plan.py [--tensor 2] [--sequence-dim 1]

Two models, each run as ``Replicator(1, 8, parallelism=Parallelism(tensor=T, ...))`` (8 emulated CPU devices,
``8 / T`` data replicas) with the hand-written plan and with ``tensor_plan="auto"``:

* the GPT of ``examples/gpt_tensor.py`` (its ``PLAN``: attention and MLP Megatron's way, the embedding by
  vocabulary rows);
* a residual MLP stack with AdamW (``fc1: column, fc2: row``, the plan of ``bench_tensor.py``).

``auto`` runs twice: with ``memory_budget`` = the state per device the hand-written plan holds (the fewest bytes
that fit in it), and without a budget (the least time the cost model predicts on the backend's preset). Bytes
are what one device sends per step over 'tensor' (ring algorithm) for each plan as ``repl.explain`` lists its
collectives; nothing is timed. The last column is auto's bytes over the hand-written plan's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import replicator as rp  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", type=int, default=2)
    p.add_argument("--sequence-dim", type=int, default=None, help="let auto try sequence parallelism on this dimension")
    p.add_argument("--report", action="store_true", help="print auto's report (the plans it considered)")
    args = p.parse_args()
    rp.force_cpu_devices(8)

    import gpt_tensor
    import jax
    import jax.numpy as jnp
    import optax

    from replicator.tensor import Shard, TensorParallel
    from replicator.tensor.auto import Auto
    from replicator.tensor.parallelize import sent_bytes

    t = args.tensor
    opt = optax.adamw(1e-3)

    def mlp_loss(params, batch):
        x = batch["x"]
        for p in params:
            x = x + jax.nn.gelu(x @ p["fc1"]) @ p["fc2"]
        return jnp.mean((x - batch["y"]) ** 2)

    def mlp_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = opt.update(rp.all_mean(grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), rp.all_mean(loss)

    def mlp_one(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    mlp_params = [
        {
            "fc1": jax.random.normal(keys[2 * i], (256, 1024)) / 16,
            "fc2": jax.random.normal(keys[2 * i + 1], (1024, 256)) / 32,
        }
        for i in range(4)
    ]
    mlp_batch = {"x": jnp.ones((64, 256)), "y": jnp.zeros((64, 256))}
    models = {
        "gpt (examples/gpt_tensor.py)": (
            gpt_tensor.train_step,
            gpt_tensor.one_device_step,
            gpt_tensor.initial_state(),
            gpt_tensor.synthetic_batch(0),
            gpt_tensor.PLAN,
        ),
        "mlp 4 x (256 -> 1024 -> 256)": (
            mlp_step,
            mlp_one,
            (mlp_params, opt.init(mlp_params)),
            mlp_batch,
            {"0/*/fc1": "column", "0/*/fc2": "row"},
        ),
    }
    print(f"T = {t}, 8 devices (data replicas: {8 // t}); bytes a device sends over 'tensor' per step, ring algorithm")
    print(f"{'model':<30} {'plan':<22} {'sent B':>10} {'collectives':>11} {'state B/device':>15} {'auto/hand':>9}")
    for name, (step, one_device, state, batch, plan) in models.items():
        placements = TensorParallel(one_device, plan, size=t).placements(state, batch)
        leaves = jax.tree.leaves(state)
        hand_state = sum(
            x.nbytes // t if isinstance(p, Shard) else x.nbytes
            for x, p in zip(leaves, placements.values(), strict=True)
        )
        rows = [("hand-written", plan, None)]
        rows.append(
            ("auto, budget = hand's", Auto(memory_budget=hand_state, sequence_dim=args.sequence_dim), hand_state)
        )
        rows.append(("auto, no budget", Auto(sequence_dim=args.sequence_dim), None))
        hand_bytes = None
        for label, tensor_plan, _ in rows:
            repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=t, tensor_plan=tensor_plan))
            report = repl.explain(step, batch, state)
            sent = sum(sent_bytes(c, t) for c in report.tensor.collectives)
            if hand_bytes is None:
                hand_bytes, held = sent, hand_state
            else:
                chosen = tensor_plan.chosen
                held = chosen.chosen.state_bytes
            ratio = "" if label == "hand-written" else (f"{sent / hand_bytes:.3f}" if hand_bytes else "-")
            print(f"{name:<30} {label:<22} {sent:>10.0f} {len(report.tensor.collectives):>11} {held:>15} {ratio:>9}")
            if label != "hand-written":
                print(
                    f"{'':<30}   plan: {chosen.rules}"
                    + (
                        f", sequence parallel {chosen.sequence_parallel}"
                        if chosen.sequence_parallel is not None
                        else ""
                    )
                )
                if args.report:
                    print(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
