"""``python -m replicator.launch``: start one worker process per host slot (see
:mod:`replicator.runtime.launch`); also installed as ``replicator-launch``."""

import sys

from replicator.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
