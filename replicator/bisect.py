"""``python -m replicator.bisect``: name the first optional pass that changes a step's result.

The command line of :func:`replicator.tools.bisect.bisect_passes` (see there).
It prints the report and exits with status 1 when a pass changes the result::

    python -m replicator.bisect my_train.py:step_fn --batch my_train.py:input_fn \\
        --state my_train.py:init_state --workers 1 --cores 8 --cpu-devices 8 --shard-optimizer

``STEP``, ``--batch``, ``--state`` and ``--pipeline`` name ``MODULE:NAME`` or
``FILE.py:NAME``; a function of no arguments is called for its value.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

from replicator.tools.bisect import BisectReport, bisect_passes

__all__ = ["BisectReport", "bisect_passes", "main"]


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m replicator.bisect``: print the report; exit 1 if some pass changes the result."""
    parser = argparse.ArgumentParser(
        prog="python -m replicator.bisect",
        description="Name the first optional pass that changes a step's result.",
    )
    parser.add_argument("step", help="the step function, MODULE:NAME or FILE.py:NAME")
    parser.add_argument("--batch", required=True, help="an input_fn(ctx), a worker batch, or a function returning one")
    parser.add_argument("--state", help="the state, or a function of no arguments returning it")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cores", type=int, default=None, help="cores per worker (default: all local devices)")
    parser.add_argument("--cpu-devices", type=int, help="emulate this many CPU devices (rp.force_cpu_devices)")
    parser.add_argument("--pipeline", help="a Pipeline (or list of passes), MODULE:NAME; default: Pipeline.default")
    parser.add_argument("--shard-optimizer", action="store_true")
    parser.add_argument("--hierarchical", action="store_true")
    parser.add_argument("--compress", action="store_true")
    parser.add_argument("--algorithm", default="native", choices=["native", "ring", "reduce_broadcast"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-inputs", action="store_true", help="random inputs even where arrays are given")
    args = parser.parse_args(argv)

    import replicator as rp

    if args.cpu_devices:
        rp.force_cpu_devices(args.cpu_devices)  # before the user's modules touch JAX
    step_fn = _load(args.step)
    batch = _value(_load(args.batch))
    state = _value(_load(args.state)) if args.state else None
    if args.pipeline:
        pipeline = _value(_load(args.pipeline))
        pipeline = pipeline if isinstance(pipeline, rp.Pipeline) else rp.Pipeline(pipeline)
    else:
        pipeline = rp.Pipeline.default(
            shard_optimizer=args.shard_optimizer,
            hierarchical=args.hierarchical,
            compress=args.compress,
            all_reduce_algorithm=args.algorithm,
        )
    repl = rp.Replicator(args.workers, args.cores, passes=pipeline)
    report = bisect_passes(repl, step_fn, batch, state, seed=args.seed, random_inputs=args.random_inputs)
    print(report)
    return 0 if report.culprit is None else 1


if __name__ == "__main__":
    sys.exit(main())
