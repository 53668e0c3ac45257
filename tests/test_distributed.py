"""Multi-worker jobs: ``replicator.runtime.distributed`` in one process, then real jobs.

The tests marked ``multiprocess`` start real worker processes on localhost
(``python -m replicator.launch ... tests/multiproc/train.py``), each bounded by
a subprocess timeout: the job gives the same result as one process, collectives
over ``group='cores'`` / ``'workers'`` cross the process boundary correctly, and
every kind of failure ends the job within a bound instead of hanging it. Run
only them with ``pytest -m multiprocess``, skip them with ``-m 'not
multiprocess'``. Measured times are printed (see them with ``-s``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.launch import free_port
from replicator.runtime import distributed
from replicator.runtime.distributed import startup, status
from replicator.runtime.distributed.outputs import _SHOWN
from replicator.runtime.mesh import _rows_by_process

ROOT = Path(__file__).resolve().parent.parent
TRAIN = Path(__file__).resolve().parent / "multiproc" / "train.py"
CALIBRATE = Path(__file__).resolve().parent / "multiproc" / "calibrate_worker.py"
ZERO3 = Path(__file__).resolve().parent / "multiproc" / "zero3_worker.py"
PIPELINE = Path(__file__).resolve().parent / "multiproc" / "pipeline_worker.py"
STEPS = 20
JOB_TIMEOUT_S = 120  # no multi-process test may take longer, whatever goes wrong


@pytest.fixture
def fresh(monkeypatch):
    """No job settings in the environment and nothing initialized yet."""
    for name in list(os.environ):
        if name.startswith(("REPLICATOR_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(startup, "_INFO", None)


class TestInitialize:
    def test_single_process_without_settings(self, fresh):
        info = distributed.initialize()
        assert info == distributed.WorkerInfo(0, 1, None, None, "single-process")
        assert not info.is_multiprocess and distributed.is_initialized()
        assert distributed.initialize() is info  # idempotent
        with pytest.raises(RuntimeError, match="already ran in this process with num_workers=1"):
            distributed.initialize("127.0.0.1:1234", 2, 0)

    def test_one_worker_from_the_launcher_needs_no_runtime(self, fresh, monkeypatch, n_devices):
        monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
        monkeypatch.setenv(distributed.ENV_NUM_WORKERS, "1")
        monkeypatch.setenv(distributed.ENV_WORKER_ID, "0")
        monkeypatch.setenv(distributed.ENV_CORES_PER_WORKER, str(n_devices))
        info = distributed.initialize()
        assert (info.worker_id, info.num_workers, info.cores_per_worker, info.source) == (0, 1, n_devices, "launcher")

    @pytest.mark.parametrize(
        "args, message",
        [
            (("127.0.0.1:1234", 2, None), "worker_id missing"),
            ((None, 2, 1), "coordinator_address missing.*replicator.launch"),
            (("127.0.0.1", 2, 0), "is not HOST:PORT"),
            (("127.0.0.1:1234", 2, 2), r"worker_id must be an int in \[0, 2\)"),
        ],
    )
    def test_bad_settings_say_what_to_set(self, fresh, args, message):
        with pytest.raises(ValueError, match=message):
            distributed.initialize(*args)

    def test_bad_timeout(self, fresh):
        with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive number"):
            distributed.initialize("127.0.0.1:1234", 2, 0, heartbeat_timeout_s=0)

    def test_after_jax_started_says_to_call_it_first(self, fresh):
        jax.devices()
        with pytest.raises(RuntimeError, match="must run before JAX starts its backend.*top of your script"):
            distributed.initialize("127.0.0.1:1234", 2, 0)

    def test_uncaught_exceptions_are_reported_to_the_launcher(self, fresh, monkeypatch, tmp_path):
        # A one-worker job under the launcher: the hook reports, then hands over to the previous one.
        seen = []
        monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[0]))
        monkeypatch.setenv(distributed.ENV_STATUS_DIR, str(tmp_path))
        monkeypatch.setenv(distributed.ENV_NUM_WORKERS, "1")
        monkeypatch.setenv(distributed.ENV_WORKER_ID, "0")
        assert distributed.initialize().source == "launcher"
        sys.excepthook(ValueError, ValueError("bad batch"), None)
        report = status.read_status(str(tmp_path), 0)
        assert (report["kind"], report["exception_type"], report["message"]) == ("exception", "ValueError", "bad batch")
        assert report["first_failure"] and not report["runtime_error"]
        error = jax.errors.JaxRuntimeError("INTERNAL: a peer is gone")
        sys.excepthook(type(error), error, None)  # a second failure: not the first, and from JAX's runtime
        report = status.read_status(str(tmp_path), 0)
        assert report["exception_type"] == "jax.errors.JaxRuntimeError" and report["runtime_error"]
        assert not report["first_failure"]
        assert seen == [ValueError, jax.errors.JaxRuntimeError]

    def test_no_report_without_the_launcher(self, fresh, monkeypatch):
        hook = sys.excepthook
        distributed.initialize()
        assert sys.excepthook is hook

    def test_cluster_detection(self):
        assert distributed.cluster_environment({}) is None
        assert distributed.cluster_environment({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"}) == "ompi"
        partial_slurm = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}  # e.g. salloc without srun
        assert distributed.cluster_environment(partial_slurm) is None


class TestOutputsInOneProcess:
    def test_local_outputs_replica_invariant_gather(self, repl2d):
        n = repl2d.num_replicas

        def input_fn(ctx):
            while True:
                yield {"x": np.arange(ctx.cores_per_worker, dtype=np.float32) + 100 * ctx.worker_id}

        out = repl2d.run(lambda b: {"rid": rp.replica_id(), "m": rp.all_mean(b["x"][0])}, input_fn)
        local = distributed.local_outputs(out)
        assert isinstance(local["rid"], np.ndarray)
        np.testing.assert_array_equal(local["rid"], np.arange(n))  # one process holds every replica
        np.testing.assert_array_equal(distributed.gather_outputs(out)["rid"], np.arange(n))
        invariant = distributed.replica_invariant({"m": out["m"]})
        want = np.mean(np.arange(repl2d.cores_per_worker)) + 100 * np.mean(np.arange(repl2d.num_workers))
        assert invariant["m"].shape == () and invariant["m"] == pytest.approx(want)
        if n > 1:  # the replica ids differ: reading one of them as "the" value is an error
            shown = list(range(1, n))[:_SHOWN]  # the message lists the first _SHOWN, then "..."
            more = " ..." if n - 1 > _SHOWN else ""
            want = f"output 'rid' is not the same on every replica: replica(s) {shown}{more} differ from replica 0"
            with pytest.raises(ValueError, match=re.escape(want) + ".*rp.local_outputs"):
                distributed.replica_invariant(out)

    def test_replica_invariant_returns_a_replicated_state_leaf_whole(self, repl2d):
        """The new state of a run has no replica axis: its leaves come back whole (before, a (3,) leaf of zeros
        was read as 3 replicas' rows and its first element returned, silently; a (3,) leaf of other values was
        an error); the outputs beside it still give one row."""
        state = {"w": np.zeros(3, np.float32), "b": np.arange(4, dtype=np.float32), "n": np.int32(2)}

        def step(s, batch):
            return {**s, "b": s["b"] + rp.all_mean(batch["x"][0])}, {"m": rp.all_mean(batch["x"][0])}

        new, out = repl2d.run(step, {"x": np.ones((repl2d.num_replicas, 1), np.float32)}, state)
        got = distributed.replica_invariant(new)
        assert {k: np.shape(v) for k, v in got.items()} == {"w": (3,), "b": (4,), "n": ()}
        np.testing.assert_array_equal(got["b"], np.arange(4, dtype=np.float32) + 1)
        np.testing.assert_array_equal(got["w"], np.zeros(3, np.float32))
        assert distributed.replica_invariant(out)["m"].shape == (1,)  # one replica's row of (R, 1)

    def test_replica_invariant_compares_bits(self):
        nan_rows = np.tile(np.array([1.0, np.nan], np.float32), (3, 1))
        np.testing.assert_array_equal(distributed.replica_invariant({"a": nan_rows})["a"], nan_rows[0])
        with pytest.raises(ValueError, match=r"output 'z.1' .* replica\(s\) \[1, 3\] differ from replica 0"):
            distributed.replica_invariant({"z": (np.zeros(4), np.array([0.0, -0.0, 0.0, -0.0]))})
        with pytest.raises(ValueError, match="has no leading replica axis"):
            distributed.replica_invariant(np.float32(1.0))


class TestSameAcrossWorkers:
    def test_one_process_compares_nothing(self, monkeypatch):
        from jax.experimental import multihost_utils

        monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: pytest.fail("no collective in one process"))
        assert distributed.check_same_across_workers([np.ones(2), "a"], ["x", "y"], what="x", fix="") is None

    @pytest.mark.parametrize("theirs", ["step A", "step B"])
    def test_workers_are_compared_with_worker_0(self, monkeypatch, theirs):
        # Two processes, faked: the allgather returns this process's digests and worker 1's.
        from jax.experimental import multihost_utils

        monkeypatch.setattr(jax, "process_count", lambda: 2)
        sent = []

        def allgather(local, other=None):
            sent.append(local)
            return np.stack([local, local if other is None else other])

        def check(values, other=None):
            monkeypatch.setattr(multihost_utils, "process_allgather", lambda local: allgather(local, other))
            distributed.check_same_across_workers(values, ["x", "y"], what="the compiled step", fix="Run the same.")

        check([np.ones(2), theirs])  # worker 1's digests, as it would send them
        if theirs == "step A":
            check([np.ones(2), "step A"], other=sent[0])
        else:
            with pytest.raises(ValueError, match=r"the compiled step differs between workers: y on worker\(s\) \[1\]"):
                check([np.ones(2), "step A"], other=sent[0])
        assert len(sent) == 2


def fake_devices(per_process: list[int]) -> list:
    return [
        SimpleNamespace(process_index=p, id=2048 * p + i, platform="cpu")
        for p, n in enumerate(per_process)
        for i in range(n)
    ]


class TestMeshOverProcesses:
    def test_worker_w_is_process_w(self):
        rows = _rows_by_process(fake_devices([4, 4]), 2, 4, 2)
        assert [[d.id for d in r] for r in rows] == [[0, 1, 2, 3], [2048, 2049, 2050, 2051]]

    def test_several_workers_per_process(self):
        rows = _rows_by_process(fake_devices([4, 4]), 4, 2, 2)
        assert [[d.process_index for d in r] for r in rows] == [[0, 0], [0, 0], [1, 1], [1, 1]]

    @pytest.mark.parametrize(
        "per_process, workers, cores, processes, message",
        [
            ([4, 4], 3, 2, 2, "does not split evenly over the job's 2 processes.*num_workers=2"),
            ([4, 2], 2, 4, 2, r"process\(es\) \[1\] have only \[2\].*--cores-per-worker"),
            ([4], 1, 4, 2, "cover process.*every process runs the step"),
        ],
    )
    def test_errors(self, per_process, workers, cores, processes, message):
        with pytest.raises(ValueError, match=message):
            _rows_by_process(fake_devices(per_process), workers, cores, processes)


# -- real multi-process jobs ---------------------------------------------------------


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPLICATOR_", "SLURM_", "OMPI_"))}
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count per worker
    return env


def launcher(*options: str) -> list[str]:
    return [sys.executable, "-m", "replicator.launch", *options]


def run_job(*options: str, train_args: tuple[str, ...] = (), timeout: float = JOB_TIMEOUT_S, script: Path = TRAIN):
    """Run one launcher of ``script`` (default ``train.py``); returns (completed process, the time it ended)."""
    proc = subprocess.run(
        [*launcher(*options), str(script), *train_args],
        env=job_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.time()


def died_at(stdout: str, stderr: str) -> float:
    match = re.search(r"dying at ([0-9.]+)", stdout)
    assert match, f"the worker never reached the failure step:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return float(match.group(1))


def load(directory: Path, worker: int) -> dict[str, np.ndarray]:
    prefix = f"w{worker}_"
    return {p.stem[len(prefix) :]: np.load(p) for p in directory.glob(f"{prefix}*.npy")}


def worker_module(path: Path = TRAIN, name: str = "multiproc_train"):
    """A worker script, imported (for its reference run and its settings)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_probe(workers: int, cores: int, probe_batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the probe's collectives return, from their definitions and the probe's batch."""
    rid = np.arange(workers * cores)
    w, c = np.divmod(rid, cores)
    by_core = [rid[c == k] for k in range(cores)]  # replicas with the same core index
    by_worker = [rid[w == k] for k in range(workers)]
    s = probe_batch["x"].reshape(rid.size, -1).sum(axis=1)  # replica r's rows, summed
    return {
        "mean_all": np.full(rid.size, s.mean()),
        "mean_cores": np.array([s[by_worker[k]].mean() for k in w]),
        "mean_workers": np.array([s[by_core[k]].mean() for k in c]),
        "rid": rid,
        "rid_cores": c,
        "rid_workers": w,
        "sum_all": np.full_like(rid, rid.sum()),
        "sum_cores": np.array([by_worker[k].sum() for k in w]),
        "sum_workers": np.array([by_core[k].sum() for k in c]),
        "max_cores": np.array([by_worker[k].max() for k in w]),
        "min_workers": np.array([by_core[k].min() for k in c]),
        "gather_all": np.tile(rid, (rid.size, 1)),
        "gather_cores": np.stack([by_worker[k] for k in w]),
        "gather_workers": np.stack([by_core[k] for k in c]),
        "bcast_workers": np.array([10 * by_core[k][-1] for k in c]),
    }


def run_per_worker_launchers(options: tuple, train_args: tuple) -> tuple[list, list]:
    """Two workers, one launcher each (as on separate hosts); both waited for, bounded."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                *launcher("--coordinator", f"127.0.0.1:{port}", "--num-workers", "2", "--worker-id", str(w)),
                *options,
                str(TRAIN),
                *train_args,
            ],
            env=job_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=JOB_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return procs, outs


