"""A JAX-free worker that prints what real workers print around a failure (tests/test_launch_cli.py).

Every worker prints Gloo's connection lines on stdout, as jaxlib's gloo does on
every start (copied from a real 2 x 2 job), then ``hello from worker I``.

* ``--fail-worker I --flag PATH``: worker ``I`` raises ``ValueError`` (a
  traceback on stderr, exit code 1, after creating ``PATH``); every other
  worker waits for ``PATH``, then fails as a peer of a dead worker does: a deep
  traceback ending in ``JaxRuntimeError: UNKNOWN: Gloo all-reduce failed ...``.
* ``--caught``: every worker prints a traceback that it caught, then goes on
  for ``--sleep`` seconds and ends with 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

GLOO = "[Gloo] Rank {rank} is connected to {peers} peer ranks. Expected number of connected peer ranks is : {peers}"

p = argparse.ArgumentParser()
p.add_argument("--fail-worker", type=int)
p.add_argument("--flag")
p.add_argument("--caught", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()
me = int(os.environ.get("REPLICATOR_WORKER_ID", "0"))
print(GLOO.format(rank=me, peers=1), flush=True)
print(GLOO.format(rank=2 * me, peers=3), flush=True)
print(f"hello from worker {me}", flush=True)


class JaxRuntimeError(RuntimeError):
    pass


def collective(depth: int) -> None:
    if depth == 0:
        raise JaxRuntimeError(
            "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
            "[127.0.0.1]:51110: Connection reset by peer"
        )
    collective(depth - 1)


if args.caught:
    try:
        raise KeyError("a missing key, handled")
    except KeyError:
        traceback.print_exc()
    print(f"worker {me} goes on", flush=True)
    time.sleep(args.sleep)
elif args.fail_worker is not None:
    if me == args.fail_worker:
        open(args.flag, "w").close()
        raise ValueError(f"bad batch in worker {me}")
    deadline = time.monotonic() + 30
    while not os.path.exists(args.flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the failed worker has exited
    collective(10)
sys.exit(0)
