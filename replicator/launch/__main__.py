"""``python -m replicator.launch``: run a multi-worker job (see :mod:`replicator.launch`).

Also installed as ``replicator-launch``.
"""

import sys

from replicator.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
