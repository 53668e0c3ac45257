"""Pipeline: order, stages, dumps, disabling, verification, failures, the options of Pipeline.default."""

import inspect

import numpy as np
import pytest
from jax.extend.core import Var

import replicator as rp
from replicator.passes import Pass, PassResult, Pipeline, default_passes
from replicator.pipeline.pipeline import DUMP_ENV

#: Every pass of the default pipeline with every option on, in its order.
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
    assert Pipeline().names == [p.name for p in default_passes()]
    assert Pipeline().names == [
        "capture-collectives",
        "check-replica-invariance",
        "simplify",
        "fuse-collectives",
        "share-slice-kernels",
        "lower-collectives",
    ]
    everything = Pipeline.default(hierarchical=True, compress=True, all_reduce_algorithm="ring", shard_optimizer=True)
    assert everything.names == EVERY_PASS
    assert everything.key() != Pipeline().key()
    assert "ring" in repr(everything.passes[-1])


class TestDefaultOptions:
    """``Pipeline.default`` says what it takes: an explicit signature, and unknown options named with the closest."""

    def test_the_signature_lists_every_option_of_default_passes_with_its_type_and_default(self):
        ours = inspect.signature(Pipeline.default).parameters
        theirs = inspect.signature(default_passes).parameters
        assert not [p for p in ours.values() if p.kind is p.VAR_KEYWORD], "no **options: help() shows every option"
        assert all(p.kind is p.KEYWORD_ONLY and p.annotation is not p.empty for p in ours.values())
        for name, p in theirs.items():
            assert name in ours, f"Pipeline.default lacks default_passes' option {name!r}"
            assert ours[name].default == p.default, (name, ours[name].default, p.default)
            assert ours[name].annotation == p.annotation, name
        assert {"auto", "topology", "disable", "verify", "validate", "dump_dir"} <= set(ours)
        doc = Pipeline.default.__doc__
        assert all(f"  {name}: " in doc for name in ours), "every option has a line under Args"

    def test_every_option_reaches_default_passes(self):
        options = dict(
            zero_stage=2,
            shard_optimizer_min_bytes=123,
            hierarchical=True,
            compress=True,
            all_reduce_algorithm="ring",
            fuse_threshold_bytes=4096,
            fuse_max_tensor_bytes=None,
        )
        expected = [repr(p) for p in default_passes(**options)]
        assert [repr(p) for p in Pipeline.default(**options).passes] == expected
        assert [repr(p) for p in Pipeline.default().passes] == [repr(p) for p in default_passes()]
        stage1 = Pipeline.default(shard_optimizer=True).passes[3]
        assert (stage1.name, stage1.stage) == ("shard-optimizer-update", 1)

    @pytest.mark.parametrize("make", [Pipeline.default, default_passes], ids=["Pipeline.default", "default_passes"])
    def test_an_unknown_option_names_the_closest_and_lists_the_valid_ones(self, make):
        with pytest.raises(TypeError) as err:
            make(zero=3)
        message = str(err.value)
        assert "unknown option 'zero'; did you mean 'zero_stage'? Valid options: " in message, message
        valid = inspect.signature(make).parameters
        listed = message.split("Valid options: ")[1].rstrip(".").split(", ")
        assert sorted(listed) == sorted(valid), message
        with pytest.raises(
            TypeError, match=r"unknown options 'hierarchal' \(did you mean 'hierarchical'\?\), 'xyzzy'\."
        ):
            make(hierarchal=True, xyzzy=1)

    def test_auto_keeps_options_left_at_their_defaults_and_fixes_the_others(self):
        pipe = Pipeline.default(auto=True, zero_stage=2, compress=True)
        assert pipe.options == {"zero_stage": 2, "compress": True}
        with pytest.raises(ValueError, match=r"chooses \['hierarchical'\] itself"):
            Pipeline.default(auto=True, hierarchical=True)


def test_lowered_prints_every_stage(repl):
    lowered = repl.lower(_step, _batch(repl.num_replicas))
    text = str(lowered)
    positions = [text.index(f"after {name}") for name in Pipeline().names]
    assert text.index("traced") < positions[0] and positions == sorted(positions)
    assert "rp.all_reduce" in str(lowered.traced) and "psum" in str(lowered.final)
    assert [s.name for s in lowered.stages] == ["traced", *Pipeline().names]
    # all_mean of batch data: nothing to simplify, fuse or share; lowering changes it.
    assert [s.changed for s in lowered.stages] == [False] * (len(lowered.stages) - 1) + [True]
    with pytest.raises(KeyError, match="no pass named 'nope'"):
        lowered.after("nope")


