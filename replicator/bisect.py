"""``python -m replicator.bisect``: name the first optional pass that changes a step's result.

The command line of :func:`replicator.passes.bisect.bisect_passes` (see there).
It prints the report and exits with status 1 when a pass changes the result::

    python -m replicator.bisect my_train.py:step_fn --batch my_train.py:input_fn \\
        --state my_train.py:init_state --workers 1 --cores 8 --cpu-devices 8 --shard-optimizer

``STEP``, ``--batch``, ``--state`` and ``--pipeline`` name ``MODULE:NAME`` or
``FILE.py:NAME``; a function of no arguments is called for its value.
"""

import sys

from replicator.passes.bisect import BisectReport, bisect_passes, main

__all__ = ["BisectReport", "bisect_passes", "main"]

if __name__ == "__main__":
    sys.exit(main())
