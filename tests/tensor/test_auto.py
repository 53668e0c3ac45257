"""``plan="auto"``: the plan the cost model chooses, against facts known without it.

Megatron's MLP (column-split ``fc1``, row-split ``fc2``: one all-reduce per block forward) is the known
optimum of a residual MLP stack; the small GPT of ``examples/gpt_tensor.py`` has a hand-written plan whose
bytes over the tensor axis ``explain`` counts; a run with the chosen plan is compared with one device; a
budget no plan meets names the smallest state per device (computed here from the leaves' sizes).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.cost.collectives import ring_matmul_time
from replicator.cost.compute import Compute
from replicator.cost.topology import Link, Topology, get_topology
from replicator.tensor import TensorParallel, TensorPlacementError
from replicator.tensor.auto import Auto, choose_plan, human, resolve_plan, suggest_layout
from replicator.tensor.interpret import BATCH
from replicator.tensor.parallelize import sent_bytes
from replicator.tensor.plan import leaf_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt_tensor  # noqa: E402

OPT = optax.adamw(1e-2)


def _loss(params, x, y):
    for p in params:
        hidden = jax.nn.gelu(x @ p["fc1"]["kernel"] + p["fc1"]["bias"])
        x = x + hidden @ p["fc2"]["kernel"]
    return jnp.mean((x - y) ** 2)


def _step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(_loss)(params, *batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def _mlp(h=16, f=64, blocks=2, rows=8, shapes_only=False):
    def make():
        keys = jax.random.split(jax.random.PRNGKey(0), 2 * blocks)
        params = [
            {
                "fc1": {"kernel": jax.random.normal(keys[2 * i], (h, f)) / 4, "bias": jnp.zeros(f)},
                "fc2": {"kernel": jax.random.normal(keys[2 * i + 1], (f, h)) / 8},
            }
            for i in range(blocks)
        ]
        return (params, OPT.init(params)), (jnp.ones((rows, h)), jnp.zeros((rows, h)))

    return jax.eval_shape(make) if shapes_only else make()


def _nbytes(tree):
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


MEGATRON = {"0/*/fc1/kernel": "column", "0/*/fc2/kernel": "row"}


@pytest.mark.parametrize("size", [2, 4])
def test_with_a_budget_the_mlp_gets_megatrons_column_then_row(size):
    state, batch = _mlp()
    chosen = choose_plan(_step, state, batch, size, memory_budget=_nbytes(state) - 1)
    assert chosen.rules == MEGATRON
    # One all-reduce of the (8, 16) activations per block forward, one backward (the first block's input is the batch).
    assert [(c.kind, c.shape) for c in chosen.chosen.collectives] == [("all-reduce", (8, 16))] * 3
    assert "why each split" in str(chosen) and "0/*/fc1/kernel" in str(chosen)


def test_without_a_budget_the_predicted_time_decides():
    # Large matrices on NVLink: the split matmuls save more time than the all-reduces cost.
    state, batch = _mlp(h=1024, f=4096, rows=8192, shapes_only=True)
    big = choose_plan(_step, state, batch, 4, topology="gpu-nvlink-8")
    assert big.rules == MEGATRON
    assert big.chosen.time_s < big.replicated.time_s
    # The small MLP: every all-reduce costs more latency than the work it splits saves, so nothing is split,
    # and a budget then forces the split the time alone would not make.
    state, batch = _mlp()
    small = choose_plan(_step, state, batch, 2, topology="gpu-nvlink-8")
    assert small.rules == {}
    tight = choose_plan(_step, state, batch, 2, memory_budget=_nbytes(state) // 2 + 1024, topology="gpu-nvlink-8")
    assert len(tight.rules) > len(small.rules)
    assert tight.chosen.state_bytes <= _nbytes(state) // 2 + 1024 < small.chosen.state_bytes


def test_a_budget_no_plan_meets_names_the_smallest_state_per_device():
    state, batch = _mlp()
    # The most any plan splits: both matrices and fc1's bias, with Adam's two moments of each; the rest whole.
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    split = sum(x.nbytes for path, x in leaves if re.search(r"fc1|fc2", jax.tree_util.keystr(path)))
    smallest = _nbytes(state) - split + split // 2
    with pytest.raises(TensorPlacementError, match=f"the smallest the search reached is {smallest} bytes"):
        choose_plan(_step, state, batch, 2, memory_budget=smallest - 1)
    assert choose_plan(_step, state, batch, 2, memory_budget=smallest).chosen.state_bytes == smallest


def test_tensor_parallel_auto_runs_as_the_hand_written_plan():
    state, batch = _mlp()
    tp = TensorParallel(_step, Auto(memory_budget=_nbytes(state) - 1), size=2)
    with pytest.raises(TensorPlacementError, match="needs the batch too"):
        tp.shard(state)
    new_state, loss = tp(tp.shard(state, batch), batch)
    want_state, want_loss = jax.jit(_step)(state, batch)
    assert tp.plan.chosen.rules == MEGATRON
    assert tp.placements(state, batch) == TensorParallel(_step, MEGATRON, size=2).placements(state, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert TensorParallel(_step, "auto", size=2).plan == Auto()


def test_the_gpt_within_a_tenth_of_the_hand_written_plans_bytes_and_equal_to_one_device():
    state, batch = gpt_tensor.initial_state(), gpt_tensor.synthetic_batch(0)
    hand = TensorParallel(gpt_tensor.one_device_step, gpt_tensor.PLAN, size=2).placements(state, batch)
    # Given the memory the hand-written plan holds per device, the fewest bytes over 'tensor'.
    budget = sum(
        x.nbytes // 2 if p.__class__.__name__ == "Shard" else x.nbytes
        for x, p in zip(jax.tree.leaves(state), hand.values(), strict=True)
    )

    def tensor_bytes(repl):
        report = repl.explain(gpt_tensor.train_step, batch, state)
        return sum(sent_bytes(c, 2) for c in report.tensor.collectives)

    auto = rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=2, tensor_plan="auto", memory_budget=budget))
    hand_bytes = tensor_bytes(rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=2, tensor_plan=gpt_tensor.PLAN)))
    auto_bytes = tensor_bytes(auto)
    chosen = auto.tensor.plan.chosen
    assert chosen.chosen.state_bytes <= budget and chosen.rules
    assert auto_bytes <= 1.1 * hand_bytes, (auto_bytes, hand_bytes, chosen.rules)

    got, want = state, state
    for i in range(2):
        got, _ = auto.run(gpt_tensor.train_step, gpt_tensor.synthetic_batch(i), got)
        want, _ = jax.jit(gpt_tensor.one_device_step)(want, gpt_tensor.synthetic_batch(i))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b), initial=0.0) <= 1e-5 * max(1.0, np.max(np.abs(b), initial=0.0))


def test_a_looked_up_table_split_on_its_rows_is_explained_as_vocabulary_rows():
    def step(p, ids):
        h = jnp.tanh(p["embed"][ids] @ p["w"])
        loss, g = jax.value_and_grad(lambda q: jnp.mean((q["embed"][ids] @ q["w"] - h) ** 2 + q["w"][0, 0]))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    p = {"embed": jnp.ones((64, 8)), "w": jnp.ones((8, 8))}
    ids = jnp.arange(16) % 64
    chosen = choose_plan(step, p, ids, size=2, memory_budget=(64 * 8 // 2 + 8 * 8) * 4)
    assert chosen.rules["embed"] == "row"
    assert "embed (1 x (64, 8)) vocabulary rows, chosen" in str(chosen)


def test_parallelism_checks_the_budget_with_the_plan():
    assert rp.Parallelism(tensor=2, tensor_plan="auto", memory_budget=1 << 20).tensor_plan == Auto(1 << 20)
    with pytest.raises(ValueError, match="hand-written plan does not use one"):
        rp.Parallelism(tensor=2, tensor_plan=MEGATRON, memory_budget=1 << 20)
    with pytest.raises(ValueError, match="give tensor=T"):
        rp.Parallelism(memory_budget=1 << 20)
    with pytest.raises(ValueError, match="positive int"):
        rp.Parallelism(tensor=2, tensor_plan="auto", memory_budget=0)


def test_suggest_layout_chooses_the_fewest_bytes_among_the_layouts_that_fit():
    state, batch = _mlp()
    total = _nbytes(state)
    layout = suggest_layout(_step, state, batch, 8, total // 4)
    assert layout.choice is not None and layout.choice.state_bytes <= total // 4
    fitting = [o for o in layout.options if o.fits]
    assert layout.choice.sent_bytes == min(o.sent_bytes for o in fitting)
    assert all(not (o.stages == 1 and o.tensor == 1 and o.zero == 0) for o in fitting)  # whole state: too big
    assert "choice: S =" in str(layout)
    none = suggest_layout(_step, state, batch, 2, 16)
    assert none.choice is None and "none fits" in str(none)


def test_suggest_layouts_estimates_are_zeros_formulas_and_a_stage_boundarys_bytes():
    """Each option's bytes from the whole state's: parameters P and optimizer state O over S stages; ZeRO-1
    divides O by D, ZeRO-2 the gradient too, ZeRO-3 P as well; a boundary is sent only with stages; no
    ZeRO option where there is one data replica (nothing to shard over)."""
    state, batch = _mlp()
    params, opt = _nbytes(state[0]), _nbytes(state[1])
    layout = suggest_layout(_step, state, batch, 8, 1 << 40)
    by = {(o.stages, o.tensor, o.zero): o for o in layout.options}
    for (s, t, z), o in by.items():
        assert o.data == 8 // (s * t) and o.fits
        assert not (z and o.data == 1), o  # ZeRO over one replica is not an option
        if t == 1:
            p, q = params / s, opt / s
            assert o.state_bytes == pytest.approx(p / (o.data if z >= 3 else 1) + q / (o.data if z >= 1 else 1))
            assert o.gradient_bytes == pytest.approx(p / (o.data if z >= 2 else 1))
        assert (o.stage_bytes > 0) == (s > 1), o
    assert {(1, 1, 0), (1, 1, 1), (2, 1, 3), (8, 1, 0)} <= set(by)
    assert (8, 1, 1) not in by and (2, 4, 1) not in by


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 << 20, "3.0 MiB"), (5 << 40, "5120.0 GiB")],
)
def test_human_bytes(n, text):
    assert human(n) == text


def test_sequence_parallelism_is_kept_only_where_it_sends_no_more_bytes():
    from tests.tensor.test_sequence import X, _params
    from tests.tensor.test_sequence import _step as block_step

    params = _params()
    chosen = choose_plan(block_step, params, X, 2, memory_budget=_nbytes(params) // 2 + 1000, sequence_dim=1, passes=1)
    with_sp = [e for e in chosen.considered if e.sequence_parallel == 1 and e.placements == chosen.chosen.placements]
    assert len(with_sp) == 1 and with_sp[0].refused is None
    # The layer norms' backward scatters twice per norm (docs/guide/tensor.md): more bytes, so it stays off.
    assert with_sp[0].sent_bytes > chosen.chosen.sent_bytes
    assert chosen.sequence_parallel is None and "left off" in str(chosen)


def _overlapping(seconds_per_flop: float) -> Topology:
    """A topology whose devices compute while they send, at this matmul speed (a slow one hides every send)."""
    link = Link(1e-6, 1e-11)
    return Topology("overlapping", link, link, "test", compute=Compute(1e-12, seconds_per_flop), overlap=True)


def test_collective_matmul_is_chosen_where_the_topology_hides_its_sends():
    from tests.tensor.test_sequence import X, _params
    from tests.tensor.test_sequence import _step as block_step

    params = _params(blocks=1)
    # No budget: the least predicted step, on matmuls slow enough that splitting them all pays.
    rings = TensorParallel(block_step, Auto(topology=_overlapping(1e-6)), size=2, sequence_parallel=1)
    got, want = rings(rings.shard(params, X), X), jax.jit(block_step)(params, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    chosen = rings.plan.chosen
    assert chosen.collective_matmul and chosen.chosen.collective_matmul
    report = str(chosen)
    assert "collective matmul: on" in report and "tried and kept" in report and "overlaps sends" in report
    assert "collective_permute" in rings.lower(params, X).as_text()  # the rings' sends, in the program
    # Where a ppermute does not overlap a matmul (emulated CPU devices): the same plan, without rings.
    serial = dataclasses.replace(_overlapping(1e-6), overlap=False)
    plain = TensorParallel(block_step, Auto(topology=serial), size=2, sequence_parallel=1)
    assert "collective_permute" not in plain.lower(params, X).as_text()
    assert not plain.plan.chosen.collective_matmul and plain.plan.chosen.rules == chosen.rules
    assert "tried and left off" in str(plain.plan.chosen) and "does not overlap" in str(plain.plan.chosen)


def test_rings_are_not_tried_where_they_are_not_allowed_and_kept_where_asked_for():
    from tests.tensor.test_sequence import X, _params
    from tests.tensor.test_sequence import _step as block_step

    params = _params(blocks=1)
    closed = jax.make_jaxpr(block_step)(params, X)
    names = [*leaf_paths(params), BATCH]
    options = dict(num_state=len(names) - 1, size=2, sequence_parallel=1, allow_gather=False)
    auto = Auto(_nbytes(params) // 2 + 4096, topology=_overlapping(1e-6))
    _, _, rings = resolve_plan(auto, closed, names, **options, rings_allowed=False)  # inside pipeline stages
    assert not rings and "not allowed here" in str(auto.chosen)
    _, _, rings = resolve_plan(Auto(_nbytes(params) // 2 + 4096), closed, names, **options, collective_matmul=True)
    assert rings  # asked for: kept though the CPU topology predicts it slower


def test_a_rings_sends_hide_behind_its_matmul_only_where_the_topology_overlaps():
    cpu = get_topology("cpu-emulated")
    send = cpu.p2p_cores.alpha_s + 1024 / 4 * cpu.p2p_cores.beta_s_per_byte
    assert ring_matmul_time(1024, 4, 1e12, cpu) == pytest.approx(3 * send)  # after the matmul, whatever its size
    fast, slow = _overlapping(1e-18), _overlapping(1e-3)
    step_send = 1e-6 + 1024 / 4 * 1e-11
    assert ring_matmul_time(1024, 4, 8.0, fast) == pytest.approx(3 * step_send)  # the matmul too short to hide them
    assert ring_matmul_time(1024, 4, 8.0, slow) == 0.0  # each step's 2 ms of matmul hides its send
    assert ring_matmul_time(1024, 1, 8.0, slow) == 0.0
