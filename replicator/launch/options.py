"""The launcher's options in one place: :class:`LaunchOptions`, their defaults and their checks.

:func:`~replicator.launch.supervise.launch` (a job on this machine, or one worker
of a job spread over hosts), :func:`~replicator.launch.hosts.run_host` (this
host's part of a job across hosts) and the command line
(:func:`~replicator.launch.cli.main`) take the same options: how long to wait
for what, how often to restart, the watchdog, the rendezvous's timing and where
the workers' logs go. Each is a field here, with its default; the command line's
defaults and ``--help`` come from :class:`LaunchOptions`'s. What a job *is* (its
command, how many workers, the coordinator, this worker's id) and where its
output goes (``env``, ``stdout``, ``stderr``, ``interrupted``) stay arguments
of the functions.

Both functions take ``options=LaunchOptions(...)`` and every option as a
keyword too (as before :class:`LaunchOptions` existed): a keyword given
explicitly overrides the field of ``options``; one left out is the field's
(:data:`FROM_OPTIONS` is its default, meaning just that).

>>> from replicator.launch import LaunchOptions
>>> opts = LaunchOptions(max_restarts=3, step_timeout_s=60)
>>> dataclasses.replace(opts, kill_grace_s=1).kill_grace_s
1
>>> merge(opts, max_restarts=FROM_OPTIONS, kill_grace_s=2.0) == dataclasses.replace(opts, kill_grace_s=2.0)
True
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import os
from typing import Final

from replicator.launch.environment import LaunchError
from replicator.launch.membership import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_JOIN_TIMEOUT_S, DEFAULT_LAST_CALL_S
from replicator.launch.processes import DEFAULT_KILL_GRACE_S
from replicator.launch.restarts import DEFAULT_FAILURE_WINDOW_S
from replicator.launch.watchdog import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S
from replicator.runtime.distributed.startup import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
)

__all__ = ["FROM_OPTIONS", "FromOptions", "LaunchOptions", "merge", "option_flag"]


class FromOptions(enum.Enum):
    """The type of :data:`FROM_OPTIONS`."""

    FROM_OPTIONS = "FROM_OPTIONS"

    def __repr__(self) -> str:
        return "FROM_OPTIONS"


#: The default of the option keywords of :func:`~replicator.launch.supervise.launch` and
#: :func:`~replicator.launch.hosts.run_host`: the keyword was not given, its value is the ``options`` field's.
FROM_OPTIONS: Final = FromOptions.FROM_OPTIONS


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How a job is run: timeouts, restarts, the watchdog, the rendezvous's timing, the logs.

    Every field has the command line's default (``python -m replicator.launch
    --help`` shows the same), and is checked when the object is made:
    :class:`~replicator.launch.environment.LaunchError` (a ``ValueError``)
    names the command-line flag, what it must be and what it got. Change a
    field with :func:`dataclasses.replace`, which checks again.

    >>> opts = LaunchOptions(max_restarts=2, kill_grace_s=1.0)
    >>> opts.step_timeout_s, dataclasses.replace(opts, max_restarts=5).max_restarts
    (20.0, 5)
    >>> LaunchOptions(kill_grace_s=-1)
    Traceback (most recent call last):
    ...
    replicator.launch.environment.LaunchError: --kill-grace must be >= 0 seconds, got -1.
    """

    cores_per_worker: int | None = None
    """Devices per worker (``--cores-per-worker``); on CPU this many are emulated. None: the devices JAX finds."""

    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    """Seconds workers wait for all to join (``--start-timeout``); > 0."""

    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    """Seconds after which a silent worker counts as dead (``--heartbeat-timeout``); > 0."""

    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    """Seconds a finished worker waits for the others (``--shutdown-timeout``); > 0."""

    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    """Seconds between ``SIGTERM`` and ``SIGKILL`` when stopping workers (``--kill-grace``); >= 0."""

    max_time_s: float | None = None
    """Stop the whole job after this many seconds (``--max-time``); None: no limit."""

    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S
    """The watchdog stops the job when no worker moved for this long while one waits for another
    (``--step-timeout``; :mod:`~replicator.launch.watchdog`); 0 or None: no watchdog."""

    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    """The same while a worker compiles a step (``--compile-timeout``); > 0."""

    max_restarts: int = 0
    """Restart every worker after a failure up to this many times (``--max-restarts``;
    :mod:`~replicator.launch.restarts`); 0: a failure ends the job."""

    min_workers: int | None = None
    """A job on this machine: restart on one worker fewer, never below this, when a worker keeps failing
    (``--min-workers``; needs ``max_restarts``); None: never fewer. Across hosts ``--nnodes MIN:MAX`` does it."""

    failure_window_s: float = DEFAULT_FAILURE_WINDOW_S
    """With ``min_workers``: a worker keeps failing when it is blamed again within this many seconds after
    the restart in between (``--failure-window``); > 0."""

    log_dir: str | os.PathLike | None = None
    """Keep every worker's whole output in a new directory under this one (``--log-dir``); None: a temporary
    one, removed at the end unless the launcher named a file in it."""

    show_runtime_logs: bool = False
    """Also show the runtime's chatter, such as Gloo's connection lines (``--show-runtime-logs``)."""

    rdzv_heartbeat_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    """A job across hosts: seconds between the launchers' heartbeats (``--rdzv-heartbeat``); > 0."""

    rdzv_last_call_s: float = DEFAULT_LAST_CALL_S
    """A job across hosts with ``--nnodes MIN:MAX``: seconds a round with MIN hosts waits for more
    (``--rdzv-last-call``); >= 0."""

    rdzv_join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    """A job across hosts: seconds a launcher waits for the others to join a round (``--rdzv-join-timeout``); > 0."""

    rdzv_rejoin_timeout_s: float | None = None
    """A job across hosts: seconds a restart round waits for the hosts of the round before it that still
    heartbeat (``--rdzv-rejoin-timeout``); >= 0 and below ``rdzv_join_timeout_s``. None: the smaller of
    :data:`~replicator.launch.membership.DEFAULT_REJOIN_TIMEOUT_S` (60) and half the join timeout."""

    def __post_init__(self) -> None:
        _count("cores_per_worker", self.cores_per_worker, 1, "a positive int", optional=True)
        for name in ("start_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s", "compile_timeout_s"):
            _seconds(name, getattr(self, name), "a positive number of seconds", positive=True)
        _seconds("kill_grace_s", self.kill_grace_s, ">= 0 seconds", positive=False)
        _seconds("max_time_s", self.max_time_s, "a positive number of seconds", positive=True, optional=True)
        _seconds("step_timeout_s", self.step_timeout_s, ">= 0 seconds (0: no watchdog)", positive=False, optional=True)
        _count("max_restarts", self.max_restarts, 0, "a non-negative int (0: no restarts)")
        _count("min_workers", self.min_workers, 1, "a positive int", optional=True)
        _seconds("failure_window_s", self.failure_window_s, "a positive number of seconds", positive=True)
        _seconds("rdzv_heartbeat_s", self.rdzv_heartbeat_s, "a positive number of seconds", positive=True)
        _seconds("rdzv_join_timeout_s", self.rdzv_join_timeout_s, "a positive number of seconds", positive=True)
        _seconds("rdzv_last_call_s", self.rdzv_last_call_s, ">= 0 seconds", positive=False)
        rejoin = self.rdzv_rejoin_timeout_s
        if rejoin is not None and not (_is_number(rejoin) and 0 <= rejoin < self.rdzv_join_timeout_s):
            raise LaunchError(
                f"--rdzv-rejoin-timeout {rejoin!r}: give a number of seconds >= 0 and below --rdzv-join-timeout "
                f"({self.rdzv_join_timeout_s:g}): the hosts that rejoined a restart would give up before it waited "
                "out the others."
            )
        if not isinstance(self.show_runtime_logs, bool):
            raise LaunchError(f"--show-runtime-logs is True or False, got {self.show_runtime_logs!r}.")

    def rendezvous_timing(self) -> dict[str, float | None]:
        """The rendezvous fields as :class:`~replicator.launch.membership.Rendezvous`'s keywords.

        >>> LaunchOptions(rdzv_heartbeat_s=0.5).rendezvous_timing()["heartbeat_interval_s"]
        0.5
        """
        return {
            "heartbeat_interval_s": self.rdzv_heartbeat_s,
            "last_call_s": self.rdzv_last_call_s,
            "join_timeout_s": self.rdzv_join_timeout_s,
            "rejoin_timeout_s": self.rdzv_rejoin_timeout_s,
        }


