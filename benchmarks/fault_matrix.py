"""The fault matrix with the launcher's default timeouts: how long each fault takes to end the job.

Each row starts ``python -m replicator.launch --num-workers 2 --cores-per-worker 2``
on ``tests/multiproc/fault_worker.py`` with one injected fault (in worker 1 at step 5
unless stated) and measures the time from the fault (the worker prints when it
happens) to the launcher's exit, with its exit code and the worker it named. Prints a
markdown table (BENCHMARKS.md). ``tests/test_faults.py`` checks the same rows with a
short ``--step-timeout``.

The restart rows run ``tests/multiproc/restart_worker.py`` (a 2 x 2 ``Trainer`` job,
``--steps`` steps, a checkpoint every ``--every``, ``resume_from=``) under
``--max-restarts 5`` and SIGKILL a worker three times: ``restart-phases`` at phases
drawn from ``--seed`` by the worker itself (during a checkpoint save, while the
restarted job compiles, in a step; worker 0 once), ``restart-random`` from here, a
random worker a random moment (0-50 ms) after a random step (seeded; worker 0 once).
Each gives the detection time of each kill (the kill to the launcher's line about it),
the recovery times the launcher logged (failure detected to the first step done on
every restarted worker), the final parameters against an uninterrupted run of the
same job, and the exit code. ``tests/test_restarts.py`` checks ``restart-phases``
with 40 steps.

The ``shrink`` row runs the same job under ``--max-restarts 5 --min-workers 1`` with
worker 1 dying in every start (``--bad-worker 1:S``, S = ``--every`` + 2: after the
first checkpoint): it is restarted once on 2 workers, then, as it keeps failing, the
job goes on without it on 1 worker x 2 devices, the global batch kept; its final
parameters are compared with the uninterrupted 2 x 2 run (not bit-identical: 2
replicas sum in another order than 4). ``tests/test_restarts.py`` checks it with 40
steps against a one-device reference.

The ``hosts-*`` rows run the same job across 2 launchers acting as hosts on this
machine (``--nnodes ... --rdzv-endpoint 127.0.0.1:PORT --node-rank R
--cores-per-worker 2 --max-restarts 5``, the default heartbeat of 1 s: a lost host
or rendezvous is seen within 6 s), one worker per host, so that the job is the
same 2 x 2 job as above:

* ``hosts-kills``: three SIGKILLs of workers at phases drawn from ``--seed`` (as
  ``restart-phases``; worker ``w`` runs on host ``w``): every host restarts; the final
  parameters against the uninterrupted single-launcher run;
* ``hosts-elastic``: host 1's launcher SIGKILLed (its worker dies with it) after
  step ``--every * 2 + 3`` under ``--nnodes 1:2``: the job finishes on host 0 alone
  (1 worker x 2 devices, the global batch kept); its final parameters against the
  issue's reference, the checkpoint host 0 went on from resumed by one launcher on
  one host (1 worker x 2 devices, ``keep_batch='global'`` as in the job), and
  against a one-device ``jax.jit`` run of the whole global batch from step 0;
* ``hosts-fixed``: the same under ``--nnodes 2``: host 0 ends with exit code 77,
  naming host rank 1; the time from the kill to its exit;
* ``hosts-store``: host 0's launcher, which serves the rendezvous, SIGKILLed:
  host 1 ends with 77 naming the rendezvous; the time from the kill to its exit;
* ``hosts-hostile``: with a shared secret (``--rdzv-secret-file``), a client with
  the wrong secret and 4 KiB of random bytes sent to the endpoint mid-job: both
  refused, and the job ends as if uninterrupted.

``tests/test_hosts.py`` checks ``hosts-kills`` (one kill) and ``hosts-elastic``
with fewer steps and a 0.5 s heartbeat.

Usage::

    python benchmarks/fault_matrix.py             # every row, default timeouts (3 minutes, restarts 1-2 more)
    python benchmarks/fault_matrix.py --rows sleep,exit
    python benchmarks/fault_matrix.py --rows restarts --steps 150 --every 10 --seed 0
    python benchmarks/fault_matrix.py --rows shrink --steps 150 --every 10
    python benchmarks/fault_matrix.py --rows hosts --steps 150 --every 10 --seed 0
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multiproc" / "fault_worker.py"
RESTART_WORKER = ROOT / "tests" / "multiproc" / "restart_worker.py"
LAUNCH = [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", "2"]

ROWS = {
    "sleep": ("a worker stuck in its own Python code (`time.sleep` between steps)", ["--fault", "sleep"]),
    "input": ("a worker stuck in `input_fn` (I/O that never returns)", ["--fault", "input"]),
    "checkpoint": (
        "process 0 stuck writing a checkpoint",
        ["--fault", "checkpoint", "--worker", "0", "--ckpt", "{tmp}/ckpt"],
    ),
    "exit": ("`sys.exit(3)` in one worker", ["--fault", "exit", "--code", "3"]),
    "leave": ("one worker leaves the loop early and exits 0", ["--fault", "leave"]),
    "before-init": ("a worker exits 0 before `initialize()`", ["--fault", "before-init"]),
    "raise": ("an uncaught exception in one worker", ["--fault", "raise"]),
    "lr": ("worker 1 uses another learning rate", ["--fault", "lr"]),
}
RESTART_ROWS = {
    "restart-phases": "3 SIGKILLs at phases: a checkpoint save, the restarted job compiling, a step",
    "restart-random": "3 SIGKILLs from outside, random workers after random steps",
    "shrink": "worker 1 SIGKILLed in every start, `--min-workers 1`: 2 x 2 -> 1 x 2",
}
KILL_ROWS = ["restart-phases", "restart-random"]  # --rows restarts
HOST_ROWS = {
    "hosts-kills": "3 SIGKILLs of workers across 2 hosts (phases drawn from the seed), `--nnodes 2`",
    "hosts-elastic": "host 1's launcher SIGKILLed (with its worker) under `--nnodes 1:2`",
    "hosts-fixed": "host 1's launcher SIGKILLed under `--nnodes 2`",
    "hosts-store": "host 0's launcher, serving the rendezvous, SIGKILLed",
    "hosts-hostile": "a client with a wrong secret, and 4 KiB of random bytes, sent to the endpoint mid-job",
}
HOST_LAUNCH = [sys.executable, "-m", "replicator.launch", "--cores-per-worker", "2", "--max-restarts", "5"]
JOB_LIMIT_S = 600.0  # no restart job may take longer


def env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "JAX_PLATFORMS": "cpu"}


def run_row(args: list[str], tmp: str) -> tuple[float | None, int, str]:
    command = [*LAUNCH, "--max-time", "300", str(WORKER), *(a.format(tmp=tmp) for a in args)]
    start = time.time()
    proc = subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=400)
    ended = time.time()
    fault = re.search(r"fault \S+ at ([0-9.]+)", proc.stdout)
    after = ended - float(fault.group(1)) if fault else None
    said = [line for line in proc.stderr.splitlines() if line.startswith("[launcher]") and "stack" not in line]
    verdict = next((line for line in said if "watchdog:" in line or "failed with" in line), said[-1] if said else "")
    named = re.search(r"(Behind: worker \d+|worker \d+ (?:failed|ended|was))", verdict)
    if after is None:  # no fault line (the lr row fails before it): from the job's start
        after = ended - start
    return after, proc.returncode, named.group(1) if named else verdict[:80]


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The process's output lines as ``(time read, line)``, from a thread (None at the end)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put((time.time(), line.rstrip("\n")))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _outside_kills(seed: int, steps: int) -> list[tuple[int, int, float]]:
    """``(after step, worker, delay s)`` of three kills from outside, worker 0 among them."""
    rng = random.Random(seed)
    after = sorted(rng.sample(range(1, steps), 3))
    victims = [rng.randrange(2) for _ in after]
    if 0 not in victims:
        victims[rng.randrange(3)] = 0
    return [(k, w, rng.uniform(0.0, 0.05)) for k, w in zip(after, victims, strict=True)]


def run_restart_job(row: str, steps: int, every: int, seed: int, tmp: str) -> dict:
    """One restart row: the job under ``--max-restarts 5``, killed 3 times (``shrink``: worker 1 in every start)."""
    shrink = ["--min-workers", "1"] if row == "shrink" else []
    command = [*LAUNCH, "--max-restarts", "5", *shrink, "--max-time", f"{JOB_LIMIT_S:g}", str(RESTART_WORKER)]
    command += ["--steps", str(steps), "--every", str(every), "--ckpt", f"{tmp}/ckpt", "--out", f"{tmp}/out"]
    outside = _outside_kills(seed, steps) if row == "restart-random" else []
    if shrink:
        command += ["--bad-worker", f"1:{every + 2}"]
    else:
        command += ["--print-steps"] if outside else ["--random-kills", str(seed)]
    proc = subprocess.Popen(command, env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = _lines(proc), time.monotonic() + JOB_LIMIT_S
    pids: list[int] = []
    armed = False  # the next outside kill waits for the workers of a new start
    killed_at: list[float] = []
    where: list[str] = []
    detections: list[float] = []
    recoveries: list[float] = []
    try:
        while (item := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
            read, line = item
            if found := re.search(r"pids \[(\d+), (\d+)\]", line):
                pids, armed = [int(found.group(1)), int(found.group(2))], True
            if found := re.search(r"\[worker (\d)\] killing myself at ([\d.]+) in (\S+) after (\d+) steps", line):
                killed_at.append(float(found.group(2)))
                where.append(f"w{found.group(1)} {found.group(3)} after {found.group(4)}")
            if (found := re.fullmatch(r"\[worker 0\] step (\d+)", line)) and armed and outside:
                step, victim, delay = outside[0]
                if int(found.group(1)) == step:
                    time.sleep(delay)
                    os.kill(pids[victim], signal.SIGKILL)
                    killed_at.append(time.time())
                    where.append(f"w{victim} after step {step}")
                    outside.pop(0)
                    armed = False
            if re.match(r"\[launcher\] worker \d (was killed|failed)", line) and len(detections) < len(killed_at):
                detections.append(read - killed_at[len(detections)])
            if found := re.search(r"\[launcher\] restart \d+ recovered in ([\d.]+) s", line):
                recoveries.append(float(found.group(1)))
        code = proc.wait(timeout=30)
    except queue.Empty:
        proc.kill()
        raise RuntimeError(f"the {row} job ran past {JOB_LIMIT_S:g} s") from None
    return {"code": code, "where": where, "detections": detections, "recoveries": recoveries}


def final_params(out: str) -> dict[str, np.ndarray]:
    """Worker 0's final parameters, as restart_worker.py wrote them."""
    return {f.stem: np.load(f, allow_pickle=False) for f in sorted(Path(out).glob("w0_param_*.npy"))}


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> str:
    """How the final parameters compare with the uninterrupted run's, in words."""
    if not got or got.keys() != want.keys():
        return "missing"
    if all(np.array_equal(got[k], want[k]) for k in want):
        return "bit-identical"
    return f"max abs diff {max(float(np.max(np.abs(got[k] - want[k]))) for k in want):.2e}"


