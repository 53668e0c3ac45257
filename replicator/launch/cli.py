"""The command line: ``python -m replicator.launch [options] (script.py | -m module) [args ...]``.

The launcher's options end at the script (or ``-m MODULE``, or ``--``); the
rest is the worker's command line. :func:`main` runs the job with
:func:`~replicator.launch.supervise.launch` and turns ``SIGINT`` and
``SIGTERM`` into stopping it (exit code ``128 + signal``).

A job across hosts runs one launcher per host, torchrun's way: ``--nnodes
N|MIN:MAX --rdzv-endpoint HOST:PORT`` (and ``--nproc-per-node``, ``--node-rank``)
on each; the launchers agree through the rendezvous there (hosted by whichever
launcher can open it) on the hosts, the workers' ids and every restart
(:func:`~replicator.launch.hosts.run_host`).

torchrun's spellings are understood (:data:`TORCHRUN`): where an option of
torchrun means what one of ours does it is an alias (``--nproc-per-node 2``
is ``--num-workers 2`` on one machine); where it means something else it is
refused with what to pass instead, before any worker starts. An underscore
may stand for a dash in any option (``--max_restarts``), and an unknown
option is answered with the closest known ones. A script that does not exist
or cannot be read, or a module that cannot be found, is refused before any
worker starts too.

Promises:

1. The launcher's options end at the script, ``--`` or ``-m MODULE``; what
   follows is the worker's command line as given, even what looks like a
   launcher option
   (tests/test_cli_promises.py::test_whatever_follows_the_script_or_dash_dash_is_the_workers_verbatim,
   tests/test_launch.py::TestCommandLine::test_options_end_at_the_script).
2. torchrun's spellings that mean ours are aliases, underscores read as dashes
   (tests/test_launch_cli.py::TestTorchrunSpellings::test_aliases_of_ours,
   tests/test_launch_cli.py::TestTorchrunSpellings::test_underscores_and_module); the others,
   and an unknown option, are refused (exit 2) saying what to pass or the
   closest known option
   (tests/test_launch_cli.py::TestTorchrunSpellings::test_refused_with_what_to_pass).
3. A script that does not exist or cannot be read, or a module that cannot be
   found, is refused before any worker starts
   (tests/test_launch_cli.py::TestRefusedBeforeAnyWorkerStarts::test_a_script_or_module_that_cannot_run,
   tests/test_launch_cli.py::TestRefusedBeforeAnyWorkerStarts::test_an_unreadable_script); no
   script at all is a usage error
   (tests/test_launch.py::TestCommandLine::test_no_script).
4. A bad setting is a usage error (exit 2) naming it, found by the parser or
   by the job (tests/test_cli_promises.py::test_a_bad_setting_found_by_the_job_is_a_usage_error,
   tests/test_launch_cli.py::test_rdzv_rejoin_timeout_must_be_below_the_join_timeout,
   tests/test_launch_cli.py::test_rdzv_last_call_0_is_allowed_and_a_negative_one_refused).
5. ``--nnodes`` with ``--rdzv-endpoint`` runs the rendezvous mode, single
   launcher modes unchanged
   (tests/test_launch_cli.py::TestAcrossHosts::test_rendezvous_mode,
   tests/test_launch_cli.py::TestAcrossHosts::test_single_launcher_modes_are_unchanged); an
   endpoint other machines reach needs a secret, and a bad secret file is
   refused (tests/test_launch_cli.py::TestAcrossHosts::test_a_non_loopback_endpoint_needs_a_secret_and_a_bad_secret_file_is_refused).
6. ``SIGINT`` and ``SIGTERM`` to the launcher stop the job, which exits
   with ``128 + signal``; the previous handlers are back once :func:`main`
   returns (tests/test_cli_promises.py::test_a_signal_to_the_launcher_becomes_stopping_the_job_and_the_handlers_are_restored,
   tests/test_launch.py::test_sigterm_to_the_launcher_stops_the_job).
7. ``--help`` lists the exit codes and every option's default
   (tests/test_launch_cli.py::test_help_lists_the_exit_codes_and_every_default).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.machinery
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from replicator.launch.environment import LaunchError, worker_command
from replicator.launch.hosts import HOST_LOST_EXIT_CODE, run_host
from replicator.launch.membership import (
    DEFAULT_MISSED_HEARTBEATS,
    DEFAULT_REJOIN_TIMEOUT_S,
    Rendezvous,
    parse_nnodes,
    serve_if_here,
)
from replicator.launch.options import LaunchOptions, option_flag
from replicator.launch.rendezvous import ENV_SECRET, RendezvousError, is_loopback, load_secret
from replicator.launch.supervise import launch
from replicator.launch.watchdog import STALL_EXIT_CODE
from replicator.runtime.distributed.startup import START_TIMEOUT_EXIT_CODE

__all__ = ["TORCHRUN", "main"]

#: torchrun's options and what they are here: an alias of ours (with a condition), or why not.
#: docs/guide/multihost.md has the same table.
TORCHRUN: dict[str, str] = {
    "--nproc-per-node": "the same option: workers per host (--num-workers on one machine)",
    "--nnodes": "the same option: N or MIN:MAX hosts, with --rdzv-endpoint; 1: a job on this machine",
    "--node-rank": "the same option: the host rank asked for (with --rdzv-endpoint; with --master-addr: --worker-id)",
    "--rdzv-endpoint": "the same option: HOST[:PORT] of the rendezvous (default port 29400), served by the launcher "
    "that can open it",
    "--rdzv-backend": "c10d (the default here: a store on one launcher) and static (--master-addr) accepted",
    "--master-addr": "static: the HOST of --coordinator HOST:PORT (worker 0's host), with --node-rank",
    "--master-port": "static: the PORT of --coordinator HOST:PORT",
    "--local-addr": "the same option: this host's address, as the other hosts reach it",
    "--standalone": "the default for a job on one machine (127.0.0.1 at a free port)",
    "--module": "-m MODULE",
    "--max-restarts": "--max-restarts (the same option)",
    "--log-dir": "--log-dir (the same option: each run gets a new directory under it)",
}

#: torchrun's options with no counterpart here, and what to do instead.
_TORCHRUN_REFUSED: dict[str, str] = {
    "--rdzv-id": "a job is known by its rendezvous's address here (--rdzv-endpoint); drop it",
    "--rdzv-conf": "use --rdzv-heartbeat, --rdzv-last-call and --rdzv-join-timeout",
    "--redirects": "every worker's output is shown with a [worker I] prefix and kept whole in --log-dir",
    "--tee": "every worker's output is shown with a [worker I] prefix and kept whole in --log-dir",
    "--monitor-interval": "workers are watched every 0.05 s; --step-timeout bounds a stall",
    "--no-python": "the workers run Python scripts or modules (-m); run other programs yourself",
    "--local-ranks-filter": "every worker's output is shown, prefixed; each is kept whole in --log-dir",
}

#: torchrun's default ports, for an address given without one.
_MASTER_PORT = 29500
_RDZV_PORT = 29400

#: The options' defaults: --help's come from these (:class:`~replicator.launch.options.LaunchOptions`).
_DEFAULTS = LaunchOptions()

# The options that take seconds: (LaunchOptions field, help), in --help's order; the flag is the field's.
_SECONDS: list[tuple[str, str]] = [
    ("start_timeout_s", "seconds workers wait for all to join (default %(default)g)"),
    ("heartbeat_timeout_s", "seconds after which a silent worker counts as dead (default %(default)g)"),
    ("shutdown_timeout_s", "seconds a finished worker waits for the others (default %(default)g)"),
    ("kill_grace_s", "seconds between SIGTERM and SIGKILL when stopping workers (default %(default)g)"),
    ("max_time_s", "stop the whole job after this many seconds (default: no limit)"),
    (
        "step_timeout_s",
        "stop the job when no worker made progress for S seconds while one waits for another; it names "
        "the worker behind and prints every worker's Python stack (default %(default)g; 0: off)",
    ),
    ("compile_timeout_s", "the same while a worker compiles a step (default %(default)g)"),
    (
        "failure_window_s",
        "with --min-workers: a worker keeps failing when the failure before was blamed on it too and it fails "
        "again within S seconds after the restart in between (default %(default)g)",
    ),
]


def _dest(field: str) -> str:
    """The argparse destination of a LaunchOptions field: its flag's (``kill_grace_s``: ``kill_grace``)."""
    return option_flag(field)[2:].replace("-", "_")


