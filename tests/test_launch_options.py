"""The launcher's options in one object (replicator/launch/options.py): one set of defaults, one set of checks.

``launch()``, ``run_host()`` and the command line share :class:`LaunchOptions`: its
defaults are the command line's, every check of a value is made when it is built, and
the functions' old keywords still work, overriding the ``options=`` object's fields.
No worker starts here: the supervision loop is replaced by one that records what it
was given.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from replicator.launch import LaunchError, LaunchOptions, cli, hosts, launch
from replicator.launch.membership import Assignment
from replicator.launch.options import FROM_OPTIONS, merge, option_flag
from replicator.launch.restarts import Outcome

supervise_module = importlib.import_module("replicator.launch.supervise")

TOY = str(Path(__file__).resolve().parent / "multiproc" / "toy_worker.py")
FIELDS = [f.name for f in dataclasses.fields(LaunchOptions)]
#: The fields launch() and run_host() do not take as keywords: run_host reads the rendezvous's timing from its
#: Rendezvous (made with LaunchOptions.rendezvous_timing()); min_workers and failure_window_s are local jobs'.
NOT_KEYWORDS = {
    "launch": {"rdzv_heartbeat_s", "rdzv_last_call_s", "rdzv_join_timeout_s", "rdzv_rejoin_timeout_s"},
    "run_host": {"rdzv_heartbeat_s", "rdzv_last_call_s", "rdzv_join_timeout_s", "rdzv_rejoin_timeout_s"}
    | {"min_workers", "failure_window_s"},
}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "REPLICATOR_"))}


# -- one set of defaults -----------------------------------------------------------------------------------------


def test_the_command_line_with_no_option_is_launch_options_defaults():
    args, _ = cli.parse([TOY])
    assert args.options == LaunchOptions()
    args, _ = cli.parse(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", TOY])
    assert args.options == LaunchOptions()


def test_every_field_is_an_option_whose_default_is_the_fields():
    parser = cli._parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(LaunchOptions):
        assert option_flag(f.name) in flags, f.name
        assert parser.get_default(cli._dest(f.name)) == f.default, f.name


def test_the_command_line_options_become_the_fields():
    args, _ = cli.parse(
        ["--max-restarts", "2", "--kill-grace", "1.5", "--step-timeout", "0", "--show-runtime-logs",
         "--log-dir", "/tmp/x", "--cores-per-worker", "4", "--num-workers", "2", TOY]
    )  # fmt: skip
    assert args.options == LaunchOptions(
        max_restarts=2,
        kill_grace_s=1.5,
        step_timeout_s=0.0,
        show_runtime_logs=True,
        log_dir="/tmp/x",
        cores_per_worker=4,
    )


@pytest.mark.parametrize("function", [launch, hosts.run_host], ids=["launch", "run_host"])
def test_the_functions_keywords_are_the_fields_defaulting_to_the_options(function):
    """Each option keyword of launch() and run_host() is a field, left to ``options`` unless given."""
    parameters = inspect.signature(function).parameters
    keywords = {name for name, p in parameters.items() if p.default is FROM_OPTIONS}
    assert keywords == set(FIELDS) - NOT_KEYWORDS[function.__name__]
    assert parameters["options"].default is None


def test_cli_help_still_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = LaunchOptions()
    for phrase in (
        f"seconds workers wait for all to join (default {defaults.start_timeout_s:g})",
        f"(default {defaults.kill_grace_s:g})",
        f"(default {defaults.step_timeout_s:g}; 0: off)",
        f"with MIN:MAX: seconds a round with MIN hosts waits for more (default {defaults.rdzv_last_call_s:g})",
        f"seconds a launcher waits for the others to join a round (default {defaults.rdzv_join_timeout_s:g})",
    ):
        assert phrase in text, phrase


# -- the old keywords and options= -------------------------------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """launch() and run_host() with the workers' start and their supervision replaced by a record of what they got."""
    seen: dict = {}

    def start_all(workers, plan, command, base, settings, *rest):
        seen["settings"] = settings
        seen["show_runtime_logs"] = rest[-1]

    def supervise(workers, output, **kwargs):
        seen["supervise"] = kwargs
        return Outcome(0)

    for module in (supervise_module, hosts):
        monkeypatch.setattr(module, "_start_all", start_all)
        monkeypatch.setattr(module, "supervise", supervise)
    return seen


def _launch(**kwargs) -> int:
    return launch(
        [sys.executable, TOY], num_workers=2, env=clean_env(), stdout=io.StringIO(), stderr=io.StringIO(), **kwargs
    )


