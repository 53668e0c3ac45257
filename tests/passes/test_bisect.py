"""bisect_passes and ``python -m replicator.tools.bisect`` name the first optional pass that changes a result."""

import argparse
import os
import re

import jax
import numpy as np
import pytest
from utils import check_against_simulation, small_inputs, small_step, wrong_pipeline

import replicator as rp
from replicator.bisect import build_parser, main, passes_from_args
from replicator.passes import PassManager
from replicator.tools.bisect import bisect_passes

from .workloads import input_fn_from, mlp_batch, mlp_params, mlp_step

UTILS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "utils.py")


def test_bisect_names_the_first_pass_that_changes_the_result(n_devices):
    repl = rp.Replicator(1, n_devices, passes=wrong_pipeline())
    batch, state = small_inputs(n_devices)
    report = bisect_passes(repl, small_step, batch, state)
    assert report.culprit == "double-first-all-sum"
    assert report.passes == ("simplify", "double-first-all-sum", "fuse-collectives", "share-slice-kernels")
    assert "double-first-all-sum" in str(report) and "outputs['total']" in str(report)
    assert "disable=['double-first-all-sum']" in str(report)
    assert bisect_passes(rp.Replicator(1, n_devices), small_step, batch, state).culprit is None


def test_bisect_takes_an_input_fn_specs_and_every_optional_pass(repl2d):
    """The first batch of each worker (or random data for specs); all optional passes on: none changes the MLP."""
    pipe = PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0, hierarchical=True, compress=True)
    repl = rp.Replicator(repl2d.num_workers, repl2d.cores_per_worker, passes=pipe)
    state = mlp_params(np.random.default_rng(0))
    report = bisect_passes(repl, mlp_step, input_fn_from(mlp_batch(repl.cores_per_worker)), state)
    assert report.culprit is None, str(report)
    assert report.passes == (
        "simplify",
        "shard-optimizer-update",
        "fuse-collectives",
        "share-slice-kernels",
        "compress-communication",
        "hierarchical-allreduce",
    )
    specs = {"x": jax.ShapeDtypeStruct((2 * repl.cores_per_worker, 3), np.float32)}  # random rows
    wrong = rp.Replicator(repl2d.num_workers, repl2d.cores_per_worker, passes=wrong_pipeline())
    report = bisect_passes(wrong, small_step, specs, {"w": np.ones((3, 2), np.float32)})
    assert report.culprit == "double-first-all-sum"


def test_command_line(n_devices, capsys):
    module = UTILS
    common = [f"--batch={module}:cli_batch", f"--state={module}:cli_state", f"--cores={n_devices}"]
    assert main([f"{module}:small_step", *common, f"--passes={module}:wrong_pipeline"]) == 1
    out = capsys.readouterr().out
    assert "first pass that changes the result: 'double-first-all-sum'" in out and "outputs['total']" in out
    assert main([f"{module}:small_step", *common, "--hierarchical"]) == 0
    assert "gives the reference result" in capsys.readouterr().out


def test_every_flag_of_the_command_line_is_explained():
    parser = build_parser()
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert [a.dest for a in flags if not a.help] == [], "flags without help"
    text = parser.format_help()
    for action in flags:
        assert (action.option_strings or [action.metavar])[0] in text
    assert "--zero {0,1,2,3}" in text


def _zero(argv):
    parser = build_parser()
    passes = passes_from_args(parser, parser.parse_args(["m:step", "--batch=m:b", *argv]))
    zero = [p for p in passes.passes if p.name == "shard-optimizer-update"]
    return zero[0].stage if zero else 0


def test_zero_and_shard_optimizer_set_the_zero_level():
    assert [_zero(["--zero", str(k)]) for k in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert _zero(["--shard-optimizer"]) == 1
    assert _zero([]) == 0


def test_the_old_flags_still_work_with_a_note(capsys):
    """``--zero-stage`` and ``--pipeline`` are the old spellings of ``--zero`` and ``--passes``."""
    assert [_zero(["--zero-stage", str(k)]) for k in (0, 3)] == [0, 3]
    assert "--zero-stage is now --zero" in capsys.readouterr().err
    args = build_parser().parse_args(["m:step", "--batch=m:b", "--pipeline=m:p"])
    assert args.passes == "m:p" and "--pipeline is now --passes" in capsys.readouterr().err
    with pytest.warns(DeprecationWarning, match="pipeline_from_args is now replicator.bisect.passes_from_args"):
        from replicator.bisect import pipeline_from_args
    assert pipeline_from_args is passes_from_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--zero", "2", "--shard-optimizer"], "not allowed with argument"),
        (["--zero", "4"], "invalid choice: '?4'?"),  # Python 3.12+ quotes the value
        (
            ["--passes=m:p", "--zero", "1", "--compress"],
            "--passes replaces PassManager.default.*--zero --compress",
        ),
    ],
)
def test_contradicting_flags_are_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["m:step", "--batch=m:b", *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_command_line_with_zero_bisects_the_zero_pass(n_devices, capsys):
    common = [f"--batch={UTILS}:cli_batch", f"--state={UTILS}:cli_state", f"--cores={n_devices}"]
    assert main([f"{UTILS}:small_step", *common, "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "gives the reference result" in out and "shard-optimizer-update" in out, out


def test_the_vmap_reference_used_by_the_pass_tests_catches_the_wrong_pass(repl2d):
    """tests.utils.check_against_simulation (the pass tests' reference) passes the default pass manager
    and fails the pass manager with the wrong pass: it is independent of what it checks."""
    W, C = repl2d.num_workers, repl2d.cores_per_worker
    x = np.random.default_rng(3).normal(size=(2 * W * C, 3)).astype(np.float32)
    state = small_inputs(1)[1]
    check_against_simulation(rp.Replicator(W, C), small_step, [{"x": x}], state)
    with pytest.raises(AssertionError, match="total"):
        check_against_simulation(rp.Replicator(W, C, passes=wrong_pipeline()), small_step, [{"x": x}], state)
