"""Train a small GPT (Flax linen, tied embeddings) over data x pipeline stages x tensor parallelism, then check it
against one device.

The model is a GPT-2-style decoder at a size two CPU cores train in a minute: token and position
embeddings, ``--depth`` pre-LayerNorm blocks (causal multi-head self-attention, an MLP), a final
LayerNorm, and logits from the token embedding itself (tied: ``nn.Embed.attend``). The loss is optax's
cross-entropy; the step is the one written for data parallelism (``jax.value_and_grad``,
``rp.all_mean(grads)``, AdamW). Nothing in the model knows about tensor parallelism: a plan of seven
lines over Flax's parameter paths splits the attention's query/key/value projections and the MLP's
first matrix by columns (the heads split with them), the attention's output projection and the MLP's
second matrix by rows, and the embedding table by vocabulary rows (Megatron's vocabulary-parallel
embedding and cross-entropy fall out of the rules). ``--sequence-parallel`` also splits the activations
on the sequence between the tensor-parallel regions. The model marks one ``rp.stage_boundary`` between its
two blocks (the identity on one device): with ``--stages 2`` (the default) the step is cut there into two
pipeline stages, the embedding tied across them.

``rp.Trainer`` runs the step on ``Replicator(W, C, parallelism=rp.Parallelism(tensor=T, stages=S, ...))``:
``W x C`` devices, ``W x C / (S x T)`` data-parallel replicas. At the end the same steps run on one device
with plain ``jax.jit`` on the same global batches, and the parameters, Adam's state and the losses are
compared.

Run it (8 emulated CPU devices by default: 2 replicas x 2 stages x tensor 2)::

    python examples/gpt_tensor.py
    python examples/gpt_tensor.py --schedule gpipe --zero 3 --sequence-parallel
    python examples/gpt_tensor.py --stages 1 --tensor 4 --sequence-parallel --steps 5
"""

from __future__ import annotations

import argparse
import sys
import time

# Importing jax does not start its backend; rp.force_cpu_devices() in main() must run before anything does.
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp
from replicator.tensor.parallelize import sent_bytes

VOCAB = 64
SEQ = 16
WIDTH = 32
HEADS = 4
DEPTH = 2
GLOBAL_BATCH = 16
PARAM_TOLERANCE = 5e-5  # max |replicated - one device| over parameters and Adam's state, relative
LOSS_TOLERANCE = 1e-5

#: Which parameters are split over the tensor axis, by Flax's parameter paths (the state is
#: ``(params, opt_state)``: ``0/...`` are the parameters; Adam's moments follow them by themselves).
PLAN = {
    "0/params/**/query/kernel": "column",
    "0/params/**/key/kernel": "column",
    "0/params/**/value/kernel": "column",
    "0/params/**/out/kernel": "row",
    "0/params/**/fc1/kernel": "column",
    "0/params/**/fc2/kernel": "row",
    "0/params/embed/embedding": 0,  # vocabulary rows: the lookup and the tied logits split by vocabulary
}


# -- data: sequences with a rule to learn ------------------------------------------------------------


def synthetic_batch(step: int, size: int = GLOBAL_BATCH) -> dict[str, np.ndarray]:
    """Token sequences that mostly count up by a per-sequence stride (mod VOCAB), with some noise.

    Deterministic in ``step``: the replicated and the one-device runs see the same batches.
    """
    rng = np.random.default_rng([11, step])
    start = rng.integers(0, VOCAB, (size, 1))
    stride = rng.integers(1, 4, (size, 1))
    tokens = (start + stride * np.arange(SEQ + 1)) % VOCAB
    noise = rng.random((size, SEQ + 1)) < 0.1
    tokens = np.where(noise, rng.integers(0, VOCAB, (size, SEQ + 1)), tokens)
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


