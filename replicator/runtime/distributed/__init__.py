"""Multi-worker jobs: one process per worker, across processes and hosts.

A :class:`~replicator.Replicator` spans several processes when JAX's
distributed runtime is up: worker ``w`` of the ``('workers', 'cores')`` mesh is
then process ``w``'s local devices, every process runs the same script, calls
``input_fn`` for its own worker only, and the compiled step runs on the global
mesh, with collectives crossing the process boundary (over gloo on CPU).

Write the script once; it runs as a plain single process too, where
:func:`initialize` does nothing::

    # train.py
    import numpy as np
    import jax, jax.numpy as jnp
    import replicator as rp
    from replicator.runtime import distributed

    info = distributed.initialize()  # reads what `python -m replicator.launch` set
    repl = rp.Replicator(num_workers=info.num_workers, cores_per_worker=info.cores_per_worker)

    def input_fn(ctx):  # runs in worker ctx.worker_id's process only
        rng = np.random.default_rng(ctx.worker_id)
        while True:
            yield {"x": rng.normal(size=(8 * ctx.cores_per_worker, 3)).astype(np.float32)}

    def step_fn(w, batch):
        g = rp.all_mean(jnp.mean(batch["x"], axis=0))
        return w - 0.1 * g, {"g": g, "rid": rp.replica_id()}

    w = jnp.zeros(3)  # from the host: every worker starts from worker 0's copy
    for _ in range(10):
        w, out = repl.run(step_fn, input_fn, w)
    print(np.asarray(w))  # state is replicated: every worker can read it
    print(distributed.local_outputs(out)["rid"])  # this worker's replicas, e.g. [4 5 6 7]
    print(distributed.replica_invariant(out)["g"])  # the one value of an output equal on all replicas
    print(distributed.gather_outputs(out)["rid"])  # every replica's row, on every worker

and start it with two workers of four emulated CPU devices each::

    python -m replicator.launch --num-workers 2 --cores-per-worker 4 train.py

On several hosts, start one worker per host with ``--coordinator HOST:PORT
--worker-id I --num-workers W``; under SLURM or Open MPI (``srun``,
``mpirun``) :func:`initialize` with no arguments lets JAX read the cluster's
environment.

Modules: :mod:`~replicator.runtime.distributed.startup` (settings,
:func:`initialize`, failing fast), :mod:`~replicator.runtime.distributed.status`
(how a worker tells the launcher why it failed),
:mod:`~replicator.runtime.distributed.agreement` (checking that workers hold
the same values), :mod:`~replicator.runtime.distributed.outputs` (reading
outputs on the host).

Promises:

1. Every name in ``__all__`` is importable from the package, the same object its module defines (startup's
   public names, ``check_same_across_workers``, the output readers, ``ENV_STATUS_DIR``)
   (tests/test_distributed.py::test_the_package_exports_every_name_it_lists_as_its_modules_define_them).
2. A script written for several workers runs as a plain single process: ``initialize()`` without settings
   returns a one-worker ``WorkerInfo`` and starts nothing
   (tests/test_distributed.py::TestInitialize::test_single_process_without_settings).
3. The same script under ``python -m replicator.launch`` with two workers trains to the numbers of one process
   holding every device (tests/test_distributed.py::TestTwoProcesses::test_same_result_as_one_process).
"""

from replicator.runtime.distributed import startup
from replicator.runtime.distributed.agreement import check_same_across_workers
from replicator.runtime.distributed.outputs import gather_outputs, local_outputs, replica_invariant

# The job's settings (the REPLICATOR_* variables, the default timeouts), initialize() and
# shutdown(): startup's public names, listed once, in startup.__all__.
from replicator.runtime.distributed.startup import *  # noqa: F403
from replicator.runtime.distributed.status import ENV_STATUS_DIR

__all__ = [
    *startup.__all__,
    "ENV_STATUS_DIR",
    "check_same_across_workers",
    "gather_outputs",
    "local_outputs",
    "replica_invariant",
]