#: The command-line flag of each field whose name is not the flag's with ``_s`` (for seconds) dropped.
_FLAGS: dict[str, str] = {
    "rdzv_heartbeat_s": "--rdzv-heartbeat",
}


def option_flag(name: str) -> str:
    """The command-line flag of the field ``name``: ``"kill_grace_s"`` -> ``"--kill-grace"``.

    >>> option_flag("rdzv_join_timeout_s"), option_flag("max_restarts")
    ('--rdzv-join-timeout', '--max-restarts')
    """
    if name in _FLAGS:
        return _FLAGS[name]
    return "--" + name.removesuffix("_s").replace("_", "-")


def _is_number(value: object) -> bool:
    """A real number of seconds (NumPy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _seconds(name: str, value: object, need: str, *, positive: bool, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not (_is_number(value) and (value > 0 if positive else value >= 0)):  # NaN is neither
        raise LaunchError(f"{option_flag(name)} must be {need}, got {value!r}.")


def _count(name: str, value: object, low: int, need: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise LaunchError(f"{option_flag(name)} must be {need}, got {value!r}.")


def merge(options: LaunchOptions | None, **given: object) -> LaunchOptions:
    """``options`` (default :class:`LaunchOptions()`) with the keywords given, those not :data:`FROM_OPTIONS`,
    in place of its fields; checked again (:class:`~replicator.launch.environment.LaunchError`).

    >>> merge(LaunchOptions(max_restarts=3), max_restarts=FROM_OPTIONS, kill_grace_s=1.0).max_restarts
    3
    >>> merge(None, max_restarts=2) == LaunchOptions(max_restarts=2)
    True
    """
    if options is None:
        options = LaunchOptions()
    elif not isinstance(options, LaunchOptions):
        raise LaunchError(f"options= takes a LaunchOptions(...), got {type(options).__name__}: {options!r}.")
    explicit = {name: value for name, value in given.items() if value is not FROM_OPTIONS}
    return dataclasses.replace(options, **explicit) if explicit else options