def options_of(args: argparse.Namespace) -> LaunchOptions:
    """The :class:`~replicator.launch.options.LaunchOptions` that the parsed ``args`` say; LaunchError if bad.

    Every field has an option of the same name (``kill_grace_s``: ``--kill-grace``), whose default is the field's.
    """
    return LaunchOptions(**{f.name: getattr(args, _dest(f.name)) for f in dataclasses.fields(LaunchOptions)})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m replicator.launch",
        usage="%(prog)s [options] (script.py | -m module) [args ...]",
        description="Run a replicator training script as the workers of a multi-process job.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation would also swallow the script's name as its value
    )
    p.add_argument(
        "--num-workers",
        type=int,
        metavar="W",
        help="workers (processes) in the job (torchrun: --nproc-per-node on one machine, --nnodes across hosts; "
        "default: none, needed unless the launcher runs under SLURM or Open MPI, which say it)",
    )
    p.add_argument(
        "--cores-per-worker",
        type=int,
        metavar="C",
        default=_DEFAULTS.cores_per_worker,
        help="devices per worker; on CPU this many are emulated (default: not set: each worker uses the devices "
        "JAX finds, all of a GPU host's GPUs, or the CPU devices XLA_FLAGS asks for, 1 without it)",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="HOST:PORT of worker 0 (torchrun: --master-addr/--master-port, --rdzv-endpoint; default for local "
        "jobs: 127.0.0.1 at a free port)",
    )
    p.add_argument(
        "--worker-id",
        type=int,
        metavar="I",
        help="start only this worker (one per host; needs --coordinator; torchrun: --node-rank; default: none, "
        "every worker of the job starts on this machine)",
    )
    for field, text in _SECONDS:
        p.add_argument(option_flag(field), type=float, metavar="S", default=getattr(_DEFAULTS, field), help=text)
    p.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        default=_DEFAULTS.max_restarts,
        help="when a worker fails (killed, an exception, the watchdog), stop the others and start every worker "
        "again, up to N times; workers read the restart number in REPLICATOR_RESTART_COUNT (and "
        "TORCHELASTIC_RESTART_COUNT) and resume from their checkpoints, e.g. Trainer(..., resume_from=DIR). "
        "On one machine, or across hosts with --rdzv-endpoint (every host's workers restart together; default "
        "%(default)s: a failure ends the job)",
    )
    p.add_argument(
        "--min-workers",
        type=int,
        metavar="M",
        default=_DEFAULTS.min_workers,
        help="with --max-restarts: when a worker keeps failing (see --failure-window), the next restart runs the "
        "job on one worker fewer, never fewer than M; it counts as a restart. Workers read the new count in "
        "REPLICATOR_NUM_WORKERS and the first start's in REPLICATOR_INITIAL_NUM_WORKERS; a Trainer with "
        "resume_from= restores onto the smaller mesh and keeps the global batch (keep_batch='per-replica' keeps "
        "the rows per replica instead). Default: --num-workers (never fewer)",
    )
    p.add_argument(
        "--log-dir",
        metavar="DIR",
        default=_DEFAULTS.log_dir,
        help="keep every worker's whole output in a new directory under DIR (worker-I.log), chatter and "
        "tracebacks included (default: a temporary directory, removed at the end unless a line of the launcher "
        "named a file in it: everything else was shown)",
    )
    p.add_argument(
        "--show-runtime-logs",
        action="store_true",
        default=_DEFAULTS.show_runtime_logs,
        help="also show the runtime's chatter, such as Gloo's '[Gloo] Rank 0 is connected to 1 peer ranks' lines "
        "(default: off; they are in the log files either way)",
    )
    p.add_argument(
        "-m",
        dest="module",
        metavar="MODULE",
        help="run a module as the worker's program, like python -m (torchrun: -m/--module; default: none, "
        "run a script)",
    )
    # torchrun's spellings (hidden: the epilog and docs/guide/multihost.md list them), resolved by _from_torchrun.
    hosts = p.add_argument_group(
        "a job across hosts (one launcher per host, torchrun's way; exit code 77: a host or the rendezvous was lost)"
    )
    hosts.add_argument(
        "--nnodes",
        dest="tr_nnodes",
        metavar="N|MIN:MAX",
        help="hosts in the job, each running this launcher with the same --rdzv-endpoint: N, or MIN:MAX to go on "
        "with at least MIN after a host is lost (at the next restart, the global batch kept; a host that comes "
        "back joins at the restart after). Default: 1, this machine",
    )
    hosts.add_argument(
        "--nproc-per-node",
        dest="tr_nproc_per_node",
        metavar="N",
        help="workers on each host (worker ids host_rank * N + i; on one machine the same as --num-workers N; "
        "each sees all of its host's GPUs: 1 on GPU hosts; default 1)",
    )
    hosts.add_argument(
        "--rdzv-endpoint",
        dest="tr_rdzv_endpoint",
        metavar="HOST[:PORT]",
        help="the rendezvous where the hosts' launchers agree on the hosts, worker ids and restarts: served by "
        "the launcher that can open HOST:PORT (default port 29400), the others connect. An address other than "
        "loopback needs a shared secret (--rdzv-secret-file)",
    )
    hosts.add_argument(
        "--node-rank",
        dest="tr_node_rank",
        type=int,
        metavar="I",
        help="the host rank this host asks for (default: its rank in the round before, else the first free one)",
    )
    hosts.add_argument(
        "--rdzv-secret-file",
        metavar="PATH",
        help=f"the rendezvous's shared secret (>= 16 bytes; chmod 600), the same on every host; default "
        f"${ENV_SECRET}; a launcher without it is refused",
    )
    hosts.add_argument(
        "--local-addr",
        metavar="HOST",
        help="this host's address as the other hosts reach it (JAX's coordinator is host rank 0's; default: "
        "127.0.0.1 for a loopback endpoint, else this host's address on the route to the endpoint)",
    )
    hosts.add_argument(
        "--rdzv-heartbeat",
        type=float,
        metavar="S",
        default=_DEFAULTS.rdzv_heartbeat_s,
        help=f"seconds between the launchers' heartbeats: a host (or the rendezvous) silent for "
        f"{DEFAULT_MISSED_HEARTBEATS} of them is lost, seen within {DEFAULT_MISSED_HEARTBEATS + 1} (default "
        f"%(default)g)",
    )
    hosts.add_argument(
        "--rdzv-last-call",
        type=float,
        metavar="S",
        default=_DEFAULTS.rdzv_last_call_s,
        help="with MIN:MAX: seconds a round with MIN hosts waits for more (default %(default)g)",
    )
    hosts.add_argument(
        "--rdzv-join-timeout",
        type=float,
        metavar="S",
        default=_DEFAULTS.rdzv_join_timeout_s,
        help="seconds a launcher waits for the others to join a round (default %(default)g)",
    )
    hosts.add_argument(
        "--rdzv-rejoin-timeout",
        type=float,
        metavar="S",
        default=_DEFAULTS.rdzv_rejoin_timeout_s,
        help=f"seconds a restart round waits for the hosts of the round before it that still heartbeat (stopping "
        f"their workers) before it goes on without them, naming them; below --rdzv-join-timeout (default: "
        f"{DEFAULT_REJOIN_TIMEOUT_S:g} or half the join timeout, the smaller)",
    )
    hidden = argparse.SUPPRESS
    p.add_argument("--master-addr", dest="tr_master_addr", metavar="HOST", help=hidden)
    p.add_argument("--master-port", dest="tr_master_port", type=int, metavar="PORT", help=hidden)
    p.add_argument("--rdzv-backend", dest="tr_rdzv_backend", metavar="NAME", help=hidden)
    p.add_argument("--standalone", dest="tr_standalone", action="store_true", help=hidden)
    return p


