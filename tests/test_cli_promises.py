"""The promises of replicator/launch/cli.py that no other test checks (its docstring lists them all).

The command line is parsed here, and :func:`~replicator.launch.cli.main` runs with a stand-in for the job:
no worker starts.
"""

from __future__ import annotations

import os
import signal

import hypothesis
import hypothesis.strategies as st
import pytest

from replicator.launch import cli
from replicator.launch.environment import LaunchError

_OPTIONS = [
    ["--num-workers", "2"],
    ["--num_workers", "2"],
    ["--cores-per-worker=4"],
    ["--kill-grace", "1"],
    ["--max-restarts", "3"],
    ["--show-runtime-logs"],
    ["--nproc-per-node", "2"],
]
_ARGS = st.lists(st.one_of(st.sampled_from(["--num-workers", "-m", "--", "-", "x.py", "--max_restarts=2"]), st.text()))


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    options=st.lists(st.sampled_from(_OPTIONS), max_size=4),
    script=st.from_regex(r"[a-z_/]{1,12}\.py", fullmatch=True),
    args=_ARGS,
    dash_dash=st.booleans(),
)
def test_whatever_follows_the_script_or_dash_dash_is_the_workers_verbatim(options, script, args, dash_dash):
    """The launcher's options end at the script (or ``--``, or ``-m MODULE``); what follows, even what looks
    like a launcher option, is the worker's command line as given."""
    flat = [x for option in options for x in option]
    said = [x.replace("--num_workers", "--num-workers") for x in flat]  # underscores read as dashes
    head = [*flat, "--"] if dash_dash else flat
    assert cli._split_argv([*head, script, *args], cli._parser()) == (said, [script, *args])
    assert cli._split_argv([*flat, "-m", "pkg.train", *args], cli._parser()) == ([*said, "-m", "pkg.train"], args)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('never run here')\n")
    return str(path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_becomes_stopping_the_job_and_the_handlers_are_restored(monkeypatch, script, signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = {}

    def job(command, *, interrupted, **kwargs):
        os.kill(os.getpid(), signum)  # delivered to the main thread: main()'s handler runs, nothing dies
        seen["interrupted"], seen["signum"] = interrupted.is_set(), getattr(interrupted, "signum", None)
        return 128 + signum

    monkeypatch.setattr(cli, "launch", job)
    assert cli.main(["--num-workers", "2", script]) == 128 + signum
    assert seen == {"interrupted": True, "signum": signum}
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_bad_setting_found_by_the_job_is_a_usage_error(monkeypatch, script, capsys):
    def job(command, **kwargs):
        raise LaunchError("--something must be better, got 0.")

    monkeypatch.setattr(cli, "launch", job)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        cli.main(["--num-workers", "2", script])
    assert e.value.code == 2 and "--something must be better, got 0." in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before
