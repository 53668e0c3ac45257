"""PassManager: order, snapshots, dumps, disabling, verification, failures, the options of PassManager.default."""

import inspect
import subprocess
import sys

import numpy as np
import pytest
from jax.extend.core import Var

import replicator as rp
from replicator.pass_manager.manager import DUMP_ENV
from replicator.passes import Pass, PassManager, PassResult, default_passes

#: Every pass of the default pass manager with every option on, in its order.
EVERY_PASS = [
    "capture-collectives",
    "check-replica-invariance",
    "simplify",
    "shard-optimizer-update",
    "fuse-collectives",
    "share-slice-kernels",
    "compress-communication",
    "hierarchical-allreduce",
    "lower-collectives",
]


def _batch(n):
    return {"x": np.ones((n, 2), np.float32)}


def _step(b):
    return rp.all_mean(b["x"])


class Boom(Pass):
    name = "boom"

    def run(self, graph):
        raise ZeroDivisionError("kaboom")


class Identity(Pass):
    name = "identity"

    def run(self, graph):
        return PassResult(graph, False)


def test_default_pipeline_order():
    assert PassManager().names == [p.name for p in default_passes()]
    assert PassManager().names == [
        "capture-collectives",
        "check-replica-invariance",
        "simplify",
        "fuse-collectives",
        "share-slice-kernels",
        "lower-collectives",
    ]
    everything = PassManager.default(
        hierarchical=True, compress=True, all_reduce_algorithm="ring", shard_optimizer=True
    )
    assert everything.names == EVERY_PASS
    assert everything.key() != PassManager().key()
    assert "ring" in repr(everything.passes[-1])


class TestDefaultOptions:
    """``PassManager.default`` says what it takes: an explicit signature, and unknown options named with the closest."""

    def test_the_signature_lists_every_option_of_default_passes_with_its_type_and_default(self):
        ours = inspect.signature(PassManager.default).parameters
        theirs = inspect.signature(default_passes).parameters
        assert not [p for p in ours.values() if p.kind is p.VAR_KEYWORD], "no **options: help() shows every option"
        assert all(p.kind is p.KEYWORD_ONLY and p.annotation is not p.empty for p in ours.values())
        for name, p in theirs.items():
            assert name in ours, f"PassManager.default lacks default_passes' option {name!r}"
            assert ours[name].default == p.default, (name, ours[name].default, p.default)
            assert ours[name].annotation == p.annotation, name
        assert {"auto", "topology", "disable", "verify", "validate", "dump_dir"} <= set(ours)
        doc = PassManager.default.__doc__
        assert all(f"  {name}: " in doc for name in ours), "every option has a line under Args"

    def test_every_option_reaches_default_passes(self):
        options = dict(
            zero=2,
            shard_optimizer_min_bytes=123,
            hierarchical=True,
            compress=True,
            all_reduce_algorithm="ring",
            fuse_threshold_bytes=4096,
            fuse_max_tensor_bytes=None,
        )
        expected = [repr(p) for p in default_passes(**options)]
        assert [repr(p) for p in PassManager.default(**options).passes] == expected
        assert [repr(p) for p in PassManager.default().passes] == [repr(p) for p in default_passes()]
        stage1 = PassManager.default(shard_optimizer=True).passes[3]
        assert (stage1.name, stage1.stage) == ("shard-optimizer-update", 1)

    @pytest.mark.parametrize(
        "make", [PassManager.default, default_passes], ids=["PassManager.default", "default_passes"]
    )
    def test_an_unknown_option_names_the_closest_and_lists_the_valid_ones(self, make):
        with pytest.raises(TypeError) as err:
            make(hierarchy=True)
        message = str(err.value)
        assert "unknown option 'hierarchy'; did you mean 'hierarchical'? Valid options: " in message, message
        valid = inspect.signature(make).parameters
        listed = message.split("Valid options: ")[1].rstrip(".").split(", ")
        assert sorted(listed) == sorted(valid), message
        with pytest.raises(
            TypeError, match=r"unknown options 'hierarchal' \(did you mean 'hierarchical'\?\), 'xyzzy'\."
        ):
            make(hierarchal=True, xyzzy=1)

    def test_auto_keeps_options_left_at_their_defaults_and_fixes_the_others(self):
        pipe = PassManager.default(auto=True, zero=2, compress=True)
        assert pipe.options == {"zero": 2, "compress": True}
        with pytest.raises(ValueError, match=r"chooses \['hierarchical'\] itself"):
            PassManager.default(auto=True, hierarchical=True)