_EPILOG = f"""\
exit codes:
  0        every worker succeeded
  N        the first failed worker's own exit code (128+S when a signal S killed it)
  1        workers still running long after another one finished: stuck (see --shutdown-timeout)
  2        bad launcher arguments, or a script or module that cannot be run (no worker started)
  {START_TIMEOUT_EXIT_CODE}       a worker never joined the job: it gave up waiting for the others (--start-timeout),
           or its script ended before it joined
  {STALL_EXIT_CODE}       the watchdog stopped the job: no worker moved for --step-timeout while one waited for
           another, or a worker left the training loop while the others went on
  {HOST_LOST_EXIT_CODE}       a job across hosts lost a host (without MIN:MAX room for it) or its rendezvous
  124      --max-time ran out
  128+S    the launcher got signal S (130: Ctrl-C, 143: SIGTERM)
  With --max-restarts, a job that failed once too often ends with its last failure's code.

torchrun's options (an underscore may stand for a dash in any option):
{chr(10).join(f"  {flag:<19}{meaning}" for flag, meaning in TORCHRUN.items())}

Examples: python -m replicator.launch --num-workers 2 --cores-per-worker 4 train.py --steps 100
          python -m replicator.launch --nnodes 1:2 --rdzv-endpoint HOST0:29400 --rdzv-secret-file s.txt \\
              --max-restarts 3 train.py   # on each host
"""


