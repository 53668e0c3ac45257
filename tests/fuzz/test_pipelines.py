"""The pipeline fuzzer's fixed-seed sample, and checks of its generator and comparison.

Each program is a random pipelined training step (``tests/fuzz/pipelines.py``) run by
``Replicator.run`` on a pipelined ``Replicator`` of 8 devices and compared, the whole
state and every step's loss, with ``jax.jit`` of the same step on one device. The quick
sample covers both stage counts, both schedules, recomputation, both micro-batch counts,
ZeRO 1-3, both layouts (stages within a worker, across workers) and a tensor axis under the stages
(with sequence parallelism, on a program on sequences); the rest of the variants are marked slow. The long run is ``python scripts/fuzz.py --pipelines --programs 500``.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np
import pytest

import replicator as rp

from . import pipelines
from .pipelines import (
    LAYERS,
    OPTIMIZERS,
    PIPE_VARIANTS,
    check,
    equal_in_float64,
    first_mismatch,
    mesh_of,
    random_pipe_spec,
    reference,
)

# (seed, variant, mesh): a different program each.
QUICK = [
    (1, "pipe-S2-M2-1f1b", (2, 4)),
    (2, "pipe-S2-M4-gpipe", (8, 1)),  # stages across workers
    (3, "pipe-S2-M4-gpipe-recompute", (1, 8)),
    (4, "pipe-S4-M4-1f1b", (4, 2)),  # stages across workers
    (5, "pipe-S4-M8-gpipe-recompute", (2, 4)),
    (6, "pipe-S4-M8-1f1b-zero1", (1, 8)),  # ZeRO on each stage's replicas, through run_pipelined
    (7, "pipe-S2-M4-gpipe-zero2", (2, 4)),
    (8, "pipe-S2-M2-gpipe-recompute-zero3", (1, 8)),
    (9, "pipe-S2-M4-1f1b-fold2", (8, 1)),  # 2 replicas per device, folded across workers
    (10, "pipe-S2-M4-1f1b-zero2-run", (2, 4)),  # ZeRO on the user's own step
    (13, "pipe-S2-M4-1f1b", (1, 8)),  # an unmarked scanned stack: the user's step keeps it as slices
    (16, "pipe-S4-M8-gpipe-recompute-zero3-run", (4, 2)),  # a stack as slices, the rest in ZeRO-3 chunks
    (17, "pipe-S4-M8-1f1b-fused", (2, 4)),  # a forward and a backward in one tick
    (27, "pipe-S2-M4-1f1b-fused-tensor2-sp", (1, 8)),  # stages x tensor, the sequence split between the blocks
]
SLOW = [
    (100 + i, name, pipelines.mesh_of(v, pipelines.mesh_for(100 + i, v.stages)))
    for i, (name, v) in enumerate(PIPE_VARIANTS.items())
    if name not in {q[1] for q in QUICK}
]


def _param(seed: int, variant: str, mesh: tuple[int, int], slow: bool = False):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(seed, variant, mesh, id=f"{seed}-{variant}-{mesh[0]}x{mesh[1]}", marks=marks)


@pytest.mark.parametrize(
    ("seed", "variant", "mesh"), [_param(*c) for c in QUICK] + [_param(*c, slow=True) for c in SLOW]
)
def test_random_pipelined_step_matches_one_device(seed, variant, mesh):
    v = PIPE_VARIANTS[variant]
    seen = collections.Counter()
    outcome = check(random_pipe_spec(seed, v.stages, v.sequence_parallel), v, mesh, seen=seen)
    assert outcome.ok, str(outcome)
    if (seed, variant) == (27, "pipe-S2-M4-1f1b-fused-tensor2-sp"):  # seq 4, width 8: T = 2 divides both
        assert seen[f"{variant} reduce-scatter"] == seen[f"{variant} all-gather"] == 1, seen


def test_every_variant_is_in_the_sample():
    assert {v for _, v, _ in QUICK + SLOW} == set(PIPE_VARIANTS)
    assert {(v.stages, v.microbatches) for v in PIPE_VARIANTS.values()} == {(2, 2), (2, 4), (4, 4), (4, 8)}


def test_the_generator_is_reproducible_and_covers_every_feature():
    assert random_pipe_spec(17, 4) == random_pipe_spec(17, 4)
    assert random_pipe_spec(17, 4) != random_pipe_spec(18, 4)
    specs = [random_pipe_spec(seed, s) for seed in range(200) for s in (2, 4)]
    assert all(len(spec.segments) == spec.stages for spec in specs)
    assert {k for spec in specs for seg in spec.segments for k in seg} == set(LAYERS)
    assert {spec.optimizer for spec in specs} == set(OPTIMIZERS)
    for flag in ("embed", "tied", "ids_cross", "bf16", "cross_entropy"):
        assert any(getattr(spec, flag) for spec in specs), flag
    assert {spec.tuple_at for spec in specs} >= {None, 0, 1, 2}
    assert {spec.free_at for spec in specs} >= {None, 0, 1, 2, 3}
    assert {spec.stack for spec in specs} == {0, 1, 2}
    assert all(spec.tuple_at is None and spec.used_segments == (0, spec.stages - 1) for spec in specs if spec.stack)
    assert [random_pipe_spec(s, stages).stack for s, stages in ((13, 2), (16, 4))] == [2, 1]  # the QUICK ones
    # On sequences (sequence parallelism): the same program, its length drawn apart.
    assert all(
        dataclasses.replace(random_pipe_spec(seed, s, seq=True), seq=0) == random_pipe_spec(seed, s)
        for seed in range(50)
        for s in (2, 4)
    )
    # The tensor plans name only leaves the program has (a pattern matching none is refused).
    for spec in specs:
        leaves = {"0/" + jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in _leaf_paths(spec)}
        assert set(pipelines.tensor_plan(spec, 2)) <= leaves, (spec.describe(), pipelines.tensor_plan(spec, 2))
    # The loss has S - 1 markers: jax.jit of it runs (the markers are the identity outside a pipeline).
    spec = random_pipe_spec(3, 4)
    _, losses = reference(spec)
    assert len(losses) == pipelines.STEPS and np.all(np.isfinite(losses))


def _leaf_paths(spec):
    return jax.tree_util.tree_flatten_with_path(pipelines.initial_params(spec))[0]


def test_a_gradient_off_by_ten_percent_is_caught(monkeypatch):
    # The comparison can fail: the replicated step's averaged gradients scaled by 1.1 (SGD: the update too).
    seed = next(s for s in range(100) if random_pipe_spec(s, 2).optimizer == "sgd")
    spec = random_pipe_spec(seed, 2)
    real = pipelines.make_step

    def scaled(spec, mean=rp.all_mean):
        return real(spec, mean=lambda x: jax.tree.map(lambda a: 1.1 * a, mean(x)))

    ref = reference(spec)
    sensitivity = {"order": pipelines.order_sensitivity(spec)}  # the real step's, as a mismatch would measure it
    monkeypatch.setattr(pipelines, "make_step", scaled)
    outcome = check(spec, PIPE_VARIANTS["pipe-S2-M2-1f1b"], (1, 8), ref, sensitivity)
    assert outcome.mismatch is not None and outcome.error is None, str(outcome)


def test_a_run_off_by_less_than_the_references_own_order_sensitivity_passes_and_a_larger_error_is_caught(
    monkeypatch,
):
    """The classifier, on a case built to be order-sensitive (not on how this CPU happens to round one seed):
    a run off the reference by 3e-3 on one element passes when the reference itself moves by 1e-3 there under
    another order of its sums (4 times that is allowed), and is recorded as order-sensitive, naming the leaf; the
    same error on another element, or 5e-3 on that one, is a mismatch; the widening is computed once per
    program."""
    spec = random_pipe_spec(9, 2)
    want = reference(spec)  # (state, losses); the state's first leaf is the parameters
    params = want[0][0]
    leaf, other = [k for k in params if isinstance(params[k], dict) and np.ndim(params[k].get("w")) == 2][:2]
    sensitivity = jax.tree.map(lambda a: np.zeros(np.shape(a)), want[0])
    sensitivity[0][leaf]["w"][0, 0] = 1e-3
    computed = []

    def order_sensitivity(s):
        computed.append(s.seed)
        return sensitivity, [0.0] * len(want[1])

    def off_by(name: str, by: float):
        got = jax.tree.map(np.copy, want[0])
        got[0][name]["w"][0, 0] += by
        return lambda *_: (got, list(want[1]))

    monkeypatch.setattr(pipelines, "order_sensitivity", order_sensitivity)
    variant, cache = PIPE_VARIANTS["pipe-S2-M2-1f1b"], {}
    monkeypatch.setattr(pipelines, "replicated", off_by(leaf, 3e-3))
    outcome = check(spec, variant, (1, 8), want, cache)
    assert outcome.ok and outcome.order_sensitive and f"['{leaf}']['w']" in outcome.order_sensitive, str(outcome)
    monkeypatch.setattr(pipelines, "replicated", off_by(leaf, 5e-3))
    outcome = check(spec, variant, (1, 8), want, cache)
    assert not outcome.ok and f"['{leaf}']['w']" in outcome.mismatch, str(outcome)
    monkeypatch.setattr(pipelines, "replicated", off_by(other, 3e-3))
    outcome = check(spec, variant, (1, 8), want, cache)
    assert not outcome.ok and f"['{other}']['w']" in outcome.mismatch, str(outcome)
    assert computed == [9]  # once for the program, however many variants compare with it
    monkeypatch.setattr(pipelines, "replicated", lambda *_: (want[0], list(want[1])))
    outcome = check(spec, variant, (1, 8), want, {})
    assert outcome.ok and outcome.order_sensitive is None, str(outcome)  # agreeing outright is not order-sensitive
    assert computed == [9]


def test_seed_340047_a_program_that_amplifies_rounding_passes():
    """Seed 340047 (S = 4, AdamW, a mean gradient that cancels to 2e-6 from parts of 4e-4): depending on how the
    machine rounds, the pipelines land within the base tolerance or up to 9e-4 from the reference on one
    element, where the reference itself moves by 1e-4 and more when its sums add in another order. Either way
    it passes (outright or as order-sensitive)."""
    outcome = check(random_pipe_spec(340047, 4), PIPE_VARIANTS["pipe-S4-M8-1f1b"], (1, 8))
    assert outcome.ok, str(outcome)


@pytest.mark.slow  # two processes of its own (12 s): on one JAX leg, as the long sample
def test_seed_700125_a_tensor_pipeline_beyond_its_float32_sensitivity_is_judged_again_in_float64():
    """Seed 700125 under pipe-S4-M8-gpipe-recompute-tensor2-sp (found by `scripts/fuzz.py --pipelines`): Adam at
    lr 0.05 over 3 steps, S = 4; in float32 the split pipeline lands 9.2e-4 from the reference on one weight,
    beyond the reference's own sensitivity to the order of its batch sums (the split matmuls add in an order
    that sensitivity does not reproduce). In float64 the two agree within 1e-9: rounding, not the rewrite. The
    judge is not vacuous: a run 1e-6 off in one leaf is told apart there."""
    variant = PIPE_VARIANTS["pipe-S4-M8-gpipe-recompute-tensor2-sp"]
    spec = random_pipe_spec(700125, 4, seq=True)
    mesh = mesh_of(variant, (1, 8))
    assert equal_in_float64(spec, variant.name, mesh) is None
    assert equal_in_float64(spec, variant.name, mesh, offset=1e-6) == "[0]['free'] differs in float64 too"
    assert not jax.config.jax_enable_x64  # this process never saw 64-bit mode


def test_seed_820035_a_gradient_summed_after_the_backward_is_not_computed_on_past_the_stage_cut():
    """Seed 820035 (found by `scripts/fuzz.py --pipelines` at 5b2b261): a tensor-split step whose parameter
    gradient is `add_any` of a partial sum and a replicated term, read as a partial sum by `rp.all_mean`.
    The folded sum was bound where it was first read, after the backward, and the pipeline's split refused
    the step (a `select_n` on the gradients before `rp.all_mean`); it is bound where `add_any` was."""
    variant = PIPE_VARIANTS["pipe-S2-M4-1f1b-fused-tensor2-sp"]
    outcome = check(random_pipe_spec(820035, 2, seq=True), variant, mesh_of(variant, (1, 8)))
    assert outcome.ok, str(outcome)


def test_first_mismatch_names_the_leaf_and_allows_the_tolerance():
    want = {"a": np.ones((2, 3), np.float32), "n": np.int32(3)}
    assert first_mismatch({"a": want["a"] + 1e-4, "n": np.int32(3)}, want) is None
    found = first_mismatch({"a": want["a"] + np.array([[0, 0, 1e-3], [0, 0, 0]], np.float32), "n": np.int32(3)}, want)
    assert found is not None and "['a']" in found and "(0, 2)" in found, found
    assert "['n']" in first_mismatch({"a": want["a"], "n": np.int32(4)}, want)


def test_run_program_counts_one_run_per_variant():
    stats = collections.Counter()
    outcomes = pipelines.run_program(9, ["pipe-S2-M2-1f1b"], stats=stats)
    assert [o.ok for o in outcomes] == [True], [str(o) for o in outcomes]
    assert stats["runs"] == 1


def test_other_passes_on_a_pipelined_replicator_are_refused():
    """A pipelined step runs the schedule's loop, not the pass manager: options other than ZeRO's would be
    silently ignored, so they are refused, saying why."""
    for passes in (rp.PassManager.default(compress=True), rp.PassManager.default(zero=1, hierarchical=True)):
        refused = r"takes rp\.PassManager\.default\(zero=k\) only.*drop parallelism=rp\.Parallelism\(stages=\.\.\.\)"
        with pytest.raises(ValueError, match=refused):
            rp.Replicator(
                1, 8, devices=jax.devices()[:8], passes=passes, parallelism=rp.Parallelism(stages=2, microbatches=2)
            )
    repl = rp.Replicator(
        1,
        8,
        passes=rp.PassManager.default(zero=2, shard_optimizer_min_bytes=0),
        parallelism=rp.Parallelism(stages=2, microbatches=2),
    )
    assert repl.pipelined.zero_stage == 2