def test_lowered_prints_every_snapshot(repl):
    lowered = repl.lower(_step, _batch(repl.num_replicas))
    text = str(lowered)
    positions = [text.index(f"after {name}") for name in PassManager().names]
    assert text.index("traced") < positions[0] and positions == sorted(positions)
    assert "rp.all_reduce" in str(lowered.traced) and "psum" in str(lowered.final)
    assert [s.name for s in lowered.snapshots] == ["traced", *PassManager().names]
    # all_mean of batch data: nothing to simplify, fuse or share; lowering changes it.
    assert [s.changed for s in lowered.snapshots] == [False] * (len(lowered.snapshots) - 1) + [True]
    with pytest.raises(KeyError, match="no pass named 'nope'"):
        lowered.after("nope")


def test_dump_dir_argument_and_environment(tmp_path, monkeypatch, n_devices):
    explicit = tmp_path / "explicit"
    repl = rp.Replicator(1, n_devices, passes=PassManager(dump_dir=explicit))
    repl.lower(_step, _batch(n_devices))
    files = sorted(p.name for p in explicit.iterdir())
    names = PassManager().names
    assert files == sorted(f"{i:02d}-{name}.{when}.txt" for i, name in enumerate(names) for when in ("before", "after"))
    last = f"{names.index('lower-collectives'):02d}-lower-collectives"
    assert "rp.all_reduce" in (explicit / f"{last}.before.txt").read_text()
    assert "psum" in (explicit / f"{last}.after.txt").read_text()

    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "env"))
    rp.Replicator(1, n_devices).lower(_step, _batch(n_devices))
    assert len(list((tmp_path / "env").iterdir())) == 2 * len(names)


def test_disable_by_name_and_unknown_names(n_devices):
    repl = rp.Replicator(1, n_devices, passes=PassManager(disable=["check-replica-invariance"]))
    lowered = repl.lower(_step, _batch(n_devices))
    assert [s.name for s in lowered.snapshots] == [
        "traced",
        *[n for n in PassManager().names if n != "check-replica-invariance"],
    ]
    with pytest.raises(ValueError, match=r"no pass named \['fuse'\]"):
        PassManager(disable=["fuse"])


def test_failure_names_the_pass_and_those_before(n_devices):
    passes = [*default_passes()[:2], Identity(), Boom(), *default_passes()[2:]]
    repl = rp.Replicator(1, n_devices, passes=PassManager(passes))
    with pytest.raises(
        rp.PassError,
        match=r"pass 'boom' failed after passes \['capture-collectives', 'check-replica-invariance', 'identity'\]",
    ):
        repl.lower(_step, _batch(n_devices))


def test_verify_runs_between_passes(n_devices):
    class BreakTypes(Pass):
        name = "break-types"

        def run(self, graph):
            jaxpr = graph.jaxpr.jaxpr
            undefined = Var(jaxpr.outvars[0].aval)  # used but never defined
            broken = jaxpr.replace(outvars=[undefined, *jaxpr.outvars[1:]])
            return PassResult(graph.with_jaxpr(type(graph.jaxpr)(broken, graph.jaxpr.consts)), True)

    repl = rp.Replicator(1, n_devices, passes=PassManager([BreakTypes(), *default_passes()], verify=True))
    with pytest.raises(rp.PassError, match="break-types"):
        repl.lower(lambda b: b["x"] * 2, _batch(n_devices))
    ok = rp.Replicator(1, n_devices, passes=PassManager(verify=True))
    ok.lower(_step, _batch(n_devices))


def test_user_errors_pass_through_with_a_note(repl):
    def bad(s, b):
        return s + b["x"].sum(), {}

    with pytest.raises(rp.DivergentStateError) as err:
        repl.lower(bad, _batch(repl.num_replicas), np.float32(0))
    assert any("check-replica-invariance" in note for note in err.value.__notes__)


def test_pipeline_rejects_non_passes():
    with pytest.raises(TypeError, match="not a replicator.passes.Pass"):
        PassManager([object()])


