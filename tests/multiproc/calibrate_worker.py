"""One worker of a job that calibrates the cost model across processes (test_distributed.py).

``python -m replicator.launch --num-workers 2 --cores-per-worker C
tests/multiproc/calibrate_worker.py --out DIR`` runs
``rp.tools.calibrate(2, C)`` in every worker, over the mesh whose ``'workers'``
axis crosses the process boundary, and writes what it fitted to
``DIR/w{I}_topology.json``: every worker must get the same figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replicator.runtime import distributed  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

info = distributed.initialize()
from replicator.tools.calibrate import calibrate  # noqa: E402

# Payloads large enough that one psum stands out of the noise of a loaded machine.
topo = calibrate(info.num_workers, info.cores_per_worker, sizes=(256 * 2**10, 2**20, 4 * 2**20), repeats=3, chain=2)
figures = {
    "links": {k: dataclasses.asdict(getattr(topo, k)) for k in ("cores", "workers", "p2p_cores", "p2p_workers")},
    "measurements": [dataclasses.asdict(m) for m in topo.measurements],
    "source": topo.source,
    "compute": dataclasses.asdict(topo.compute),  # process 0's, as the links
}
(Path(args.out) / f"w{info.worker_id}_topology.json").write_text(json.dumps(figures))
