"""Replica-invariance analysis and the check-replica-invariance pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import custom_batching, lax
from utils import assert_identical_where_claimed, custom_vmap_call_primitive

import replicator as rp
from replicator.analysis.invariance import RULES, VarianceAnalysis, rule_for
from replicator.passes import PassManager, analyze_invariance, check_invariance

THIS_FILE = __file__.rsplit("/", 1)[-1]


def _batch(n):
    return {"x": np.ones((2 * n, 3), np.float32)}


def _output_variance(repl, fn, state=None):
    lowered = repl.lower(fn, _batch(repl.num_replicas), state)
    info = analyze_invariance(lowered.traced)
    return info.output_variance[lowered.traced.num_state :]


BOTH = frozenset({"workers", "cores"})


class TestAnalysis:
    def test_batch_varies_collectives_make_invariant(self, repl2d):
        outs = _output_variance(
            repl2d,
            lambda b: (
                b["x"],
                rp.all_mean(b["x"]),
                rp.all_sum(b["x"], group="cores"),
                rp.all_max(b["x"], group="workers"),
                rp.all_gather(b["x"]),
                rp.broadcast(b["x"]),
                rp.replica_id(),
                rp.replica_id(group="cores"),
                rp.reduce_scatter(jnp.ones((repl2d.num_replicas, 3)) * rp.all_sum(b["x"]).sum()),
                jnp.float32(rp.num_replicas()),
            ),
        )
        assert outs == (
            BOTH,
            frozenset(),
            frozenset({"workers"}),
            frozenset({"cores"}),
            frozenset(),
            frozenset(),
            BOTH,
            frozenset({"cores"}),
            BOTH,
            frozenset(),
        )

    def test_state_is_invariant_and_mixing_with_batch_varies(self, repl):
        state = {"w": jnp.zeros(3)}
        lowered = repl.lower(
            lambda s, b: (s, {"a": s["w"] * 2, "b": s["w"] * b["x"]}), _batch(repl.num_replicas), state
        )
        info = analyze_invariance(lowered.traced)
        assert info.output_variance == (frozenset(), frozenset(), frozenset({"cores"}))

    def test_size_one_axes_cannot_vary(self, repl):
        # One worker: a collective over 'cores' alone already covers every replica.
        (out,) = _output_variance(repl, lambda b: rp.all_sum(b["x"], group="cores"))
        assert out == frozenset()

    def test_scan_carry_reaches_fixpoint(self, repl):
        def fn(b):
            def body(carry, x):
                a, c = carry
                return (c, x), None  # variance flows from x into c into a over two steps

            (a, c), _ = lax.scan(body, (jnp.zeros(3), jnp.zeros(3)), b["x"])
            return a, rp.all_sum(a)

        assert _output_variance(repl, fn) == (frozenset({"cores"}), frozenset())

    def test_cond_on_varying_predicate_makes_outputs_vary(self, repl):
        (out,) = _output_variance(repl, lambda b: lax.cond(b["x"][0, 0] > 0, lambda: 1.0, lambda: 2.0))
        assert out == frozenset({"cores"})


class TestDivergentControlFlow:
    def test_collective_under_batch_dependent_cond_is_rejected(self, repl):
        def step(b):
            return lax.cond(b["x"].sum() > 0, lambda: rp.all_sum(b["x"]), lambda: b["x"])

        with pytest.raises(rp.DivergentControlFlowError) as err:
            repl.lower(step, _batch(repl.num_replicas))
        msg = str(err.value)
        assert "all_sum" in msg and "lax.cond" in msg and THIS_FILE in msg and "Fix:" in msg

    def test_collective_under_replica_id_while_is_rejected(self, repl):
        def step(b):
            body = lambda c: (c[0] + 1, rp.all_mean(c[1]))  # noqa: E731
            return lax.while_loop(lambda c: c[0] < rp.replica_id(), body, (0, b["x"]))[1]

        with pytest.raises(rp.DivergentControlFlowError, match="all_mean.*lax.while_loop"):
            repl.lower(step, _batch(repl.num_replicas))

    def test_collective_in_nested_jit_inside_cond_is_found(self, repl):
        inner = jax.jit(lambda x: rp.all_max(x))

        def step(b):
            return lax.cond(b["x"][0, 0] > 0, inner, lambda x: x, b["x"])

        with pytest.raises(rp.DivergentControlFlowError, match="all_max"):
            repl.lower(step, _batch(repl.num_replicas))

    def test_collective_passed_directly_as_a_branch_names_the_cond(self, repl):
        def step(b):
            return lax.cond(b["x"][0, 0] > 0, rp.all_mean, lambda x: x, b["x"])

        with pytest.raises(
            rp.DivergentControlFlowError,
            match=rf"all_mean at a branch or body of the lax.cond/switch is inside a lax.cond/switch at .*{THIS_FILE}",
        ):
            repl.lower(step, _batch(repl.num_replicas))

    def test_reduced_predicate_is_accepted(self, repl):
        def step(b):
            pred = rp.all_max(b["x"].sum()) > 0
            return pred, lax.cond(pred, lambda: rp.all_sum(b["x"]), lambda: b["x"])

        # The predicate is proven identical everywhere; one branch's result still varies.
        assert _output_variance(repl, step) == (frozenset(), frozenset({"cores"}))
        final = repl.lower(step, _batch(repl.num_replicas)).final
        assert rp.passes.count_primitives(final.jaxpr, ["cond", "pmax", "psum"]) == {"cond": 1, "pmax": 1, "psum": 1}

    def test_predicate_varying_across_workers_allows_collective_within_worker(self, repl2d):
        if repl2d.num_workers < 2:
            pytest.skip("needs two workers")

        def step(b):
            pred = rp.all_sum(b["x"].sum(), group="cores") > 0  # same within a worker
            return pred, lax.cond(pred, lambda: rp.all_sum(b["x"], group="cores"), lambda: b["x"])

        # The predicate varies along 'workers' only, so the 'cores' collective under it is accepted;
        # the cond's result varies along both (the other branch is batch data).
        assert _output_variance(repl2d, step) == (frozenset({"workers"}), BOTH)

        def bad(b):
            pred = rp.all_sum(b["x"].sum(), group="cores") > 0
            return lax.cond(pred, lambda: rp.all_sum(b["x"]), lambda: b["x"])

        with pytest.raises(rp.DivergentControlFlowError, match="workers"):
            repl2d.lower(bad, _batch(repl2d.num_replicas))

    def test_replica_id_alone_under_varying_cond_is_fine(self, repl):
        def step(b):
            return lax.cond(b["x"][0, 0] > 0, lambda: (rp.replica_id(), 1), lambda: (0, 2))

        # replica_id is no collective (nothing waits for another replica): accepted. Both results
        # vary: replica_id does, and which constant a replica returns depends on its batch.
        assert _output_variance(repl, step) == (frozenset({"cores"}), frozenset({"cores"}))
        final = repl.lower(step, _batch(repl.num_replicas)).final
        assert rp.passes.count_primitives(final.jaxpr, ["cond", "axis_index"])["cond"] == 1


class TestDivergentState:
    def test_unaveraged_gradient_update_is_rejected_naming_the_leaf(self, repl):
        def step(s, b):
            g = jax.grad(lambda w: jnp.sum(b["x"] @ w))(s["w"])
            return {"w": s["w"] - g, "step": s["step"] + 1}, {}

        state = {"step": jnp.int32(0), "w": jnp.zeros(3)}
        with pytest.raises(rp.DivergentStateError) as err:
            repl.lower(step, _batch(repl.num_replicas), state)
        msg = str(err.value)
        assert "state['w']" in msg and "all_mean" in msg and THIS_FILE in msg

    def test_averaged_gradient_update_is_accepted(self, repl):
        def step(s, b):
            g = jax.grad(lambda w: jnp.sum(b["x"] @ w))(s["w"])
            return {"w": s["w"] - rp.all_mean(g)}, {"per_replica": g}

        lowered = repl.lower(step, _batch(repl.num_replicas), {"w": jnp.zeros(3)})
        # The new w is proven identical on every replica; the raw gradient output is not.
        assert analyze_invariance(lowered.traced).output_variance == (frozenset(), frozenset({"cores"}))

    def test_disabling_the_check_lets_the_step_through(self, n_devices):
        step = lambda s, b: (s + b["x"].sum(), {})  # noqa: E731 - the state would drift apart
        with pytest.raises(rp.DivergentStateError):
            rp.Replicator(1, n_devices).lower(step, _batch(n_devices), jnp.float32(0))
        r = rp.Replicator(1, n_devices, passes=PassManager(disable=["check-replica-invariance"]))
        lowered = r.lower(step, _batch(n_devices), jnp.float32(0))
        assert "check-replica-invariance" not in [s.name for s in lowered.snapshots]
        assert analyze_invariance(lowered.traced).output_variance == (frozenset({"cores"}),)


# ----------------------------------------------------------------------------
# The analysis against a run: what it calls identical along an axis must be
# ----------------------------------------------------------------------------

W_, C_ = "workers", "cores"
VARIES = BOTH
BY_CORE = frozenset({C_})  # identical along 'workers', varies along 'cores'
BY_WORKER = frozenset({W_})
SAME = frozenset()


def _mesh_2x4(n_devices):
    if n_devices < 8:
        pytest.skip("needs 8 devices for a 2x4 mesh")
    return 2, 4


def _run_and_check(workers, cores, step, state=None, rows=2, cols=4, passes=None, seed=0):
    """Run ``step`` once on per-replica-distinct data; check the analysis's claims on the outputs.

    Returns the analysis's variance of each output leaf (to pin it) and the per-replica outputs.
    """
    repl = rp.Replicator(workers, cores, passes=passes)

    def make(rng):
        return {
            "x": rng.normal(size=(rows * cores, cols)).astype(np.float32),
            "i": rng.integers(-5, 5, size=(rows * cores, cols)).astype(np.int32),
        }

    def input_fn(ctx):
        rng = np.random.default_rng((seed, ctx.worker_id))
        while True:
            yield make(rng)

    batch = make(np.random.default_rng((seed, 0)))
    lowered = repl.lower(step, batch, state)
    variance = analyze_invariance(lowered.traced).output_variance[lowered.traced.num_state :]
    result = repl.run(step, input_fn, state) if state is not None else repl.run(step, input_fn)
    outputs = rp.local_outputs(result[1] if state is not None else result)
    assert_identical_where_claimed(outputs, variance, workers, cores)
    return variance, outputs


def _varies_along(leaf, workers, cores, axis_name):
    rows = np.asarray(leaf).reshape(workers, cores, *np.shape(leaf)[1:])
    axis = 1 if axis_name == C_ else 0
    return not np.array_equal(rows, np.broadcast_to(np.take(rows, [0], axis=axis), rows.shape))


class TestClaimsHoldWhenRun:
    """For each kind of value, run the step on a 2x4 mesh and compare the claims with the outputs."""

    def test_state_reads_and_batch_features(self, n_devices):
        W, C = _mesh_2x4(n_devices)
        state = {"w": jnp.arange(4, dtype=jnp.float32), "k": jnp.int32(3)}

        def step(s, b):
            return s, {
                "w2": s["w"] * 2,
                "k": s["k"] + 1,
                "mixed": s["w"] * b["x"][0],
                "x": b["x"],
                "rows": jnp.sum(b["i"] > 0),
                "const": jnp.float32(rp.num_replicas()),
            }

        variance, outputs = _run_and_check(W, C, step, state)
        assert variance == (SAME, SAME, VARIES, VARIES, SAME, VARIES)  # const, k, mixed, rows, w2, x
        assert _varies_along(outputs["x"], W, C, W_) and _varies_along(outputs["x"], W, C, C_)

    def test_replica_id(self, n_devices):
        W, C = _mesh_2x4(n_devices)

        def step(b):
            return (
                rp.replica_id(),
                rp.replica_id(group="cores"),
                rp.replica_id(group="workers"),
                rp.replica_id(group="workers") * 10 + b["i"].sum() * 0,
            )

        variance, _ = _run_and_check(W, C, step)
        assert variance[:3] == (VARIES, BY_CORE, BY_WORKER)

    @pytest.mark.parametrize("op", ["all_sum", "all_mean", "all_max", "all_min"])
    def test_all_reduces_of_varying_values(self, n_devices, op):
        W, C = _mesh_2x4(n_devices)
        fn = getattr(rp, op)

        def step(b):
            x = b["x"] * (1 + rp.replica_id().astype(jnp.float32))  # varies everywhere, by more than the data
            return (
                fn(x),
                fn(x, group="cores"),
                fn(x, group="workers"),
                fn(b["i"] if op != "all_mean" else b["i"].astype(jnp.float32), group="cores"),
                fn(fn(x, group="cores"), group="workers"),
                fn(x, group="cores") + rp.replica_id(group="workers").astype(jnp.float32),
                fn(x, group="cores") + rp.replica_id(group="cores").astype(jnp.float32),
            )

        variance, outputs = _run_and_check(W, C, step)
        assert variance == (SAME, BY_WORKER, BY_CORE, BY_WORKER, SAME, BY_WORKER, VARIES)
        assert _varies_along(outputs[1], W, C, W_) and _varies_along(outputs[2], W, C, C_)

    def test_all_gather_reduce_scatter_and_broadcast(self, n_devices):
        W, C = _mesh_2x4(n_devices)

        def step(b):
            x = b["x"]  # (2, 4): reduce_scatter splits 8 rows or 4 columns
            tall = jnp.concatenate([x] * 4)  # (8, 4)
            return {
                "gather": rp.all_gather(x),
                "gather_cores": rp.all_gather(x, group="cores"),
                "gather_workers_tiled": rp.all_gather(x, axis=1, tiled=True, group="workers"),
                "scatter": rp.reduce_scatter(tall),
                "scatter_cores": rp.reduce_scatter(x, axis=1, group="cores"),
                "scatter_workers": rp.reduce_scatter(x, group="workers"),
                "scatter_of_same": rp.reduce_scatter(rp.all_gather(x), axis=0, group="cores"),
                "broadcast": rp.broadcast(x, source=3),
                "broadcast_workers": rp.broadcast(x, source=1, group="workers"),
                "broadcast_cores": rp.broadcast(x, source=2, group="cores"),
            }

        variance, outputs = _run_and_check(W, C, step)
        got = dict(zip(sorted(outputs), variance, strict=True))
        assert got["gather"] == got["broadcast"] == SAME
        assert got["gather_cores"] == got["broadcast_cores"] == BY_WORKER
        assert got["gather_workers_tiled"] == got["broadcast_workers"] == BY_CORE
        assert got["scatter"] == VARIES  # each replica keeps its own chunk

    @pytest.mark.parametrize("on", [1, 0])
    def test_cond_and_scan_with_collectives(self, n_devices, on):
        W, C = _mesh_2x4(n_devices)
        state = {"on": jnp.int32(on)}

        def step(s, b):
            x = b["x"]
            same_in_worker = rp.all_sum(x.sum(), group="cores") > 0  # varies across workers only
            by_worker = lax.cond(
                same_in_worker, lambda: rp.all_mean(x, group="cores"), lambda: rp.all_max(x, group="cores")
            )
            everywhere = lax.cond(s["on"] > 0, lambda: rp.all_sum(x), lambda: rp.all_min(x) * 2)

            def body(carry, row):
                return carry + rp.all_sum(row, group="workers"), rp.all_mean(row)

            carry, ys = lax.scan(body, jnp.zeros(x.shape[1]), x)
            local, _ = lax.scan(lambda c, row: (c + row, None), jnp.zeros(x.shape[1]), x)
            return s, (by_worker, everywhere, carry, ys, local)

        variance, _ = _run_and_check(W, C, step, state)
        assert variance == (BY_WORKER, SAME, BY_CORE, SAME, VARIES)

    @pytest.mark.parametrize(
        "options", [{}, {"all_reduce_algorithm": "ring"}, {"hierarchical": True}, {"compress": True}], ids=str
    )
    def test_claims_hold_under_optional_passes(self, n_devices, options):
        """The same claims on what the optional passes and algorithms compute (on the graph before them)."""
        W, C = _mesh_2x4(n_devices)

        def step(b):
            x = b["x"] * (1 + rp.replica_id().astype(jnp.float32))
            return rp.all_sum(x), rp.all_mean(x, group="cores"), rp.all_sum(x * 3, group="workers"), x

        passes = rp.PassManager.default(verify=True, **options)
        variance, _ = _run_and_check(W, C, step, passes=passes)
        assert variance == (SAME, BY_WORKER, BY_CORE, VARIES)

    def test_the_check_catches_a_wrong_claim(self):
        """The helper is not vacuous: a leaf that differs along 'cores' fails a claim that it does not."""
        rows = np.arange(8, dtype=np.float32).reshape(8, 1) // 4  # 2x4 mesh: differs by worker only
        assert_identical_where_claimed([rows], [BY_WORKER], 2, 4)
        with pytest.raises(AssertionError, match="called identical along 'workers'"):
            assert_identical_where_claimed([rows], [SAME], 2, 4)
        with pytest.raises(AssertionError, match="called identical along 'cores'"):
            assert_identical_where_claimed([np.arange(8.0)], [BY_WORKER], 2, 4)


class TestLibraryFrames:
    """Which frames :func:`user_code_line` skips as library code, wherever the library is installed."""

    @pytest.mark.parametrize(
        "file_name",
        [
            "/usr/lib/python3/dist-packages/flax/linen/normalization.py",  # Debian's system packages
            "/opt/conda/lib/python3.11/site-packages/optax/_src/transform.py",  # another environment's
            "<frozen importlib._bootstrap>",
        ],
    )
    def test_installed_packages_outside_this_environment_are_libraries(self, file_name):
        assert check_invariance._is_library(file_name)

    def test_user_files_are_not(self):
        assert not check_invariance._is_library("/home/u/project/train.py")


class TestMeshCollectiveRules:
    """The rules for JAX's own psum / all_gather over the mesh axes, as lowered graphs hold them."""

    @pytest.mark.parametrize(
        "collective, expected",
        [
            (lambda x: lax.psum(x, ("workers", "cores")), SAME),
            (lambda x: lax.psum(x, "cores"), BY_WORKER),
            (lambda x: lax.pmax(x, "workers"), BY_CORE),
            (lambda x: lax.all_gather(x, "workers"), BY_CORE),
        ],
    )
    def test_a_reduction_removes_the_variance_along_its_axes(self, collective, expected):
        sizes = {"workers": 2, "cores": 4}
        (eqn,) = jax.make_jaxpr(collective, axis_env=list(sizes.items()))(jnp.ones(3)).jaxpr.eqns
        analysis = VarianceAnalysis(sizes)
        assert rule_for(eqn.primitive)(analysis, eqn, [VARIES]) == [expected]
        assert rule_for(eqn.primitive)(analysis, eqn, [SAME]) == [SAME]

    def test_the_result_is_immutable(self, repl):
        info = analyze_invariance(repl.lower(lambda b: rp.all_sum(b["x"]), _batch(repl.num_replicas)).traced)
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.output_variance = ()  # type: ignore[misc]