def _what(seen: dict) -> dict:
    s, k = seen["settings"], seen["supervise"]
    return {
        "cores_per_worker": s["cores_per_worker"],
        "start_timeout_s": s["start_timeout_s"],
        "heartbeat_timeout_s": s["heartbeat_timeout_s"],
        "shutdown_timeout_s": s["shutdown_timeout_s"],
        "max_restarts": s["max_restarts"],
        "kill_grace_s": k["kill_grace_s"],
        "finish_timeout_s": k["finish_timeout_s"],
        "max_time_s": k["max_time_s"],
        "step_timeout_s": k["step_timeout_s"],
        "compile_timeout_s": k["compile_timeout_s"],
        "show_runtime_logs": seen["show_runtime_logs"],
    }


CHANGED = {
    "cores_per_worker": 3,
    "start_timeout_s": 7.0,
    "heartbeat_timeout_s": 4.0,
    "shutdown_timeout_s": 6.0,
    "kill_grace_s": 0.5,
    "max_time_s": 99.0,
    "step_timeout_s": 0.0,
    "compile_timeout_s": 30.0,
    "max_restarts": 2,
    "show_runtime_logs": True,
}
EXPECTED = {**CHANGED, "finish_timeout_s": 2 * 6.0 + 0.5}


def test_launch_takes_the_old_keywords_or_options_alike(recorded):
    assert _launch(**CHANGED) == 0
    by_keywords = _what(recorded)
    assert _launch(options=LaunchOptions(**CHANGED)) == 0
    assert _what(recorded) == by_keywords == EXPECTED


def test_launch_defaults_are_launch_options_defaults(recorded):
    assert _launch() == 0
    defaults = _what(recorded)
    assert _launch(options=LaunchOptions()) == 0
    assert _what(recorded) == defaults
    d = LaunchOptions()
    assert (defaults["kill_grace_s"], defaults["step_timeout_s"], defaults["max_restarts"]) == (
        d.kill_grace_s,
        d.step_timeout_s,
        d.max_restarts,
    )


def test_a_keyword_given_overrides_the_options_field(recorded):
    options = LaunchOptions(**CHANGED)
    assert _launch(options=options, kill_grace_s=2.0, max_time_s=None) == 0
    assert _what(recorded) == {**EXPECTED, "kill_grace_s": 2.0, "max_time_s": None, "finish_timeout_s": 14.0}


def test_a_keyword_is_checked_as_the_field_would_be():
    with pytest.raises(LaunchError, match="--kill-grace must be >= 0 seconds, got -1"):
        _launch(options=LaunchOptions(kill_grace_s=1.0), kill_grace_s=-1)


class _OneRound:
    """A started rendezvous of one host, one round: what run_host reads of it here."""

    heartbeat_interval_s, gone_after_s, detection_bound_s, rejoin_timeout_s = 1.0, 5.0, 6.0, 60.0

    def join(self, stop=None) -> Assignment:
        return Assignment(0, 0, 1, ("me",), ("127.0.0.1",), "127.0.0.1:1")


def test_run_host_takes_the_old_keywords_or_options_alike(recorded, monkeypatch):
    monkeypatch.setattr(hosts, "_finished", lambda rdzv, watch, output, finish_timeout_s: Outcome(0))
    monkeypatch.setattr(hosts, "_next", lambda rdzv, a, watch, outcome, output, max_restarts: 0)
    quiet = {"env": clean_env(), "stdout": io.StringIO(), "stderr": io.StringIO()}
    assert hosts.run_host([sys.executable, TOY], _OneRound(), **CHANGED, **quiet) == 0
    by_keywords = _what(recorded)
    assert hosts.run_host([sys.executable, TOY], _OneRound(), options=LaunchOptions(**CHANGED), **quiet) == 0
    assert _what(recorded) == by_keywords == EXPECTED
    options = LaunchOptions(**CHANGED)
    assert hosts.run_host([sys.executable, TOY], _OneRound(), options=options, max_restarts=0, **quiet) == 0
    assert _what(recorded) == {**EXPECTED, "max_restarts": 0}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kill_grace_s": -1}, "--kill-grace must be >= 0 seconds, got -1"),
        ({"options": LaunchOptions(min_workers=1)}, r"--min-workers 1 does not go with a job across hosts.*MIN:MAX"),
        ({"nproc_per_host": 0}, "--nproc-per-node must be an int >= 1, got 0"),
        ({"options": {"max_restarts": 1}}, r"options= takes a LaunchOptions\(...\), got dict"),
    ],
)
def test_run_host_refuses_bad_options_before_joining(kwargs, message):
    with pytest.raises(LaunchError, match=message):
        hosts.run_host([sys.executable, TOY], None, **kwargs)  # type: ignore[arg-type]


