"""``python -m replicator.bisect``: name the first optional pass that changes a step's result.

The command line of :func:`replicator.tools.bisect.bisect_passes` (see there).
It prints the report and exits with status 1 when a pass changes the result::

    python -m replicator.bisect my_train.py:step_fn --batch my_train.py:input_fn \\
        --state my_train.py:init_state --workers 1 --cores 8 --cpu-devices 8 --zero 1

``STEP``, ``--batch``, ``--state`` and ``--passes`` name ``MODULE:NAME`` or
``FILE.py:NAME``; a function of no arguments is called for its value. Without
``--passes``, the step runs under ``PassManager.default`` with the options
``--zero``, ``--hierarchical``, ``--compress`` and ``--algorithm``
(``--help`` lists every flag). The old spellings ``--pipeline`` and ``--zero-stage``
still work, with a note on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from replicator.tools.bisect import BisectReport, bisect_passes

__all__ = ["BisectReport", "bisect_passes", "build_parser", "main", "passes_from_args"]


def _load(ref: str) -> Any:
    """``module:attr`` or ``path/to/file.py:attr``."""
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise SystemExit(f"bisect: expected MODULE:NAME or FILE.py:NAME, got {ref!r}")
    if where.endswith(".py"):
        name = "_bisect_" + os.path.splitext(os.path.basename(where))[0]
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, where)
            if spec is None or spec.loader is None:
                raise SystemExit(f"bisect: cannot load {where!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"bisect: {where!r} has no attribute {attr!r}") from None


def _value(obj: Any) -> Any:
    """A value, or what a function of no arguments returns (an ``input_fn(ctx)`` is kept)."""
    if callable(obj) and not any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in inspect.signature(obj).parameters.values()
    ):
        return obj()
    return obj


class RenamedFlag(argparse.Action):
    """A flag whose last option string is its old name: that one still works, with a note on stderr."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        new, *_, old = self.option_strings
        if option_string == old:
            print(f"{parser.prog}: {old} is now {new}; {old} will be removed.", file=sys.stderr)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every flag with its help."""
    parser = argparse.ArgumentParser(
        prog="python -m replicator.bisect",
        description=(
            "Name the first optional pass that changes a step's result: run the traced step with no optional "
            "pass, then with the first 1, 2, ... optional passes, on the same inputs. Exit status "
            "1 when a pass is named."
        ),
        epilog=(
            "STEP, --batch, --state and --passes name MODULE:NAME or FILE.py:NAME; a function of no arguments "
            "is called for its value. The pass flags (--zero, --hierarchical, --compress, --algorithm) "
            "are the options of PassManager.default; --passes replaces them. --pipeline and --zero-stage are "
            "the old spellings of --passes and --zero."
        ),
    )
    parser.add_argument("step", metavar="STEP", help="the step function, MODULE:NAME or FILE.py:NAME")
    parser.add_argument(
        "--batch",
        required=True,
        help="an input_fn(ctx), one worker's batch, or a function of no arguments returning one",
    )
    parser.add_argument("--state", help="the step's state, or a function of no arguments returning it (default: none)")
    parser.add_argument("--workers", type=int, default=1, help="workers of the mesh (default: 1)")
    parser.add_argument("--cores", type=int, default=None, help="cores per worker (default: all local devices)")
    parser.add_argument("--cpu-devices", type=int, help="emulate this many CPU devices (rp.force_cpu_devices)")
    parser.add_argument(
        "--passes",
        "--pipeline",
        action=RenamedFlag,
        help="a PassManager or a list of passes, MODULE:NAME (default: PassManager.default with the flags below)",
    )
    zero = parser.add_mutually_exclusive_group()
    zero.add_argument(
        "--zero",
        "--zero-stage",
        action=RenamedFlag,
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="the ZeRO level of PassManager.default(zero=...): 0 off, 1 optimizer state, 2 and gradients, "
        "3 and parameters stored 1/N per device (default: 0)",
    )
    zero.add_argument("--shard-optimizer", action="store_true", help="the same as --zero 1 (the older spelling)")
    parser.add_argument(
        "--hierarchical",
        action="store_true",
        help="PassManager.default(hierarchical=True): all-reduce over cores, then over workers",
    )
    parser.add_argument(
        "--compress",
        action="store_true",
        help="PassManager.default(compress=True): float32 all-reduces sent as bfloat16",
    )
    parser.add_argument(
        "--algorithm",
        default="native",
        choices=["native", "ring", "reduce_broadcast"],
        help="PassManager.default(all_reduce_algorithm=...) (default: native)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of the random inputs, for leaves given as specs or with --random-inputs (default: 0)",
    )
    parser.add_argument("--random-inputs", action="store_true", help="random inputs even where arrays are given")
    return parser


#: The flags that set PassManager.default's options, with their defaults.
PIPELINE_FLAGS = {
    "zero": 0,
    "shard_optimizer": False,
    "hierarchical": False,
    "compress": False,
    "algorithm": "native",
}


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for flags that contradict each other (before any module is loaded)."""
    if args.passes:
        given = [
            f"--{name.replace('_', '-')}" for name, default in PIPELINE_FLAGS.items() if getattr(args, name) != default
        ]
        if given:
            parser.error(
                f"--passes replaces PassManager.default and its options: drop {' '.join(given)}, or give the "
                f"pass manager those options itself."
            )


def passes_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The pass manager to bisect: ``--passes``'s, or ``PassManager.default`` with the flags' options."""
    import replicator as rp

    check_flags(parser, args)
    if args.passes:
        passes = _value(_load(args.passes))
        return passes if isinstance(passes, rp.PassManager) else rp.PassManager(passes)
    return rp.PassManager.default(
        zero=1 if args.shard_optimizer else args.zero,
        hierarchical=args.hierarchical,
        compress=args.compress,
        all_reduce_algorithm=args.algorithm,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m replicator.bisect``: print the report; exit 1 if some pass changes the result."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_flags(parser, args)

    import replicator as rp

    if args.cpu_devices:
        rp.force_cpu_devices(args.cpu_devices)  # before the user's modules touch JAX
    step_fn = _load(args.step)
    batch = _value(_load(args.batch))
    state = _value(_load(args.state)) if args.state else None
    passes = passes_from_args(parser, args)
    repl = rp.Replicator(args.workers, args.cores, passes=passes)
    report = bisect_passes(repl, step_fn, batch, state, seed=args.seed, random_inputs=args.random_inputs)
    print(report)
    return 0 if report.culprit is None else 1


def __getattr__(name: str) -> Any:
    if name == "pipeline_from_args":  # the old name
        warnings.warn(
            "replicator.bisect.pipeline_from_args is now replicator.bisect.passes_from_args.",
            DeprecationWarning,
            stacklevel=2,
        )
        return passes_from_args
    raise AttributeError(f"module 'replicator.bisect' has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