@custom_batching.custom_vmap
def _mean_then_max(x):
    return rp.all_max(rp.all_mean(x))


@_mean_then_max.def_vmap
def _mean_then_max_vmap(axis_size, in_batched, x):
    del axis_size
    return rp.all_max(rp.all_mean(x)), in_batched[0]


class TestRulesEdgeCases:
    def test_an_unknown_primitive_is_named_with_its_first_collective(self, repl, monkeypatch):
        """The error names the first collective inside (all_mean), with its own parameters (not all_max's)."""
        monkeypatch.delitem(RULES, custom_vmap_call_primitive())
        batch = {"x": np.ones((repl.num_replicas, 1), np.float32)}
        with pytest.raises(rp.UnanalyzableStepError, match=r"^all_mean at .*custom_vmap_call.*no rule") as e:
            repl.lower(lambda w, b: (w + _mean_then_max(b["x"].sum()), {}), batch, jnp.float32(0))
        assert "all_max" not in str(e.value)

    def test_while_loop_body_constants_are_not_carry(self, repl):
        """A while loop whose body (not its condition) closes over values: the carry starts after both consts."""

        def step(b):
            x = b["x"]  # varies
            s = jnp.sum(rp.all_sum(x))  # identical on every replica
            count, same, varying = lax.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + s, c[2] + x), (0, jnp.zeros(()), jnp.zeros_like(x))
            )
            return count, same, varying

        count, same, varying = _output_variance(repl, step)
        assert (count, same, varying) == (SAME, SAME, frozenset({"cores"}))  # one worker: only 'cores' is live