@pytest.mark.multiprocess
class TestTwoProcesses:
    def test_same_result_as_one_process(self, tmp_path, n_devices):
        if n_devices % 2 or n_devices < 2:
            pytest.skip(f"{n_devices} devices do not split into 2 workers")
        cores = n_devices // 2
        start = time.time()
        proc, end = run_job(
            "--num-workers",
            "2",
            "--cores-per-worker",
            str(cores),
            train_args=("--out", str(tmp_path), "--steps", str(STEPS)),
        )
        assert proc.returncode == 0, proc.stderr[-5000:]
        print(f"\n2 processes x {cores} devices, {STEPS} steps: job took {end - start:.1f} s")
        results = [load(tmp_path, w) for w in (0, 1)]

        train = worker_module()
        one_process = train.run(rp.Replicator(1, n_devices), STEPS)  # the reference: one process, all devices
        want_probe = expected_probe(2, cores, train.global_batch(train.PROBE_STEP))
        for w, got in enumerate(results):
            params = sorted(k for k in got if k.startswith("param_"))
            assert params == sorted(k for k in one_process if k.startswith("param_")) and params
            for k in [*params, "losses"]:
                np.testing.assert_allclose(got[k], one_process[k], atol=1e-6, rtol=0, err_msg=f"worker {w}: {k}")
            for k in params:  # the state is replicated: identical bits on every worker
                np.testing.assert_array_equal(got[k], results[0][k])
            # Collectives over each group, across the process boundary.
            for k, want in want_probe.items():
                if k.startswith("mean_"):
                    np.testing.assert_allclose(got[f"probe_{k}"], want, rtol=0, atol=1e-5, err_msg=k)
                else:
                    np.testing.assert_array_equal(got[f"probe_{k}"], want, err_msg=k)
            # The helpers: this worker's rows; a value equal on every replica, and one that is not.
            mine = list(range(w * cores, (w + 1) * cores))
            np.testing.assert_array_equal(got["local_rid"], mine)
            assert got["invariant_sum_all"] == sum(range(2 * cores))
            if cores > 1:
                assert f"replica(s) {mine[1:]} differ from replica {mine[0]}" in str(got["varying_error"])

    def test_calibrate_across_two_processes_gives_every_worker_the_same_figures(self, tmp_path, n_devices):
        # The 'workers' axis crosses the process boundary; process 0's clock and medians decide.
        if n_devices % 2 or n_devices < 4:
            pytest.skip(f"{n_devices} devices do not split into 2 workers of 2 or more cores")
        proc, _ = run_job(
            "--num-workers", "2", "--cores-per-worker", str(n_devices // 2),
            train_args=("--out", str(tmp_path)), script=CALIBRATE,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:]
        got = [json.loads((tmp_path / f"w{w}_topology.json").read_text()) for w in (0, 1)]
        assert got[0] == got[1]
        sizes = {(m["axis"], m["group_size"]) for m in got[0]["measurements"]}
        assert sizes == {("cores", n_devices // 2), ("workers", 2)}
        assert f"calibrate(2, {n_devices // 2}) on {n_devices} cpu device(s)" in got[0]["source"]

    def test_folded_replicas_across_two_processes(self, tmp_path, n_devices):
        # 2 processes x n/4 devices, 2 replicas per device: the same 2 x n/2 replicas as above.
        if n_devices % 4:
            pytest.skip(f"{n_devices} devices do not split into 2 workers of 2 replicas per device")
        cores = n_devices // 2
        proc, _ = run_job(
            "--num-workers", "2", "--cores-per-worker", str(n_devices // 4),
            train_args=("--out", str(tmp_path), "--steps", str(STEPS), "--replicas-per-device", "2"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert f"mesh {{'workers': 2, 'cores': {n_devices // 4}}}" in proc.stdout, proc.stdout[-2000:]
        train = worker_module()
        one_process = train.run(rp.Replicator(1, n_devices), STEPS)  # one replica per device
        want_probe = expected_probe(2, cores, train.global_batch(train.PROBE_STEP))
        for w in (0, 1):
            got = load(tmp_path, w)
            for k in [k for k in one_process if k.startswith("param_")] + ["losses"]:
                np.testing.assert_allclose(got[k], one_process[k], atol=1e-6, rtol=0, err_msg=f"worker {w}: {k}")
            for k, want in want_probe.items():
                np.testing.assert_allclose(got[f"probe_{k}"], want, rtol=0, atol=1e-5, err_msg=k)
            np.testing.assert_array_equal(got["local_rid"], list(range(w * cores, (w + 1) * cores)))

    def test_zero_stage_3_across_two_processes_equals_one_device(self, tmp_path, n_devices):
        # 2 processes x n/2 devices, every parameter and Adam's state stored 1/N per device
        # (split over both processes): 3 steps equal one-device jax.jit on the global batch.
        if n_devices % 2 or n_devices < 2:
            pytest.skip(f"{n_devices} devices do not split into 2 workers")
        proc, _ = run_job(
            "--num-workers", "2", "--cores-per-worker", str(n_devices // 2),
            train_args=("--out", str(tmp_path)), script=ZERO3,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:]
        worker = worker_module(ZERO3, "multiproc_zero3")
        want, want_losses = worker.reference()
        params, _ = worker.init_state()
        for w in (0, 1):
            got = load(tmp_path, w)
            # the 4 parameters, Adam's mu and nu of each: split over both processes (Adam's counter is not)
            assert int(got["split"]) == 3 * len(params), got["split"]
            moved = zip(want[: len(params)], jax.tree.leaves(params), strict=True)  # params come first
            assert max(float(np.max(np.abs(a - b))) for a, b in moved) > 1e-3  # the check below can fail
            for i, x in enumerate(want):
                np.testing.assert_allclose(got[f"final_{i}"], x, atol=5e-5, rtol=0, err_msg=f"worker {w}: leaf {i}")
            np.testing.assert_allclose(got["losses"], want_losses, atol=5e-5, rtol=0)

    @pytest.mark.parametrize(
        "cores, flags",
        [
            (1, ("--host-state",)),
            (2, ()),
            (1, ("--input-fn",)),
            (2, ("--own-step", "--zero", "2", "--host-state")),
            (2, ("--tensor", "2", "--host-state")),
            (4, ("--tensor", "2", "--zero", "3")),
        ],
        ids=[
            "a-stage-per-process-state-through-host",
            "a-pipeline-per-process",
            "an-input-fn-per-worker",
            "the-users-step-zero2-chunks-across-processes",
            "a-stage-per-process-each-over-tensor-2",
            "a-pipeline-per-process-over-tensor-2-zero3",
        ],
    )
    def test_a_pipeline_across_two_processes_equals_one_device(self, tmp_path, n_devices, cores, flags):
        # 2 stages: one core per worker puts one stage in each process (the activations and cotangents cross
        # the process boundary); two cores per worker put a whole pipeline in each, a data-parallel replica of
        # the other. With the state through the host, every step unpacks the returned leaves and packs them
        # again (a stage on the other process read by slicing the global rows gave wrong values, silently).
        # With an input_fn, each worker yields its rows and every process joins them into the global batch.
        # The user's own step under ZeRO-2 with a pipeline per process: each leaf's chunks split over the two
        # processes (D = 2), the state through the host so that every step gathers and splits them again.
        # With the tensor axis (within a process): 2 cores per worker and T = 2 put one stage in each process,
        # its layers split over the process's two devices; 4 cores put a pipeline of 2 stages x tensor 2 in
        # each, a data-parallel replica of the other (ZeRO-3's chunks across the processes).
        if n_devices < 2 * cores:
            pytest.skip(f"{n_devices} devices do not make 2 workers of {cores} cores")
        proc, _ = run_job(
            "--num-workers", "2", "--cores-per-worker", str(cores),
            train_args=("--out", str(tmp_path), "--stages", "2", *flags), script=PIPELINE,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:]
        worker = worker_module(PIPELINE, "multiproc_pipeline")
        want, want_losses = worker.reference()
        moved = zip(want, jax.tree.leaves(worker.init_params()), strict=True)
        assert max(float(np.max(np.abs(a - b))) for a, b in moved) > 1e-3  # the check below can fail
        for w in (0, 1):
            got = load(tmp_path, w)
            for i, x in enumerate(want):
                np.testing.assert_allclose(got[f"final_{i}"], x, atol=2e-5, rtol=0, err_msg=f"worker {w}: leaf {i}")
            np.testing.assert_allclose(got["losses"], want_losses, atol=2e-5, rtol=0)

    def test_checkpoints_move_between_one_and_two_processes(self, tmp_path, n_devices):
        # One chain covers both directions with a single job: one process trains and saves
        # after step k1; a 2-process job resumes from it (b), saves after step k2, with
        # Adam's mu/nu sharded over both processes (ZeRO-1), and trains to the end; one
        # process resumes from that checkpoint (a) and trains to the end. Both ends equal
        # the uninterrupted single-process run.
        if n_devices % 2 or n_devices < 2:
            pytest.skip(f"{n_devices} devices do not split into 2 workers")
        cores, k1, k2 = n_devices // 2, 8, 14
        one, two = tmp_path / "ckpt_one_process", tmp_path / "ckpt_two_processes"
        train = worker_module()
        reference = train.run(rp.Replicator(1, n_devices), STEPS, save_at=k1, ckpt=one)  # uninterrupted
        assert rp.latest_step(one) == k1

        start = time.time()
        proc, end = run_job(
            "--num-workers", "2", "--cores-per-worker", str(cores),
            train_args=(
                "--out", str(tmp_path / "job"), "--steps", str(STEPS),
                "--resume", str(one), "--save-at", str(k2), "--ckpt", str(two), "--zero",
            ),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:]
        print(f"\n2 processes x {cores} devices, resumed at step {k1}, saved at {k2}: job took {end - start:.1f} s")
        for w in (0, 1):
            # ".*": a worker's line may begin with an unterminated message of Gloo's (its threads
            # write "[Gloo] Rank 0 is connected ..." without newlines)
            resumed = rf"\[worker {w}\] .*resumed from step {k1} of {re.escape(str(one))}"
            assert re.search(resumed, proc.stdout), proc.stdout[-3000:]
            split = re.search(
                rf"\[worker {w}\] .*saved step {k2} to \S+ \((\d+) leaves sharded over processes\)", proc.stdout
            )
            assert split, proc.stdout[-3000:]
            assert int(split.group(1)) > 0  # the gather across processes was exercised
        assert sorted(os.listdir(two)) == [f"step_{k2:08d}"]  # one writer, committed, nothing left over

        resumed = train.run(rp.Replicator(1, n_devices), STEPS, resume=two)
        job = [load(tmp_path / "job", w) for w in (0, 1)]
        params = sorted(k for k in reference if k.startswith("param_"))
        assert params
        for name, got, first in [("worker 0", job[0], k1), ("worker 1", job[1], k1), ("one process", resumed, k2)]:
            for k in params:
                np.testing.assert_allclose(got[k], reference[k], atol=1e-6, rtol=0, err_msg=f"{name}: {k}")
            np.testing.assert_allclose(
                got["losses"], reference["losses"][first:], atol=1e-6, rtol=0, err_msg=f"{name}: losses"
            )
            opt = sorted(k for k in reference if k.startswith("opt_"))
            assert opt and opt == sorted(k for k in got if k.startswith("opt_"))
            for k in opt:  # the whole optimizer state, read on each process (sharded over both in the job)
                np.testing.assert_allclose(got[k], reference[k], atol=1e-6, rtol=0, err_msg=f"{name}: {k}")

    def test_a_save_that_fails_on_worker_0_fails_on_every_worker(self, tmp_path):
        # Worker 0 cannot write (the directory has a later step): worker 1, waiting for the
        # commit, must not go on as if it were saved, nor hang. One launcher per worker, so
        # that neither is stopped by the other's failure before it says why it failed.
        ckpt = tmp_path / "ckpt"
        train = worker_module()
        params = train.init_params()
        rp.save_checkpoint(ckpt, 30, (params, train.tx.init(params)))
        procs, outs = run_per_worker_launchers(
            ("--cores-per-worker", "2"),
            ("--out", str(tmp_path), "--steps", "4", "--save-at", "2", "--ckpt", str(ckpt)),
        )
        assert [p.returncode for p in procs] == [1, 1], [err[-3000:] for _, err in outs]
        later = r"CheckpointError: '.*ckpt' already has checkpoints of later steps \[30\]"
        assert re.search(r"\[worker 0\] replicator(\.\w+)*\." + later, outs[0][1]), outs[0][1][-3000:]
        assert re.search(
            r"\[worker 1\] replicator(\.\w+)*\.CheckpointError: process 0 failed to save the checkpoint "
            r".*step_00000002: " + later,
            outs[1][1],
        ), outs[1][1][-3000:]
        assert "saved step" not in outs[0][0] + outs[1][0]
        assert sorted(os.listdir(ckpt)) == ["step_00000030"]  # nothing written, nothing left over

    @pytest.mark.parametrize("how", ["kill", "raise"])
    def test_a_failed_worker_stops_the_job(self, tmp_path, how):
        # Worker 1 is SIGKILLed or raises at step 5: the launcher names it, stops the
        # others and exits with its code, within the kill grace period (5 s) and margin.
        proc, end = run_job(
            "--num-workers", "2", "--cores-per-worker", "2",
            train_args=("--out", str(tmp_path), "--steps", "100000", "--die-at-step", "5", "--die-how", how),
        )  # fmt: skip
        delay = end - died_at(proc.stdout, proc.stderr)
        print(f"\nworker 1 {how}: the launcher exited {delay:.2f} s later")
        if how == "kill":
            assert proc.returncode == 137, proc.stderr[-3000:]
            assert "[launcher] worker 1 was killed by SIGKILL" in proc.stderr
        else:
            assert proc.returncode == 1, proc.stderr[-3000:]
            assert re.search(
                r"\[launcher\] worker 1 failed with exit code 1 after .*RuntimeError: injected failure in worker 1",
                proc.stderr,
            )
        assert delay < 15, delay

    def test_a_hung_worker_is_dropped_after_the_heartbeat_timeout(self, tmp_path):
        # Worker 1 freezes (SIGSTOP: no exit, no closed socket, like a hung host). The
        # others notice the missing heartbeats and abort; the launcher stops worker 1.
        proc, end = run_job(
            "--num-workers", "2", "--cores-per-worker", "2", "--heartbeat-timeout", "3", "--kill-grace", "1",
            train_args=("--out", str(tmp_path), "--steps", "100000", "--die-at-step", "5", "--die-how", "stop"),
        )  # fmt: skip
        delay = end - died_at(proc.stdout, proc.stderr)
        print(f"\nworker 1 hung, heartbeat timeout 3 s: the launcher exited {delay:.2f} s later")
        assert proc.returncode == 134, proc.stderr[-3000:]
        assert "[launcher] worker 0 was killed by SIGABRT" in proc.stderr
        assert "maybe hung: worker(s) [1]" in proc.stderr
        assert delay < 3 + 1 + 10, delay

    @pytest.mark.parametrize("victim", [1, 0], ids=["worker1-dies", "coordinator-dies"])
    def test_survivors_exit_on_their_own(self, tmp_path, victim):
        # One launcher per worker, as on separate hosts: nobody kills the survivor.
        procs, outs = run_per_worker_launchers(
            ("--cores-per-worker", "2", "--heartbeat-timeout", "3"),
            ("--out", str(tmp_path), "--steps", "100000", "--die-at-step", "5", "--die-worker", str(victim)),
        )
        ended = time.time()  # both are done; the survivor's own exit was measured below
        survivor = 1 - victim
        assert procs[victim].returncode == 137, outs[victim][1][-3000:]
        assert procs[survivor].returncode not in (0, None), outs[survivor][1][-3000:]
        assert f"[launcher] worker {survivor} " in outs[survivor][1]
        delay = ended - died_at(*outs[victim])
        print(f"\nworker {victim} killed, separate launchers: worker {survivor} done within {delay:.2f} s")
        assert delay < 3 + 10, delay

    def test_a_worker_that_never_starts(self, tmp_path):
        start = time.time()
        proc, end = run_job(
            "--coordinator", f"127.0.0.1:{free_port()}", "--num-workers", "2", "--worker-id", "0",
            "--cores-per-worker", "2", "--start-timeout", "3",
            train_args=("--out", str(tmp_path)),
        )  # fmt: skip
        print(f"\nworker 1 never started, start timeout 3 s: worker 0 exited after {end - start:.2f} s")
        assert proc.returncode == distributed.START_TIMEOUT_EXIT_CODE, proc.stderr[-3000:]
        assert "worker 0 of 2 gave up after 3 s waiting for every worker to join the job" in proc.stderr
        assert "--start-timeout" in proc.stderr
        # The 3 s timeout, not the default (120 s), bounds the wait; the rest is starting Python and JAX, which
        # took 20 s on a loaded machine (15 s of slack once failed there).
        assert end - start < 3 + 60 < distributed.DEFAULT_START_TIMEOUT_S

    def test_initial_state_is_worker_0s(self, tmp_path, n_devices):
        if n_devices % 2 or n_devices < 2:
            pytest.skip(f"{n_devices} devices do not split into 2 workers")
        cores = n_devices // 2
        proc, _ = run_job(
            "--num-workers", "2", "--cores-per-worker", str(cores),
            train_args=("--out", str(tmp_path), "--steps", "3", "--mismatch", "state"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [load(tmp_path, w) for w in (0, 1)]
        reference = worker_module().run(rp.Replicator(1, n_devices), 3)  # worker 0's initial state
        for w, got in enumerate(results):
            for k in (k for k in reference if k.startswith("param_")):
                np.testing.assert_allclose(got[k], reference[k], atol=1e-6, rtol=0, err_msg=f"worker {w}: {k}")

    @pytest.mark.parametrize(
        "mismatch, message",
        [("batch", r"the compiled step differs between workers.*check that input_fn yields the same batch size")],
    )
    def test_workers_that_disagree_are_an_error(self, tmp_path, mismatch, message):
        proc, _ = run_job(
            "--num-workers", "2", "--cores-per-worker", "2",
            train_args=("--out", str(tmp_path), "--mismatch", mismatch),
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert re.search(
            r"\[launcher\] worker \d failed with exit code 1 after .*: ValueError: " + message, proc.stderr
        )


# -- the promises of runtime/distributed/{__init__,agreement,outputs,status,startup}.py no other test checks -------


def test_the_package_exports_every_name_it_lists_as_its_modules_define_them():
    from replicator.runtime.distributed import agreement, outputs

    for name in distributed.__all__:
        assert hasattr(distributed, name), name
    assert set(startup.__all__) <= set(distributed.__all__)
    assert distributed.initialize is startup.initialize and distributed.WorkerInfo is startup.WorkerInfo
    assert distributed.check_same_across_workers is agreement.check_same_across_workers
    assert distributed.replica_invariant is outputs.replica_invariant
    assert distributed.ENV_STATUS_DIR == status.ENV_STATUS_DIR == "REPLICATOR_STATUS_DIR"


def _worker_1_sends(monkeypatch, values) -> np.ndarray:
    """The digests worker 1 would send for ``values`` (one faked all-gather)."""
    from jax.experimental import multihost_utils

    sent = []
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda local: sent.append(local) or np.stack([local] * 2))
    distributed.check_same_across_workers(values, [f"v{i}" for i in range(len(values))], what="x", fix="")
    return sent[0]


@pytest.mark.parametrize(
    "mine, theirs",
    [
        (np.zeros(2, np.float32), np.zeros(2, np.int32)),  # the same bytes, another dtype
        (np.zeros((2, 3), np.int8), np.zeros((3, 2), np.int8)),  # the same bytes, another shape
        (np.zeros((), jnp.bfloat16), np.zeros((), np.float16)),  # 0-d, narrow
        (np.array([True, False]), np.array([True, True])),
    ],
    ids=["dtype", "shape", "0d-narrow", "bool"],
)
def test_values_that_differ_in_dtype_or_shape_alone_are_not_the_same(monkeypatch, mine, theirs):
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    other = _worker_1_sends(monkeypatch, [np.ones(3), theirs])
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda local: np.stack([local, other]))
    with pytest.raises(ValueError, match=r"the state differs between workers: v1 on worker\(s\) \[1\]"):
        distributed.check_same_across_workers([np.ones(3), mine], ["v0", "v1"], what="the state", fix="Fix it.")


def test_more_than_five_values_that_differ_are_named_five_then_dots(monkeypatch):
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    names = [f"v{i}" for i in range(7)]
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda local: np.stack([local, local ^ 1]))
    with pytest.raises(ValueError, match=r"x differs between workers: v0, v1, v2, v3, v4 \.\.\. on worker\(s\) \[1\]"):
        distributed.check_same_across_workers([np.full(1, i) for i in range(7)], names, what="x", fix="")


def test_process_0s_values_come_back_numbers_as_python_numbers(monkeypatch):
    from jax.experimental import multihost_utils

    from replicator.runtime.distributed.agreement import from_process0

    values = {"step": 3, "lr": 0.5, "w": np.zeros(2, np.float32), "s": np.array(2, np.int8)}
    assert from_process0(values) is values  # one process: no collective, the values themselves
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda tree: jax.tree.map(lambda x: x + 1, tree))
    got = from_process0(values)
    assert type(got["step"]) is int and got["step"] == 4 and type(got["lr"]) is float and got["lr"] == 1.5
    assert isinstance(got["w"], np.ndarray) and got["w"].dtype == np.float32 and got["w"].tolist() == [1, 1]
    assert isinstance(got["s"], np.ndarray) and got["s"].dtype == np.int8 and got["s"].shape == ()


_BITS_DTYPES = [np.bool_, np.int8, np.uint8, np.float16, jnp.bfloat16, np.float32]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    st.sampled_from(_BITS_DTYPES), st.integers(1, 5), st.integers(0, 3), st.integers(0, 4), st.integers(0, 255)
)
def test_replica_invariant_compares_narrow_rows_bit_for_bit_and_keeps_the_dtype(dtype, replicas, width, odd, byte):
    row = np.arange(width, dtype=np.float32).astype(dtype)
    rows = np.stack([row] * replicas)
    got = distributed.replica_invariant({"y": rows})["y"]
    assert got.dtype == rows.dtype and got.shape == row.shape and got.tobytes() == row.tobytes()
    if width == 0 or replicas == 1:
        return
    r = 1 + odd % (replicas - 1)
    raw = rows.view(np.uint8)
    flipped = raw.copy()
    flipped[r, 0] = 1 - raw[r, 0] if dtype == np.bool_ else byte if byte != raw[r, 0] else byte ^ 1
    with pytest.raises(ValueError, match=rf"output 'y' is not the same on every replica: replica\(s\) \[{r}\]"):
        distributed.replica_invariant({"y": flipped.view(rows.dtype)})


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16])
def test_replica_invariant_of_narrow_floats_tells_minus_zero_apart_and_takes_equal_nans(dtype):
    nans = np.array([[np.nan, 1.0]] * 3).astype(dtype)  # equal bits, though nan != nan
    assert distributed.replica_invariant({"y": nans})["y"].tobytes() == nans[0].tobytes()
    zeros = np.array([[0.0], [-0.0], [0.0]]).astype(dtype)  # equal values, other bits
    with pytest.raises(ValueError, match=r"output 'y' is not the same on every replica: replica\(s\) \[1\]"):
        distributed.replica_invariant({"y": zeros})


def test_replica_invariant_refuses_a_leaf_with_no_rows():
    with pytest.raises(ValueError, match=r"output 'e' has no leading replica axis \(shape \(0, 3\)\)"):
        distributed.replica_invariant({"e": np.zeros((0, 3), np.float32)})


def test_a_status_file_missing_a_field_or_with_one_of_another_type_is_no_report(tmp_path):
    d = str(tmp_path)
    status.write_status(d, 0, kind="exception", message="m", exception_type=None)
    good = json.loads(Path(status.status_path(d, 0)).read_text())
    assert status.read_status(d, 0) == good  # a None exception type is a report
    for field in ("worker_id", "kind", "exception_type", "message", "first_failure", "runtime_error"):
        missing = {k: v for k, v in good.items() if k != field}
        for record in ([missing] if field != "exception_type" else []) + [{**good, field: [1]}]:  # it may be absent
            Path(status.status_path(d, 0)).write_text(json.dumps(record))
            assert status.read_status(d, 0) is None, (field, record)


class _UserError(Exception):
    def __str__(self):
        raise RuntimeError("a broken __str__")


def test_a_reported_exception_is_named_as_a_traceback_names_it(tmp_path):
    d = str(tmp_path)
    status.report_exception(d, 0, ValueError, ValueError("bad"))
    status.report_exception(d, 1, _UserError, _UserError())
    error = jax.errors.JaxRuntimeError("INTERNAL: gone")
    status.report_exception(d, 2, type(error), error)
    first, second, third = (status.read_status(d, w) for w in range(3))
    assert (first["exception_type"], first["message"], first["first_failure"]) == ("ValueError", "bad", True)
    assert second["exception_type"] == f"{__name__}._UserError" and not second["first_failure"]
    assert second["message"] == "<_UserError with an unprintable message>" and not second["runtime_error"]
    assert third["runtime_error"] and third["exception_type"].startswith("jax")


def test_a_setting_that_is_not_a_number_or_out_of_range_is_a_value_error_naming_it(fresh, monkeypatch):
    monkeypatch.setenv(distributed.ENV_NUM_WORKERS, "two")
    with pytest.raises(ValueError, match=r"environment variable REPLICATOR_NUM_WORKERS='two' is not an integer"):
        distributed.initialize()
    monkeypatch.delenv(distributed.ENV_NUM_WORKERS)
    for raw in ("inf", "nan", "-1", "0"):
        monkeypatch.setenv(distributed.ENV_START_TIMEOUT, raw)
        with pytest.raises(ValueError, match="init_timeout_s must be a positive number of seconds"):
            distributed.initialize()
    monkeypatch.delenv(distributed.ENV_START_TIMEOUT)
    with pytest.raises(ValueError, match="cores_per_worker must be a positive int, got 0"):
        distributed.initialize(cores_per_worker=0)
    with pytest.raises(ValueError, match=r"worker_id must be an int in \[0, 1\)"):
        distributed.initialize("127.0.0.1:1234", 1, 1)  # a one-worker job has only worker 0
    with pytest.raises(ValueError, match="num_workers must be a positive int, got 0"):
        distributed.initialize("127.0.0.1:1234", 0, 0)
    assert startup._INFO is None  # nothing initialized by a refused call


def test_the_restart_count_and_the_first_worker_count_come_from_the_launcher(fresh, monkeypatch):
    assert distributed.restart_count() == 0 and distributed.initial_num_workers() is None  # not launched
    monkeypatch.setenv(distributed.ENV_RESTART_COUNT, "2")
    monkeypatch.setenv(distributed.ENV_INITIAL_NUM_WORKERS, "4")
    assert distributed.restart_count() == 2 and distributed.initial_num_workers() == 4


@pytest.mark.parametrize(
    ("field", "other"),
    [("num_workers", 4), ("worker_id", 1), ("cores_per_worker", 2), ("coordinator_address", "10.0.0.1:1234")],
)
def test_initialize_again_with_any_setting_changed_is_refused_naming_it(field, other):
    info = startup.WorkerInfo(0, 2, 4, "127.0.0.1:5555", "arguments")
    same = {"num_workers": 2, "worker_id": 0, "cores_per_worker": 4, "coordinator_address": "127.0.0.1:5555"}
    startup._check_same(
        info, **{k: same[k] for k in ("coordinator_address", "num_workers", "worker_id", "cores_per_worker")}
    )
    startup._check_same(info, None, None, None, None)  # nothing asked: nothing to compare
    changed = {**same, field: other}
    with pytest.raises(RuntimeError, match=f"already ran in this process with {field}="):
        startup._check_same(info, **changed)