class TestOrder:
    """The pipeline rejects an order in which a pass would silently do nothing."""

    def test_a_placeholder_pass_after_lowering_is_rejected_naming_both(self):
        from replicator.passes import FuseCollectives, LowerCollectives

        with pytest.raises(ValueError, match="'fuse-collectives' works on placeholders.*after 'lower-collectives'"):
            PassManager([LowerCollectives(), FuseCollectives()])

    def test_fusion_before_zero_is_rejected_naming_both(self):
        from replicator.passes import FuseCollectives, LowerCollectives, ShardOptimizerUpdate

        with pytest.raises(ValueError, match="'fuse-collectives' must run after 'shard-optimizer-update'"):
            PassManager([FuseCollectives(), ShardOptimizerUpdate(), LowerCollectives()])

    def test_capture_after_a_library_pass_is_rejected_naming_both(self):
        from replicator.passes import CaptureCollectives, LowerCollectives, Simplify

        with pytest.raises(ValueError, match="'capture-collectives' must come before.*comes after 'simplify'"):
            PassManager([Simplify(), CaptureCollectives(), LowerCollectives()])
        assert PassManager([CaptureCollectives(), Simplify()]).names == ["capture-collectives", "simplify"]

    def test_a_pass_for_lowered_graphs_may_follow_lowering(self):
        from replicator.passes import LowerCollectives

        class CountCollectives(Pass):
            name = "count-collectives"
            needs_placeholders = False

            def run(self, graph):
                return PassResult(graph, False)

        assert PassManager([LowerCollectives(), CountCollectives()]).names == ["lower-collectives", "count-collectives"]

    @pytest.mark.parametrize("zero", [False, True])
    @pytest.mark.parametrize("hierarchical", [False, True])
    @pytest.mark.parametrize("compress", [False, True])
    def test_every_default_combination_is_in_order_and_its_reverse_is_rejected(self, zero, hierarchical, compress):
        off = {"shard-optimizer-update": not zero, "compress-communication": not compress}
        off["hierarchical-allreduce"] = not hierarchical
        pipe = PassManager.default(shard_optimizer=zero, hierarchical=hierarchical, compress=compress)
        assert pipe.names == [name for name in EVERY_PASS if not off.get(name, False)]
        # The same passes in reverse break the declared order: the check names the first pass that
        # lands after the lowering, and the lowering.
        backwards = list(reversed(pipe.passes))
        assert backwards[0].name == "lower-collectives"
        first = backwards[1]
        if first.needs_placeholders:
            expected = f"PassManager: pass '{first.name}' works on placeholders but comes after 'lower-collectives'"
        else:  # share-slice-kernels works on either graph, but it comes before fuse-collectives now
            expected = f"PassManager: pass '{first.name}' must run after 'fuse-collectives'"
        with pytest.raises(ValueError) as err:
            PassManager(backwards)
        assert str(err.value).startswith(expected), err.value


def test_names_that_moved_out_of_rp_passes_still_resolve_with_a_warning():
    import replicator.cost
    import replicator.tools

    for name, home in (
        ("calibrate", replicator.tools),
        ("Topology", replicator.cost),
        ("bisect_passes", replicator.tools),
    ):
        with pytest.warns(DeprecationWarning, match=f"replicator.passes.{name} moved"):
            assert getattr(rp.passes, name) is getattr(home, name)
    with pytest.raises(AttributeError):
        rp.passes.no_such_name  # noqa: B018