def test_replace_and_merge():
    options = LaunchOptions(max_restarts=3)
    assert dataclasses.replace(options, kill_grace_s=1.0) == LaunchOptions(max_restarts=3, kill_grace_s=1.0)
    assert merge(options, max_restarts=FROM_OPTIONS) is options
    assert merge(None) == LaunchOptions()
    assert merge(options, max_restarts=0) == LaunchOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_restarts = 4  # type: ignore[misc]
    with pytest.raises(LaunchError, match="--max-restarts must be a non-negative int"):
        dataclasses.replace(options, max_restarts=-1)


def test_rendezvous_timing_is_the_rendezvous_keywords():
    from replicator.launch.membership import Rendezvous

    options = LaunchOptions(rdzv_heartbeat_s=0.5, rdzv_last_call_s=0.0, rdzv_join_timeout_s=30.0)
    r = Rendezvous("127.0.0.1:9", min_hosts=1, **options.rendezvous_timing())
    assert (r.heartbeat_interval_s, r.last_call_s, r.join_timeout_s, r.rejoin_timeout_s) == (0.5, 0.0, 30.0, 15.0)
    r = Rendezvous("127.0.0.1:9", min_hosts=1, **LaunchOptions(rdzv_rejoin_timeout_s=5.0).rendezvous_timing())
    assert r.rejoin_timeout_s == 5.0


# -- one set of checks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"cores_per_worker": 0}, r"--cores-per-worker must be a positive int, got 0\."),
        ({"cores_per_worker": 2.0}, r"--cores-per-worker must be a positive int, got 2\.0"),
        ({"start_timeout_s": 0}, r"--start-timeout must be a positive number of seconds, got 0\."),
        ({"heartbeat_timeout_s": -1.0}, r"--heartbeat-timeout must be a positive number of seconds, got -1\.0"),
        ({"shutdown_timeout_s": math.nan}, r"--shutdown-timeout must be a positive number of seconds, got nan"),
        ({"compile_timeout_s": 0}, r"--compile-timeout must be a positive number of seconds, got 0\."),
        ({"kill_grace_s": -0.5}, r"--kill-grace must be >= 0 seconds, got -0\.5"),
        ({"max_time_s": 0}, r"--max-time must be a positive number of seconds, got 0\."),
        ({"step_timeout_s": -1}, r"--step-timeout must be >= 0 seconds \(0: no watchdog\), got -1"),
        ({"start_timeout_s": "10"}, r"--start-timeout must be a positive number of seconds, got '10'"),
        ({"max_restarts": -1}, r"--max-restarts must be a non-negative int \(0: no restarts\), got -1"),
        ({"max_restarts": True}, r"--max-restarts must be a non-negative int \(0: no restarts\), got True"),
        ({"min_workers": 0}, r"--min-workers must be a positive int, got 0\."),
        ({"failure_window_s": 0}, r"--failure-window must be a positive number of seconds, got 0\."),
        ({"rdzv_heartbeat_s": 0}, r"--rdzv-heartbeat must be a positive number of seconds, got 0\."),
        ({"rdzv_join_timeout_s": -5}, r"--rdzv-join-timeout must be a positive number of seconds, got -5"),
        ({"rdzv_last_call_s": -0.5}, r"--rdzv-last-call must be >= 0 seconds, got -0\.5"),
        (
            {"rdzv_join_timeout_s": 30, "rdzv_rejoin_timeout_s": 30},
            r"--rdzv-rejoin-timeout 30: give a number of seconds >= 0 and below --rdzv-join-timeout \(30\)",
        ),
        ({"rdzv_rejoin_timeout_s": -1}, r"--rdzv-rejoin-timeout -1: give a number of seconds >= 0 and below"),
        ({"show_runtime_logs": "yes"}, r"--show-runtime-logs is True or False, got 'yes'"),
    ],
)
def test_each_bad_value_is_refused_naming_the_flag_and_what_it_must_be(fields, message):
    with pytest.raises(LaunchError, match=message):
        LaunchOptions(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"kill_grace_s": 0},
        {"step_timeout_s": 0},
        {"step_timeout_s": None},
        {"max_time_s": 0.5},
        {"rdzv_last_call_s": 0},
        {"rdzv_rejoin_timeout_s": 0},
        {"min_workers": 1, "max_restarts": 1},
        {"cores_per_worker": 1},
        {"start_timeout_s": np.float32(3.0), "max_restarts": np.int64(2)},  # NumPy's numbers too
    ],
)
def test_the_edges_that_are_allowed(fields):
    assert dataclasses.asdict(LaunchOptions(**fields)).items() >= fields.items()


def test_a_bad_value_on_the_command_line_exits_2_before_any_worker(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(["--num-workers", "2", "--failure-window", "0", TOY])
    assert e.value.code == 2
    assert "--failure-window must be a positive number of seconds, got 0.0" in capsys.readouterr().err