# -- model: a GPT in Flax linen ----------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, h = x.shape
        split = lambda t: t.reshape(b, s, self.heads, h // self.heads)  # noqa: E731
        q = split(nn.Dense(h, use_bias=False, name="query")(x))
        k = split(nn.Dense(h, use_bias=False, name="key")(x))
        v = split(nn.Dense(h, use_bias=False, name="value")(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(h // self.heads)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, h)
        return nn.Dense(h, name="out")(out)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.heads, name="attn")(nn.LayerNorm(name="ln1")(x))
        h = nn.Dense(4 * x.shape[-1], name="fc1")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(x.shape[-1], name="fc2")(nn.gelu(h))


class GPT(nn.Module):
    depth: int = DEPTH
    stages: int = 1  # pipeline stages: an rp.stage_boundary after every depth/stages blocks

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, WIDTH, name="embed")
        position = self.param("position", nn.initializers.normal(0.02), (SEQ, WIDTH))
        x = embed(tokens) + position[: tokens.shape[1]]
        for i in range(self.depth):
            x = Block(HEADS, name=f"block_{i}")(x)
            if (i + 1) % (self.depth // self.stages) == 0 and i + 1 < self.depth:
                x = rp.stage_boundary(x)  # the identity except where a pipeline cuts the step here
        return embed.attend(nn.LayerNorm(name="ln_f")(x))  # tied: the logits read the token table


MODEL = GPT()
OPTIMIZER = optax.adamw(3e-3, weight_decay=1e-2)


def loss_fn(params: dict, batch: dict) -> jax.Array:
    logits = MODEL.apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def train_step(state: tuple, batch: dict) -> tuple:
    """One replica's step, as written for data parallelism."""
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = rp.all_mean(grads)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": rp.all_mean(loss)}


def one_device_step(state: tuple, batch: dict) -> tuple:
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def initial_state() -> tuple:
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    return params, OPTIMIZER.init(params)


def tensor_lines(report) -> list[str]:
    """The activation-sized collectives over 'tensor' of ``repl.explain``'s report (either kind), and a count
    of the small ones."""
    over_tensor = report.tensor.collectives
    big = [c for c in over_tensor if len(c.shape) == 3]  # activations: (rows, sequence, width or vocabulary)
    lines = [f"  {c.kind:<14} {c.dtype}{list(c.shape)}  {c.line.rsplit('/', 1)[-1]}  {c.reason}" for c in big]
    small = len(over_tensor) - len(big)
    return [*lines, f"  and {small} of small gradients (layer norms' and biases', shared by the devices)"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--tensor", type=int, default=2, help="T: the devices each replica's matrices are split over")
    p.add_argument("--sequence-parallel", action="store_true", help="split activations on the sequence too")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the data replicas")
    p.add_argument("--stages", type=int, default=2, choices=(1, 2), help="pipeline stages (2: the blocks cut in two)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "1f1b-fused"))
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (with --stages 2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    rp.force_cpu_devices(args.devices)

    global MODEL
    MODEL = GPT(DEPTH, args.stages)  # the same model for the one-device reference: the boundary is the identity
    pipeline = {"stages": 2, "microbatches": args.microbatches, "schedule": args.schedule} if args.stages > 1 else {}
    parallelism = rp.Parallelism(
        tensor=args.tensor, tensor_plan=PLAN, sequence_parallel=1 if args.sequence_parallel else None, **pipeline
    )
    passes = rp.PassManager.default(zero=args.zero, shard_optimizer_min_bytes=0)
    repl = rp.Replicator(args.workers, args.devices // args.workers, passes=passes, parallelism=parallelism)
    replicas = repl.num_replicas if repl.pipelined is None else repl.pipelined.replicas
    rows = GLOBAL_BATCH // repl.num_workers  # each worker's share of a global batch
    print(
        f"GPT: vocabulary {VOCAB}, width {WIDTH}, {HEADS} heads, {DEPTH} blocks, sequences of {SEQ}; "
        f"{args.devices} devices: {replicas} data-parallel replicas x "
        + (f"{args.stages} stages ({args.schedule}, {args.microbatches} micro-batches) x " if args.stages > 1 else "")
        + f"tensor {args.tensor}"
        + (" with sequence parallelism" if args.sequence_parallel else "")
        + (f", ZeRO stage {args.zero} over the replicas" if args.zero else "")
    )

    def input_fn(ctx: rp.InputContext):
        for step in range(args.steps):
            batch = synthetic_batch(step)
            yield {k: v[ctx.worker_id * rows : (ctx.worker_id + 1) * rows] for k, v in batch.items()}

    start = time.time()
    report = repl.explain(train_step, next(iter(input_fn(repl.input_context(0)))), initial_state())
    per = "step" if args.stages == 1 else "micro-batch"
    print(f"the plan inserts {len(report.tensor.collectives)} collectives over 'tensor' per {per}:")
    print("\n".join(tensor_lines(report)))
    # Megatron's count (Narayanan et al., SC'21): per block and micro-batch, 8bsh(t-1)/t elements sent by each
    # device (forward and backward); the collectives of the blocks' lines, from the report.
    t = args.tensor
    in_blocks = [  # the blocks' activations (b, s, h), not the embedding's nor the loss's
        c for c in report.tensor.collectives if len(c.shape) == 3 and c.shape[-1] == WIDTH and "GPT." not in c.line
    ]
    b, seq, h = in_blocks[0].shape if in_blocks else (0, SEQ, WIDTH)
    sent = sum(sent_bytes(c, t) for c in in_blocks) / DEPTH
    megatron = 8 * b * seq * h * (t - 1) / t * 4  # float32
    print(f"bytes over 'tensor' per block and {per}: {sent:.0f} (Megatron's 8bsh(t-1)/t x 4 B: {megatron:.0f})")
    losses: list[float] = []

    class Record(rp.Hook):
        def after_step(self, trainer):  # noqa: D102
            losses.append(float(np.asarray(trainer.outputs["loss"])[0]))
            if trainer.step % args.log_every == 0 or trainer.step == args.steps:
                print(f"step {trainer.step:>3}/{args.steps}  loss {losses[-1]:.4f}", flush=True)

    trainer = rp.Trainer(repl, train_step, input_fn, initial_state(), hooks=[Record()])
    got = trainer.run(args.steps)
    print(f"trained {args.steps} steps in {time.time() - start:.1f} s")

    state, want_losses = initial_state(), []
    step = jax.jit(one_device_step)
    for i in range(args.steps):
        state, loss = step(state, synthetic_batch(i))
        want_losses.append(float(loss))

    failures = []
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b)))) if b.size else 0.0)
    print(f"max |replicated - one device| over parameters and Adam's state, relative: {worst:.2e}")
    if not worst <= PARAM_TOLERANCE:
        failures.append(f"parameters differ by {worst:.2e} > {PARAM_TOLERANCE}")
    loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses, strict=True))
    print(f"max |replicated - one device| loss over {args.steps} steps: {loss_diff:.2e}")
    if not loss_diff <= LOSS_TOLERANCE:
        failures.append(f"losses differ by {loss_diff:.2e} > {LOSS_TOLERANCE}")
    if repl.pipelined is None:
        split = got[0]["params"]["block_0"]["fc1"]["kernel"]
        share = split.addressable_shards[0].data.size / split.size
        # ZeRO-3 also splits each device's block of a parameter over the data replicas (stages 1-2: its Adam state).
        bound = 1 / args.tensor / (replicas if args.zero == 3 else 1)
        print(f"a split parameter held per device: {share:.4f} of it (bound {bound:.4f})")
        if share > 1.1 * bound:
            failures.append(f"a split parameter is held {share:.4f} per device, more than 1.1 x {bound:.4f}")
    else:
        # Each device holds its stage's packed row: its tensor blocks of the split leaves, the others whole.
        held = sum(v.addressable_shards[0].data.nbytes for v in repl.pipelined.last_rows.values())  # device 0
        built = repl.pipelined.user_step(train_step, synthetic_batch(0), initial_state())
        split = [getattr(p, "dim", None) is not None for p in built.tensor_split.placements]
        mine = [(x.nbytes, split[i]) for i, x in enumerate(jax.tree.leaves(got)) if 0 in built.held[i]]
        whole = sum(n for n, _ in mine)
        # The bound: a split leaf 1/T, the others whole; ZeRO-3 then 1/D of each (stages 1-2 hold less still).
        bound = sum(n / args.tensor if s else n for n, s in mine) / (replicas if args.zero == 3 else 1)
        print(
            f"stage 0's state held per device: {held} bytes of its {whole} whole ({held / whole:.3f}; bound {bound:.0f})"
        )
        if held > 1.1 * bound:
            failures.append(f"a device of stage 0 holds {held} bytes, more than 1.1 x {bound:.0f}")
    if sent != megatron:  # with sequence parallelism too: 4 all-gathers and 4 reduce-scatters per block
        failures.append(f"{sent:.0f} bytes over 'tensor' per block, Megatron's count is {megatron:.0f}")
    if not losses[-1] < losses[0]:
        failures.append(f"the loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})")
    for f in failures:
        print(f"FAIL: {f}")
    print("FAIL" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