def _split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Launcher options | the worker's command: the first positional or ``-m MOD`` ends the options.

    In the options, ``--some_option`` is read as ``--some-option`` (torchrun accepts both) and
    torchrun's ``--module`` as ``-m``.
    """
    known = {opt for a in parser._actions for opt in a.option_strings}
    takes_value = {opt for a in parser._actions if a.nargs is None and a.option_strings for opt in a.option_strings}
    options: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return options, list(argv[i + 1 :])
        if arg.startswith("--") and "_" in arg.partition("=")[0]:
            name, eq, value = arg.partition("=")
            if name.replace("_", "-") in known | set(_TORCHRUN_REFUSED):
                arg = name.replace("_", "-") + eq + value
        if arg == "--module":
            arg = "-m"
        if arg == "-m":
            return [*options, arg, *argv[i + 1 : i + 2]], list(argv[i + 2 :])
        if not arg.startswith("-") or arg == "-":
            return options, list(argv[i:])
        options.append(arg)
        if arg in takes_value and i + 1 < len(argv):
            options.append(argv[i + 1])
            i += 1
        i += 1
    return options, []


def _unknown_option(arg: str, parser: argparse.ArgumentParser) -> str:
    """The error for an option the launcher does not know: why, or the closest known ones."""
    name = arg.partition("=")[0]
    if name in _TORCHRUN_REFUSED:
        return f"{name} is torchrun's; replicator.launch has no such option: {_TORCHRUN_REFUSED[name]}."
    visible = [
        o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings if o.startswith("--")
    ]
    candidates = visible + [t for t in TORCHRUN if t not in visible]
    close = [c for c in candidates if c.startswith(name) and len(name) > 2][:2]  # an abbreviation
    close = close or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)  # else a typo
    hint = ""
    if close:
        said = [f"{c} (torchrun's: {TORCHRUN[c]})" if c in TORCHRUN and c not in visible else c for c in close]
        hint = f"; did you mean {' or '.join(said)}?"
    return f"unrecognized option {name}{hint} (all options: --help)"


def _rendezvous_mode(args: argparse.Namespace) -> None:
    """A job across hosts through the rendezvous: check and set ``args.hosts``, ``nproc``, ``rdzv_endpoint``."""
    try:
        low, high = parse_nnodes(args.tr_nnodes or "1")
    except ValueError as e:
        raise LaunchError(str(e)) from None
    for given, flag, instead in (
        (args.num_workers, "--num-workers", "--nproc-per-node (workers per host)"),
        (args.coordinator, "--coordinator", "nothing: host rank 0's launcher picks JAX's coordinator"),
        (args.worker_id, "--worker-id", "--node-rank (a host rank; worker ids follow from it)"),
        (args.min_workers, "--min-workers", "--nnodes MIN:MAX (the fewest hosts to go on with)"),
        (args.tr_master_addr, "--master-addr", "nothing: host rank 0's launcher picks JAX's coordinator"),
        (args.tr_master_port, "--master-port", "nothing: host rank 0's launcher picks JAX's coordinator"),
        (args.tr_standalone or None, "--standalone", "nothing, or drop --rdzv-endpoint for a job on this machine"),
    ):
        if given is not None:
            raise LaunchError(
                f"{flag} does not go with --rdzv-endpoint (a job across hosts, one launcher per host); pass {instead}."
            )
    nproc = args.tr_nproc_per_node or "1"
    if not nproc.isdigit() or int(nproc) < 1:
        raise LaunchError(f"--nproc-per-node {nproc}: give a number of workers per host (e.g. 1: one per GPU host).")
    if args.tr_node_rank is not None and not 0 <= args.tr_node_rank < high:
        raise LaunchError(
            f"--node-rank {args.tr_node_rank} is out of range for --nnodes {args.tr_nnodes}: give 0..{high - 1}."
        )
    host, sep, port = args.tr_rdzv_endpoint.rpartition(":")
    if not (sep and host and port.isdigit()):
        host, port = args.tr_rdzv_endpoint, str(_RDZV_PORT)
    if not host or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv-endpoint {args.tr_rdzv_endpoint!r} is not HOST[:PORT], e.g. 10.0.0.1:29400.")
    args.hosts, args.nproc, args.rdzv_endpoint = (low, high), int(nproc), f"{host}:{port}"


def _from_torchrun(args: argparse.Namespace) -> None:
    """Resolve torchrun's options into ours (in ``args``); raise LaunchError where they mean something else."""
    args.hosts = None
    if args.tr_rdzv_endpoint is not None and args.tr_rdzv_backend in (None, "c10d"):
        _rendezvous_mode(args)
        return
    for flag in ("rdzv_secret_file", "local_addr"):
        if getattr(args, flag) is not None:
            raise LaunchError(f"--{flag.replace('_', '-')} goes with --rdzv-endpoint HOST:PORT (a job across hosts).")
    nproc, nnodes, node_rank = args.tr_nproc_per_node, args.tr_nnodes, args.tr_node_rank
    nodes: int | None = None
    if nnodes is not None:
        low, sep, high = nnodes.partition(":")
        if not (low.isdigit() and (not sep or high.isdigit())) or int(low) < 1:
            raise LaunchError(f"--nnodes takes a number of hosts N (or torchrun's MIN:MAX), got {nnodes!r}.")
        if sep and low != high:
            raise LaunchError(
                f"--nnodes {nnodes}: a job whose number of hosts may change (MIN:MAX) needs the launchers to agree "
                f"through a rendezvous: pass --rdzv-endpoint HOST:PORT (the same on every host; one of them serves "
                f"it). On one machine, --max-restarts R --min-workers M restarts a failing job on fewer workers."
            )
        nodes = int(low)
    workers: int | None = None
    if nproc is not None:
        if not nproc.isdigit() or int(nproc) < 1:
            raise LaunchError(
                f"--nproc-per-node {nproc}: give a number of workers. Here a worker is one process that uses all "
                f"the devices it is given (--cores-per-worker), so run one worker per GPU host "
                f"(--nproc-per-node 1 --nnodes HOSTS), and on CPU as many as you like."
            )
        workers = int(nproc)
    if nodes is not None and nodes > 1:
        if workers is not None and workers != 1:
            raise LaunchError(
                f"--nproc-per-node {workers} with --nnodes {nodes}: a job across hosts runs one worker per host "
                f"here, each with all of its host's devices; pass --nproc-per-node 1 (or leave it out) and "
                f"--cores-per-worker for the devices."
            )
        workers = nodes
        if node_rank is None:
            raise LaunchError(
                f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT on each host (the launchers agree there on the "
                f"hosts, their ranks and every restart), or --node-rank I with --master-addr HOST (the same as "
                f"--worker-id I --coordinator HOST:29500: no restarts across hosts)."
            )
    elif node_rank not in (None, 0):
        raise LaunchError(
            f"--node-rank {node_rank} needs --nnodes N > {node_rank} (one worker per host; the same as --worker-id)."
        )
    if workers is not None:
        if args.num_workers is not None and args.num_workers != workers:
            raise LaunchError(
                f"--num-workers {args.num_workers} and torchrun's --nproc-per-node/--nnodes (= {workers} "
                f"workers) disagree; pass one of them."
            )
        args.num_workers = workers
    if nodes is not None and nodes > 1:
        _set(args, "worker_id", node_rank, "--node-rank")
    backend = args.tr_rdzv_backend
    if backend is not None and backend not in ("c10d", "static"):
        raise LaunchError(
            f"--rdzv-backend {backend}: there is no rendezvous service here; pass --rdzv-endpoint HOST:PORT "
            f"(a store on one launcher, as torchrun's c10d backend), or --rdzv-backend static with --master-addr."
        )
    address = None
    if args.tr_rdzv_endpoint is not None:
        host, sep, port = args.tr_rdzv_endpoint.rpartition(":")
        address = args.tr_rdzv_endpoint if sep and host and port else f"{args.tr_rdzv_endpoint}:{_RDZV_PORT}"
        if args.tr_master_addr is not None or args.tr_master_port is not None:
            raise LaunchError("pass either --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both.")
    elif args.tr_master_addr is not None or args.tr_master_port is not None:
        port = args.tr_master_port if args.tr_master_port is not None else _MASTER_PORT
        address = f"{args.tr_master_addr or '127.0.0.1'}:{port}"
    if args.tr_standalone:
        if address is not None or args.coordinator is not None or (nodes is not None and nodes > 1):
            raise LaunchError(
                "--standalone is a job on this machine at a free port (the default here); drop it, or drop "
                "--coordinator/--master-addr/--rdzv-endpoint/--nnodes."
            )
    if address is not None:
        _set(args, "coordinator", address, "--master-addr/--master-port/--rdzv-endpoint")


def _set(args: argparse.Namespace, name: str, value: object, given_as: str) -> None:
    ours = getattr(args, name)
    if ours is not None and ours != value:
        flag = "--" + name.replace("_", "-")
        raise LaunchError(f"{flag} {ours} and torchrun's {given_as} (= {value}) disagree; pass one of them.")
    setattr(args, name, value)


def _check_program(rest: list[str], module: str | None) -> None:
    """Raise LaunchError when the workers' script cannot be read or their module cannot be found."""
    if module is not None:
        if not _find_module(module, os.getcwd()):
            raise LaunchError(
                f"-m {module}: python -m finds no module {module!r} to run from {os.getcwd()} (a package needs a "
                f"__main__.py; the workers' sys.path starts "
                f"there, then PYTHONPATH and the installed packages); check its name, or cd to its project."
            )
        return
    script = rest[0]
    if not os.path.exists(script):
        folder = os.path.dirname(script) or "."
        try:
            names = [n for n in os.listdir(folder) if n.endswith(".py")]
        except OSError:
            names = []
        close = difflib.get_close_matches(os.path.basename(script), names, n=1)
        hint = f"; did you mean {os.path.join(os.path.dirname(script), close[0])}?" if close else "."
        if script in ("python", "python3") or script.endswith(("/python", "/python3")):
            hint = f": give the script itself ({' '.join(rest[1:2]) or 'train.py'}), the launcher runs Python."
        raise LaunchError(f"no script {script!r} (from {os.getcwd()}){hint}")
    if os.path.isdir(script):
        if not os.path.isfile(os.path.join(script, "__main__.py")):
            raise LaunchError(f"{script!r} is a directory without __main__.py; give the script to run.")
        return
    if not os.access(script, os.R_OK):
        raise LaunchError(f"cannot read the script {script!r} (permission denied); check its permissions.")


def _find_module(name: str, cwd: str) -> bool:
    """Whether ``python -m name`` run in ``cwd`` would find the module, without importing (running) anything.

    A package must have a ``__main__`` module, as for ``python -m``.
    """
    top, *subs = name.split(".")
    path = [cwd, *sys.path[1:]]  # the workers' sys.path: the bootstrap puts the working directory first
    spec = None
    for finder in sys.meta_path:  # builtins, frozen modules, editable installs' finders, then the path
        find = getattr(finder, "find_spec", None)
        if find is not None:
            spec = find(top, path if finder is importlib.machinery.PathFinder else None)
            if spec is not None:
                break
    if spec is None:
        return False
    locations = list(spec.submodule_search_locations or [])
    for part in [*subs, "__main__"]:
        if not locations:  # a module, not a package: nothing below it
            return part == "__main__"
        found = _find_in(locations, part)
        if found is None:
            return False
        locations = found
    return True


def _find_in(locations: list[str], part: str) -> list[str] | None:
    """Module ``part`` in a package's ``locations``: its own locations ([] for a module), or None if missing."""
    suffixes = importlib.machinery.all_suffixes()
    namespace = []
    for folder in locations:
        base = os.path.join(folder, part)
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return [base]
        if any(os.path.isfile(base + suffix) for suffix in suffixes):
            return []
        if os.path.isdir(base):
            namespace.append(base)
    return namespace or None


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options, torchrun's resolved into ours, and the workers' command (script or module, args).

    ``args.options`` is the :class:`~replicator.launch.options.LaunchOptions` the options say
    (``LaunchOptions()`` for none of them). Exits with code 2 and a message on a bad option, a script that cannot be
    read or a module that cannot be found: before any worker starts.
    """
    parser = _parser()
    options, rest = _split_argv(argv, parser)
    args, unknown = parser.parse_known_args(options)
    if unknown:
        parser.error(_unknown_option(unknown[0], parser))
    try:
        _from_torchrun(args)
        args.options = options_of(args)
        if not args.module and not rest:
            raise LaunchError("give the script to run (train.py [args]) or a module (-m pkg.train [args]).")
        _check_program(rest, args.module)
    except LaunchError as e:
        parser.error(str(e))
    return args, rest


def _local_address(endpoint: str) -> str:
    """This host's address on the route to ``endpoint`` (no packet is sent); 127.0.0.1 for a loopback one."""
    host = endpoint.rpartition(":")[0].strip("[]")
    if is_loopback(host):
        return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(endpoint.rpartition(":")[2])))
            return s.getsockname()[0]
    except OSError as e:
        raise LaunchError(
            f"cannot find this host's address on the route to --rdzv-endpoint {endpoint} ({e}); pass --local-addr."
        ) from None


