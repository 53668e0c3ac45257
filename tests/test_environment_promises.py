"""The promises of replicator/launch/environment.py that no other test checks (its docstring lists them all)."""

from __future__ import annotations

import os
import sys

import hypothesis
import hypothesis.strategies as st

from replicator.launch import environment
from replicator.runtime.distributed import bootstrap, progress, startup, status

_TIMEOUTS = dict(start_timeout_s=7, heartbeat_timeout_s=3, shutdown_timeout_s=5)
_SETTINGS = (
    startup.ENV_COORDINATOR,
    startup.ENV_NUM_WORKERS,
    startup.ENV_WORKER_ID,
    startup.ENV_CORES_PER_WORKER,
    startup.ENV_INITIAL_NUM_WORKERS,
    status.ENV_STATUS_DIR,
    progress.ENV_PROGRESS_FILE,
)


def test_the_restart_count_and_the_most_restarts_are_under_both_names():
    env = environment.worker_env(
        {}, coordinator=None, num_workers=2, worker_id=0, cores_per_worker=None, restart_count=2, max_restarts=3,
        **_TIMEOUTS,
    )  # fmt: skip
    assert env[startup.ENV_RESTART_COUNT] == env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env[startup.ENV_MAX_RESTARTS] == env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env[startup.ENV_INITIAL_NUM_WORKERS] == "2"  # the first start's count defaults to this start's
    env = environment.worker_env(
        {}, coordinator=None, num_workers=2, worker_id=0, cores_per_worker=None, initial_num_workers=3, **_TIMEOUTS
    )
    assert env[startup.ENV_INITIAL_NUM_WORKERS] == "3" and env[startup.ENV_RESTART_COUNT] == "0"


_values = st.one_of(st.none(), st.integers(0, 64))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    base=st.dictionaries(st.sampled_from([*_SETTINGS, "KEEP", "XLA_FLAGS"]), st.text(max_size=5), max_size=6),
    num_workers=_values,
    worker_id=_values,
    cores=_values,
)
def test_worker_env_sets_or_unsets_every_setting_and_leaves_base_alone(base, num_workers, worker_id, cores):
    """A setting given is set; one not given is removed, never inherited from the launcher's environment; what
    else ``base`` holds is kept; ``base`` itself is not changed; output is unbuffered; the launcher's pid is
    there for the bootstrap to die with it."""
    before = dict(base)
    env = environment.worker_env(
        base, coordinator=None, num_workers=num_workers, worker_id=worker_id, cores_per_worker=cores, **_TIMEOUTS
    )
    assert base == before
    given = {
        startup.ENV_COORDINATOR: None,
        startup.ENV_NUM_WORKERS: num_workers,
        startup.ENV_WORKER_ID: worker_id,
        startup.ENV_CORES_PER_WORKER: cores,
        startup.ENV_INITIAL_NUM_WORKERS: num_workers,
        status.ENV_STATUS_DIR: None,
        progress.ENV_PROGRESS_FILE: None,
    }
    for name, value in given.items():
        assert env.get(name) == (None if value is None else str(value)), name
    if "KEEP" in base:
        assert env["KEEP"] == base["KEEP"]
    if cores is None and "XLA_FLAGS" in base:
        assert env["XLA_FLAGS"] == base["XLA_FLAGS"]
    assert env["PYTHONUNBUFFERED"] == "1" and env[bootstrap.ENV_LAUNCHER_PID] == str(os.getpid())
    assert (env[startup.ENV_START_TIMEOUT], env[startup.ENV_HEARTBEAT_TIMEOUT]) == ("7", "3")


def test_a_worker_runs_through_the_bootstrap_unbuffered():
    assert environment.worker_command(["train.py", "--lr", "1"]) == [
        sys.executable, "-u", bootstrap.__file__, "train.py", "--lr", "1",
    ]  # fmt: skip
    assert environment.worker_command(["--lr", "1"], module="pkg.train") == [
        sys.executable, "-u", bootstrap.__file__, "-m", "pkg.train", "--lr", "1",
    ]  # fmt: skip