def restart_rows(names: list[str], steps: int, every: int, seed: int) -> None:
    import tempfile

    print(f"{steps} steps, a checkpoint every {every}, --max-restarts 5, seed {seed}:")
    print()
    print("| scenario | kills | detection (s) | recovery (s) | final params vs uninterrupted | exit code |")
    print("|---|---|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        command = [*LAUNCH, str(RESTART_WORKER), "--steps", str(steps), "--every", str(every)]
        command += ["--ckpt", f"{tmp}/ckpt", "--out", f"{tmp}/out"]
        subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, timeout=JOB_LIMIT_S, check=True)
        uninterrupted = final_params(f"{tmp}/out")
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            got = run_restart_job(name, steps, every, seed, tmp)
            same = compare(final_params(f"{tmp}/out"), uninterrupted)

        def seconds(values: list[float]) -> str:
            return ", ".join(f"{v:.1f}" for v in values) or "-"

        print(
            f"| {RESTART_ROWS[name]} | {'; '.join(got['where'])} | {seconds(got['detections'])} | "
            f"{seconds(got['recoveries'])} | {same} | {got['code']} |",
            flush=True,
        )


def _free_endpoint() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def start_hosts(
    nnodes: str, endpoint: str, worker_args: list[str], extra: list[str] = (), heartbeat: float = 1.0
) -> tuple[list[subprocess.Popen], queue.Queue]:
    """Two launchers as hosts 0 and 1 (host 0 first: it serves the rendezvous); their lines ``(time, host, line)``."""
    from replicator.launch.rendezvous import StoreClient

    lines: queue.Queue = queue.Queue()
    procs = []
    for rank in (0, 1):
        command = [*HOST_LAUNCH, "--nnodes", nnodes, "--rdzv-endpoint", endpoint, "--node-rank", str(rank)]
        command += ["--rdzv-heartbeat", f"{heartbeat:g}", "--max-time", f"{JOB_LIMIT_S:g}", *extra]
        command += [str(RESTART_WORKER), *worker_args]
        proc = subprocess.Popen(
            command, env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        procs.append(proc)

        def pump(proc: subprocess.Popen = proc, rank: int = rank) -> None:
            for line in proc.stdout:
                lines.put((time.time(), rank, line.rstrip("\n")))
            lines.put((time.time(), rank, None))

        threading.Thread(target=pump, daemon=True).start()
        if rank == 0:
            secret = None
            if "--rdzv-secret-file" in extra:
                secret = Path(extra[extra.index("--rdzv-secret-file") + 1]).read_bytes().strip()
            try:
                StoreClient(endpoint, secret=secret, connect_timeout_s=60).close()  # host 0 serves first
            except Exception:
                pass
    return procs, lines


def one_device_reference(steps: int) -> dict[str, np.ndarray]:
    """``train.py``'s training with plain ``jax.jit`` on one device, on the whole global batch (file stems as keys)."""
    sys.path.insert(0, str(ROOT / "tests" / "multiproc"))
    import train as model

    return {f"w0_param_{k}": v for k, v in model.one_device_reference(steps).items()}


def run_host_row(row: str, steps: int, every: int, seed: int, tmp: str) -> dict:
    """One ``hosts-*`` row: two launchers, the fault, and what each host said and how it ended."""
    endpoint = _free_endpoint()
    worker_args = ["--steps", str(steps), "--every", str(every), "--ckpt", f"{tmp}/ckpt", "--out", f"{tmp}/out"]
    extra: list[str] = []
    if row == "hosts-kills":
        worker_args += ["--random-kills", str(seed)]
    else:
        worker_args += ["--print-steps"]
    if row == "hosts-hostile":
        secret = Path(tmp) / "secret"
        secret.write_text(os.urandom(24).hex())
        secret.chmod(0o600)
        extra = ["--rdzv-secret-file", str(secret)]
    procs, lines = start_hosts("1:2" if row == "hosts-elastic" else "2", endpoint, worker_args, extra)
    victim = {"hosts-elastic": 1, "hosts-fixed": 1, "hosts-store": 0}.get(row)
    fault_step = every * 2 + 3
    deadline = time.monotonic() + JOB_LIMIT_S
    got: dict = {"codes": [None, None], "where": [], "detections": [], "recoveries": {}, "said": [], "fault": None}
    killed_at: list[float] = []
    ended = 0
    try:
        while ended < 2:
            read, host, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                ended += 1
                got["codes"][host] = procs[host].wait(timeout=30)
                if got["fault"] is not None and host != victim:
                    got["ended_after"] = read - got["fault"]
                continue
            if line.startswith("[launcher]"):
                got["said"].append((host, line))
            if found := re.search(r"\[worker (\d)\] .*?killing myself at ([\d.]+) in (\S+) after (\d+) steps", line):
                killed_at.append(float(found.group(2)))
                got["where"].append(f"w{found.group(1)} {found.group(3)} after {found.group(4)}")
            if re.match(r"\[launcher\] worker \d (was killed|failed)", line) and len(got["detections"]) < len(
                killed_at
            ):
                got["detections"].append(read - killed_at[len(got["detections"])])
            if found := re.search(r"\[launcher\] restart (\d+) recovered in ([\d.]+) s", line):
                number = int(found.group(1))
                got["recoveries"][number] = max(got["recoveries"].get(number, 0.0), float(found.group(2)))
            if got["fault"] is None and re.fullmatch(rf"\[worker 0\] step {fault_step}", line):
                got["fault"] = time.time()
                if victim is not None:
                    os.kill(procs[victim].pid, signal.SIGKILL)  # its worker dies with it (parent-death signal)
                    got["where"].append(f"host {victim}'s launcher after step {fault_step}")
                else:
                    got["where"].append(_hostile(endpoint))
            if found := re.search(r"\[worker 0\] worker 0: start \d+, 1 of 2 workers, from step (\d+)", line):
                got["resumed_from"] = step = int(found.group(1))  # the checkpoint the job went on alone from
                name = f"step_{step:08d}"  # kept now: the job deletes it once 3 newer ones are saved
                shutil.copytree(Path(tmp) / "ckpt" / name, Path(tmp) / "resume" / name)
            if row == "hosts-elastic" and "round 1: host rank 0 of 1" in line and got["fault"] is not None:
                got["went_on_after"] = read - got["fault"]
    except queue.Empty:
        for p in procs:
            p.kill()
        raise RuntimeError(f"the {row} job ran past {JOB_LIMIT_S:g} s") from None
    return got


def resume_on_one_host(tmp: str, step: int, steps: int, every: int) -> dict[str, np.ndarray]:
    """The issue's reference for ``hosts-elastic``: the checkpoint of ``step`` that host 0 went on from (copied
    alone into ``tmp/resume`` by :func:`run_host_row` when it did) resumed to ``steps`` by one launcher on one
    host (1 worker x 2 devices; the Trainer's ``keep_batch='global'``, as in the job: the same 64 rows a step);
    its final parameters."""
    command = [*LAUNCH[:3], "--num-workers", "1", "--cores-per-worker", "2", str(RESTART_WORKER), "--steps", str(steps)]
    command += ["--every", str(every), "--ckpt", f"{tmp}/resume", "--out", f"{tmp}/resumed"]
    done = subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=JOB_LIMIT_S)
    if done.returncode != 0 or f"from step {step}" not in done.stdout:
        raise RuntimeError(f"the one-host resume from step {step} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return final_params(f"{tmp}/resumed")


def _hostile(endpoint: str) -> str:
    """A client with a wrong secret and random bytes to ``endpoint``: how each was answered."""
    import socket

    from replicator.launch.rendezvous import RendezvousError, StoreClient

    try:
        StoreClient(endpoint, secret=b"not-the-secret-0123456789", connect_timeout_s=5).close()
        wrong = "wrong secret ACCEPTED"
    except RendezvousError as e:
        wrong = f"wrong secret refused ({str(e)[:60]}...)"
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(os.urandom(4096))
            sock.settimeout(5)
            while sock.recv(4096):
                pass
            junk = "random bytes: connection closed by the store"
        except OSError as e:
            junk = f"random bytes: connection closed by the store ({type(e).__name__})"
    return f"{wrong}; {junk}"


def host_rows(names: list[str], steps: int, every: int, seed: int) -> None:
    import tempfile

    print(
        f"2 launchers as hosts on this machine, 1 worker x 2 devices each, {steps} steps, a checkpoint every {every},"
    )
    print(f"--max-restarts 5, --rdzv-heartbeat 1 (a lost host or rendezvous seen within 6 s), seed {seed}:")
    print()
    print("| scenario | fault | detection / recoveries (s) | ended after (s) | named | final params | exit codes |")
    print("|---|---|---|---:|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        command = [*LAUNCH, str(RESTART_WORKER), "--steps", str(steps), "--every", str(every)]
        command += ["--ckpt", f"{tmp}/ckpt", "--out", f"{tmp}/out"]
        subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, timeout=JOB_LIMIT_S, check=True)
        uninterrupted = final_params(f"{tmp}/out")
    reference = one_device_reference(steps) if "hosts-elastic" in names else {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            got = run_host_row(name, steps, every, seed, tmp)
            params = final_params(f"{tmp}/out")
            if name == "hosts-elastic" and "resumed_from" in got:
                resumed = resume_on_one_host(tmp, got["resumed_from"], steps, every)
        said = got["said"]
        if name == "hosts-elastic":
            if not params or "resumed_from" not in got:
                same = "missing"
            else:
                vs_resumed = max(float(np.max(np.abs(params[k] - resumed[k]))) for k in resumed)
                vs_one = max(float(np.max(np.abs(params[k] - reference[k]))) for k in reference)
                same = (
                    f"max abs diff {vs_resumed:.1e} vs step {got['resumed_from']}'s checkpoint resumed on one host; "
                    f"{vs_one:.1e} vs one device from step 0 (global batch kept)"
                )
            timing = f"went on alone {got.get('went_on_after', float('nan')):.1f} s after the kill"
        else:
            same = compare(params, uninterrupted) if got["codes"] == [0, 0] else "-"
            timing = ", ".join(f"{v:.1f}" for v in got["detections"])
            timing += " / " + ", ".join(f"{v:.1f}" for _, v in sorted(got["recoveries"].items()))
        named = ""
        for host, line in said:
            if found := re.search(r"(host rank \d \(launcher [^,]*)|(rendezvous lost: [^:]*:[^ ]*)", line):
                named = f"host {host}: {found.group(0)[:70]}"
                break
        after = got.get("ended_after")
        print(
            f"| {HOST_ROWS[name]} | {'; '.join(got['where'])} | {timing} | "
            f"{'-' if after is None or name in ('hosts-kills', 'hosts-hostile') else f'{after:.1f}'} | {named or '-'} | "
            f"{same} | {got['codes']} |",
            flush=True,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join([*ROWS, "restarts", "shrink", "hosts"]), help=f"comma-separated, of "
                   f"{list(ROWS)}, {list(RESTART_ROWS)}, {list(HOST_ROWS)}, 'restarts' ({KILL_ROWS}) and "
                   f"'hosts' (all of {list(HOST_ROWS)})")  # fmt: skip
    p.add_argument("--steps", type=int, default=150, help="steps of the restart rows' job (default %(default)s)")
    p.add_argument("--every", type=int, default=10, help="its checkpoint interval (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws the restart rows' kills (default %(default)s)")
    args = p.parse_args()
    groups = {"restarts": KILL_ROWS, "hosts": list(HOST_ROWS)}
    names = [n for r in args.rows.split(",") for n in groups.get(r, [r])]
    unknown = [n for n in names if n not in ROWS and n not in RESTART_ROWS and n not in HOST_ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}, {list(RESTART_ROWS)}, restarts")
    import tempfile

    faults = [n for n in names if n in ROWS]
    if faults:
        print("| scenario | ended after (s) | exit code | named |")
        print("|---|---:|---:|---|")
    for name in faults:
        what, worker_args = ROWS[name]
        with tempfile.TemporaryDirectory() as tmp:
            after, code, named = run_row(worker_args, tmp)
        print(f"| {what} | {after:.1f} | {code} | {named} |", flush=True)
    restarts = [n for n in names if n in RESTART_ROWS]
    if restarts:
        restart_rows(restarts, args.steps, args.every, args.seed)
    across = [n for n in names if n in HOST_ROWS]
    if across:
        host_rows(across, args.steps, args.every, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