def _across_hosts(args: argparse.Namespace, command: list[str], interrupted: threading.Event) -> int:
    """This host's part of a job across hosts: serve the rendezvous if it can, join it, run the rounds."""
    try:
        secret = load_secret(args.rdzv_secret_file)
        store = serve_if_here(args.rdzv_endpoint, secret)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    address = args.local_addr or _local_address(args.rdzv_endpoint)
    low, high = args.hosts
    rdzv = Rendezvous(
        args.rdzv_endpoint,
        min_hosts=low,
        max_hosts=high,
        rank=args.tr_node_rank,
        address=address,
        secret=secret,
        **args.options.rendezvous_timing(),
    )
    where = "served here" if store is not None else "served by another host's launcher"
    print(f"[launcher] rendezvous at {args.rdzv_endpoint} ({where}); this host: {address}", file=sys.stderr, flush=True)
    try:
        try:
            rdzv.start()
        except RendezvousError as e:
            print(f"[launcher] cannot join the rendezvous: {e}", file=sys.stderr, flush=True)
            return HOST_LOST_EXIT_CODE
        return run_host(
            command,
            rdzv,
            nproc_per_host=args.nproc,
            interrupted=interrupted,
            store=store,
            options=args.options,
        )
    finally:
        rdzv.close()
        if store is not None:
            store.close()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m replicator.launch`` command; returns the exit code."""
    args, rest = parse(list(sys.argv[1:] if argv is None else argv))
    command = worker_command(rest, module=args.module) if args.module else worker_command(rest)

    interrupted = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        del frame
        interrupted.signum = signum  # type: ignore[attr-defined]
        interrupted.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.hosts is not None:
            return _across_hosts(args, command, interrupted)
        return launch(
            command,
            num_workers=args.num_workers,
            coordinator=args.coordinator,
            worker_id=args.worker_id,
            interrupted=interrupted,
            options=args.options,
        )
    except LaunchError as e:
        _parser().error(str(e))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