def test_dump_dir_argument_and_environment(tmp_path, monkeypatch, n_devices):
    explicit = tmp_path / "explicit"
    repl = rp.Replicator(1, n_devices, passes=Pipeline(dump_dir=explicit))
    repl.lower(_step, _batch(n_devices))
    files = sorted(p.name for p in explicit.iterdir())
    names = Pipeline().names
    assert files == sorted(f"{i:02d}-{name}.{when}.txt" for i, name in enumerate(names) for when in ("before", "after"))
    last = f"{names.index('lower-collectives'):02d}-lower-collectives"
    assert "rp.all_reduce" in (explicit / f"{last}.before.txt").read_text()
    assert "psum" in (explicit / f"{last}.after.txt").read_text()

    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "env"))
    rp.Replicator(1, n_devices).lower(_step, _batch(n_devices))
    assert len(list((tmp_path / "env").iterdir())) == 2 * len(names)


def test_disable_by_name_and_unknown_names(n_devices):
    repl = rp.Replicator(1, n_devices, passes=Pipeline(disable=["check-replica-invariance"]))
    lowered = repl.lower(_step, _batch(n_devices))
    assert [s.name for s in lowered.stages] == [
        "traced",
        *[n for n in Pipeline().names if n != "check-replica-invariance"],
    ]
    with pytest.raises(ValueError, match=r"no pass named \['fuse'\]"):
        Pipeline(disable=["fuse"])


def test_failure_names_the_pass_and_those_before(n_devices):
    passes = [*default_passes()[:2], Identity(), Boom(), *default_passes()[2:]]
    repl = rp.Replicator(1, n_devices, passes=Pipeline(passes))
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

    repl = rp.Replicator(1, n_devices, passes=Pipeline([BreakTypes(), *default_passes()], verify=True))
    with pytest.raises(rp.PassError, match="break-types"):
        repl.lower(lambda b: b["x"] * 2, _batch(n_devices))
    ok = rp.Replicator(1, n_devices, passes=Pipeline(verify=True))
    ok.lower(_step, _batch(n_devices))


def test_user_errors_pass_through_with_a_note(repl):
    def bad(s, b):
        return s + b["x"].sum(), {}

    with pytest.raises(rp.DivergentStateError) as err:
        repl.lower(bad, _batch(repl.num_replicas), np.float32(0))
    assert any("check-replica-invariance" in note for note in err.value.__notes__)


def test_pipeline_rejects_non_passes():
    with pytest.raises(TypeError, match="not a replicator.passes.Pass"):
        Pipeline([object()])


class TestOrder:
    """The pipeline rejects an order in which a pass would silently do nothing."""

    def test_a_placeholder_pass_after_lowering_is_rejected_naming_both(self):
        from replicator.passes import FuseCollectives, LowerCollectives

        with pytest.raises(ValueError, match="'fuse-collectives' works on placeholders.*after 'lower-collectives'"):
            Pipeline([LowerCollectives(), FuseCollectives()])

    def test_fusion_before_zero_is_rejected_naming_both(self):
        from replicator.passes import FuseCollectives, LowerCollectives, ShardOptimizerUpdate

        with pytest.raises(ValueError, match="'fuse-collectives' must run after 'shard-optimizer-update'"):
            Pipeline([FuseCollectives(), ShardOptimizerUpdate(), LowerCollectives()])

    def test_capture_after_a_library_pass_is_rejected_naming_both(self):
        from replicator.passes import CaptureCollectives, LowerCollectives, Simplify

        with pytest.raises(ValueError, match="'capture-collectives' must come before.*comes after 'simplify'"):
            Pipeline([Simplify(), CaptureCollectives(), LowerCollectives()])
        assert Pipeline([CaptureCollectives(), Simplify()]).names == ["capture-collectives", "simplify"]

    def test_a_pass_for_lowered_graphs_may_follow_lowering(self):
        from replicator.passes import LowerCollectives

        class CountCollectives(Pass):
            name = "count-collectives"
            needs_placeholders = False

            def run(self, graph):
                return PassResult(graph, False)

        assert Pipeline([LowerCollectives(), CountCollectives()]).names == ["lower-collectives", "count-collectives"]

    @pytest.mark.parametrize("zero", [False, True])
    @pytest.mark.parametrize("hierarchical", [False, True])
    @pytest.mark.parametrize("compress", [False, True])
    def test_every_default_combination_is_in_order_and_its_reverse_is_rejected(self, zero, hierarchical, compress):
        off = {"shard-optimizer-update": not zero, "compress-communication": not compress}
        off["hierarchical-allreduce"] = not hierarchical
        pipe = Pipeline.default(shard_optimizer=zero, hierarchical=hierarchical, compress=compress)
        assert pipe.names == [name for name in EVERY_PASS if not off.get(name, False)]
        # The same passes in reverse break the declared order: the check names the first pass that
        # lands after the lowering, and the lowering.
        backwards = list(reversed(pipe.passes))
        assert backwards[0].name == "lower-collectives"
        first = backwards[1]
        if first.needs_placeholders:
            expected = f"Pipeline: pass '{first.name}' works on placeholders but comes after 'lower-collectives'"
        else:  # share-slice-kernels works on either graph, but it comes before fuse-collectives now
            expected = f"Pipeline: pass '{first.name}' must run after 'fuse-collectives'"
        with pytest.raises(ValueError) as err:
            Pipeline(backwards)
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