class TestOldSpellings:
    """The names before "pipeline" meant pipeline parallelism only: each still works, warns
    ``DeprecationWarning`` naming the new one (at the caller's line), and does what the new one does."""

    def test_rp_pipeline_is_the_pass_manager(self):
        for module, old in ((rp, "Pipeline"), (rp.passes, "Pipeline"), (rp.cost, "AutoPipeline")):
            with pytest.warns(DeprecationWarning, match=r"is now .*(PassManager|AutoPassManager)") as caught:
                value = getattr(module, old)
            assert caught[0].filename == __file__
            assert value is (rp.cost.AutoPassManager if old == "AutoPipeline" else rp.PassManager)

    def test_the_old_modules_re_export_the_new_ones(self):
        from replicator.pass_manager import contract, manager, verify

        with pytest.warns(DeprecationWarning, match=r"replicator\.pipeline\.Pipeline is now .*manager\.PassManager"):
            from replicator.pipeline import Pipeline
        with pytest.warns(DeprecationWarning, match=r"replicator\.pipeline\.pipeline\.Lowered is now"):
            from replicator.pipeline.pipeline import Lowered
        with pytest.warns(DeprecationWarning, match=r"replicator\.pipeline\.contract\.Pass is now"):
            from replicator.pipeline.contract import Pass
        with pytest.warns(DeprecationWarning, match=r"replicator\.pipeline\.verify\.verify_graph is now") as caught:
            from replicator.pipeline.verify import verify_graph
        assert caught[0].filename == __file__ and len(caught) == 1  # one warning per name taken
        assert (Pipeline, Lowered) == (manager.PassManager, manager.Lowered)
        assert (Pass, verify_graph) == (contract.Pass, verify.verify_graph)

    def test_stage_is_pass_snapshot_and_lowered_stages_is_snapshots(self, repl):
        """The graph after a pass was a ``Stage``, in ``Lowered.stages``: a stage is now a pipeline stage only."""
        from replicator.pass_manager import manager

        for module in (manager, rp.passes):
            name = module.__name__.replace(".", r"\.")
            with pytest.warns(DeprecationWarning, match=rf"{name}\.Stage is now {name}\.PassSnapshot") as caught:
                assert module.Stage is manager.PassSnapshot
            assert caught[0].filename == __file__ and len(caught) == 1
        with pytest.warns(DeprecationWarning, match=r"replicator\.passes\.Stage is now") as caught:
            from replicator.passes import Stage
        assert Stage is manager.PassSnapshot and len(caught) == 1  # one warning per name taken
        with pytest.warns(
            DeprecationWarning, match=r"pipeline\.pipeline\.Stage is now .*manager\.PassSnapshot"
        ) as caught:
            from replicator.pipeline.pipeline import Stage
        assert Stage is manager.PassSnapshot and len(caught) == 1
        assert "Stage" not in manager.__all__ + rp.passes.__all__  # `import *` takes the new names, silently
        lowered = repl.lower(_step, _batch(repl.num_replicas))
        with pytest.warns(DeprecationWarning, match=r"Lowered\.stages is now Lowered\.snapshots") as caught:
            assert lowered.stages == lowered.snapshots
        assert caught[0].filename == __file__
        assert [s.name for s in lowered.snapshots][:2] == ["traced", "capture-collectives"]
        with pytest.raises(AttributeError, match="no attribute 'Stages'"):
            manager.Stages  # noqa: B018

    @pytest.mark.parametrize(
        "make", [PassManager.default, default_passes], ids=["PassManager.default", "default_passes"]
    )
    def test_zero_stage_is_zero(self, make):
        def key(passes):
            return [repr(p) for p in (passes.passes if isinstance(passes, PassManager) else passes)]

        for k in (0, 1, 3):
            with pytest.warns(DeprecationWarning, match=r"\(zero_stage=\.\.\.\) is now .*\(zero=\.\.\.\)") as caught:
                old = make(zero_stage=k, shard_optimizer_min_bytes=0)
            assert caught[0].filename == __file__
            assert key(old) == key(make(zero=k, shard_optimizer_min_bytes=0))
        with pytest.raises(TypeError, match=r"zero_stage= is the old name of zero=; give zero= only"):
            make(zero=1, zero_stage=1)

    def test_replicator_pipeline_is_replicator_passes(self, n_devices):
        repl = rp.Replicator(1, n_devices)
        with pytest.warns(DeprecationWarning, match=r"Replicator\.pipeline is now Replicator\.passes"):
            assert repl.pipeline is repl.passes
        other = PassManager(disable=["fuse-collectives"])
        with pytest.warns(DeprecationWarning, match=r"Replicator\.pipeline is now Replicator\.passes"):
            repl.pipeline = other
        assert repl.passes is other

    def test_the_package_itself_uses_no_old_spelling(self):
        """Importing replicator, and a pipelined Replicator with ZeRO (whose front checks passes= against
        PassManager.default(zero=k)), warn nothing: the warnings are for users' code."""
        code = (
            "import replicator as rp; rp.force_cpu_devices(8); "
            "rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=2, microbatches=2), "
            "passes=rp.PassManager.default(zero=1))"
        )
        done = subprocess.run(
            [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
