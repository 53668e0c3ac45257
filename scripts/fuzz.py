"""Long runs of the differential fuzzer (the test suite runs a fixed-seed sample).

Every program runs under each pass-manager variant on a 2 x 4 and a 1 x 8 mesh of
8 emulated CPU devices and is compared with all replicas simulated at once on
one device (``tests/fuzz/programs.py``). Prints what it checked and every
failure with the seed that reproduces it.

Usage::

    python scripts/fuzz.py --programs 2000 --seed 0
    python scripts/fuzz.py --programs 50 --variants default,zero
    python scripts/fuzz.py --only 1234 --variants zero       # one program again
    python scripts/fuzz.py --pipelines --programs 500         # pipelined training steps (tests/fuzz/pipelines.py)
    python scripts/fuzz.py --pipelines --only 7 --variants pipe-S4-M8-1f1b
    python scripts/fuzz.py --programs 50 --variants tensor2-sp,tensor4-sp-zero3   # programs with a 3-d block
    python scripts/fuzz.py --pipelines --programs 50 --variants pipe-S2-M4-1f1b-tensor2   # stages x tensor

A tensor variant's summary also says in how many runs its split step held an all-reduce, a
reduce-scatter and an all-gather over 'tensor' (sequence parallelism: the latter two).

XLA compiles with its optimizations off (``_jax_compat.fast_compile_xla_flags``, as in
the tests); ``REPLICATOR_FUZZ_XLA_DEFAULTS=1`` keeps XLA's defaults.

Ctrl-C or SIGTERM stops a long run after the program under way and prints the
summary of what it checked (a second signal stops at once).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import replicator as rp  # noqa: E402
from replicator._jax_compat import with_fast_compile_flags  # noqa: E402

# Both sides of every comparison compile with XLA's optimizations off (cheaper
# compilation; REPLICATOR_FUZZ_XLA_DEFAULTS=1 keeps XLA's defaults).
if os.environ.get("REPLICATOR_FUZZ_XLA_DEFAULTS") != "1":
    os.environ["XLA_FLAGS"] = with_fast_compile_flags(os.environ.get("XLA_FLAGS", ""))
rp.force_cpu_devices(8)

from tests.fuzz.differential import MESHES, TENSOR_MESHES, VARIANTS, run_program  # noqa: E402
from tests.fuzz.pipelines import PIPE_MESHES, PIPE_VARIANTS  # noqa: E402
from tests.fuzz.pipelines import run_program as run_pipeline_program  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="the first program's seed; the others follow")
    p.add_argument("--only", type=int, help="run just the program with this seed")
    p.add_argument("--variants", help=f"comma-separated, of {list(VARIANTS)} (with --pipelines: {list(PIPE_VARIANTS)})")
    p.add_argument(
        "--pipelines",
        action="store_true",
        help="random pipelined training steps against one device (tests/fuzz/pipelines.py), each on one mesh of "
        f"its stage count in turn ({PIPE_MESHES})",
    )
    args = p.parse_args(argv)
    known = PIPE_VARIANTS if args.pipelines else VARIANTS
    variants = args.variants.split(",") if args.variants else list(known)
    unknown = set(variants) - set(known)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {list(known)}")
    meshes = "one mesh per program and stage count" if args.pipelines else f"{len(MESHES)} meshes"
    run = run_pipeline_program if args.pipelines else run_program
    seeds = [args.only] if args.only is not None else range(args.seed, args.seed + args.programs)
    checked: collections.Counter = collections.Counter()
    executions: collections.Counter = collections.Counter()
    sensitive: collections.Counter = collections.Counter()
    failures = []
    start = time.time()
    done, stopped = 0, ""
    stop: list[int] = []

    def request_stop(signum, frame) -> None:
        if stop:  # a second signal: stop now
            raise KeyboardInterrupt
        stop.append(signum)
        print("stopping after the program under way (signal again to stop now)", flush=True)

    # Ctrl-C or SIGTERM ends a long run after the program under way, with the summary so far.
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    where: object = PIPE_MESHES if args.pipelines else MESHES
    if not args.pipelines and any("tensor" in VARIANTS[v] for v in variants):
        where = f"{MESHES}, the tensor variants on data meshes {TENSOR_MESHES} (T devices per replica)"
    print(f"fuzzing {len(seeds)} programs from seed {seeds[0]}, variants {variants}, meshes {where}", flush=True)
    try:
        for n, seed in enumerate(seeds, 1):
            for outcome in run(seed, variants, stats=executions):
                checked[outcome.variant] += 1
                if outcome.order_sensitive:
                    sensitive[outcome.variant] += 1
                    print(
                        f"{outcome} (passes within the reference's rounding sensitivity; base comparison: "
                        f"{outcome.order_sensitive})",
                        flush=True,
                    )
                if not outcome.ok:
                    failures.append(outcome)
                    print(outcome, flush=True)
            done = n
            if n % 10 == 0:
                print(f"... {n} programs, {len(failures)} failures, {time.time() - start:.0f} s", flush=True)
            if stop:
                stopped = " (stopped by a signal)"
                break
    except KeyboardInterrupt:
        stopped = " (stopped by a second signal; the runs of the program under way are counted below)"
    seen = f"seeds {seeds[0]}..{seeds[0] + done - 1}" if done else "none complete"
    print(f"\nchecked {done} programs ({seen}) x {meshes} in {time.time() - start:.0f} s{stopped}")
    print(
        f"  {executions['runs']} variant runs executed {executions['graphs']} distinct final graphs "
        "(variants whose passes produced an identical graph share its execution)"
    )
    for v in variants:
        bad = [f for f in failures if f.variant == v]
        crashes = sum(1 for f in bad if f.error)
        print(
            f"  {v:<14} {checked[v]:>6} runs  {len(bad) - crashes:>4} mismatches  {crashes:>4} crashes"
            f"  {sensitive[v]:>4} within the reference's rounding sensitivity"
        )
        tensor = PIPE_VARIANTS[v].tensor > 1 if args.pipelines else "tensor" in VARIANTS[v]
        if tensor:  # which collectives over 'tensor' the runs held
            kinds = ("all-reduce", "reduce-scatter", "all-gather")
            held = ", ".join(f"{k} in {executions[f'{v} {k}']}" for k in kinds)
            print(f"  {'':<14} runs with a collective over 'tensor': {held}")
    reference_errors = [f for f in failures if f.variant == "reference"]
    if reference_errors:
        print(f"  reference errors (generator bugs): {len(reference_errors)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
