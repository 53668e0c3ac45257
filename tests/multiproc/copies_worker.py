"""Two processes, each holding one copy of every stage's row: ``check_copies_agree`` across the processes.

Run by ``tests/test_consistency.py`` as a job of 2 workers of 2 cores
(``python -m replicator.launch --num-workers 2 --cores-per-worker 2 tests/multiproc/copies_worker.py``):
a ``(stages, replicas)`` mesh whose column ``w`` is worker ``w``'s devices, so the two copies of each
stage's row sit on two processes (a data-parallel replica of a pipeline per host). With ``--drift``,
worker 1's copy of stage 0 is one ulp off. Each worker prints what the check said.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402

info = distributed.initialize()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from replicator.runtime.consistency import check_copies_agree  # noqa: E402

per_process = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
mesh = Mesh(np.array(per_process).T, ("stages", "replicas"))  # (stages = cores per worker, replicas = workers)
stages = mesh.shape["stages"]
sharding = NamedSharding(mesh, P("stages"))


def row(stage: int) -> np.ndarray:
    if "--drift" in sys.argv and info.worker_id == 1 and stage == 0:
        return np.full((1, 3), np.nextafter(np.float32(0), 1), np.float32)
    return np.full((1, 3), stage, np.float32)


index = sharding.addressable_devices_indices_map((stages, 3))
parts = [jax.device_put(row(index[d][0].start), d) for d in index]
rows = jax.make_array_from_single_device_arrays((stages, 3), sharding, parts)
try:
    check_copies_agree([rows], ["rows['float32']"])
    print(f"worker {info.worker_id}: the copies agree", flush=True)
except rp.DivergentStateError as e:
    print(f"worker {info.worker_id}: {e}", flush=True)
