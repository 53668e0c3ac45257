"""The launcher's command line (torchrun's spellings, refusals before any worker starts, --help) and its output.

Output: runtime chatter left out (and kept in the log files), and, when a worker
fails, the launcher's diagnosis first, the blamed worker's traceback after it, and
the other workers' consequential errors one line each, naming the log file that holds
them whole. The jobs run tests/multiproc/noisy_worker.py (no JAX) through the
bootstrap, as ``python -m replicator.launch`` runs a script.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replicator import launch
from replicator.launch import LaunchOptions, cli, hosts, relay
from replicator.launch.rendezvous import StoreClient
from replicator.launch.watchdog import STALL_EXIT_CODE
from replicator.runtime.distributed.startup import START_TIMEOUT_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
TOY = str(ROOT / "tests" / "multiproc" / "toy_worker.py")
NOISY = str(ROOT / "tests" / "multiproc" / "noisy_worker.py")

#: What jaxlib's gloo printed in a real 2 x 2 job (python -m replicator.launch --num-workers 2 --cores-per-worker 2).
GLOO_LINES = [
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
]
#: Worker 0's report in that job after worker 1 was killed (the frames in between cut).
PEER_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/work/main/replicator/runtime/distributed/bootstrap.py", line 154, in <module>',
    "    sys.exit(run(sys.argv[1:]))",
    "             ^^^^^^^^^^^^^^^^^",
    '  File "/work/main/.venv/lib/python3.11/site-packages/jax/_src/array.py", line 623, in _value',
    "    npy_value, did_copy = self._single_device_array_to_np_array_did_copy()",
    "jax.errors.JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
    "Read error [127.0.0.1]:59280: Connection reset by peer",
    "replicator: worker 0 stopped by the uncaught JaxRuntimeError above; exiting now so that the other workers are "
    "not kept waiting for it.",
]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "REPLICATOR_"))}


def parsed(*argv: str, script: str = TOY):
    args, rest = cli.parse([*argv, script])
    assert rest == [script]
    return args


class TestTorchrunSpellings:
    @pytest.mark.parametrize(
        "argv, num_workers, worker_id, coordinator",
        [
            (["--nproc-per-node", "2"], 2, None, None),
            (["--nproc_per_node=3"], 3, None, None),
            (["--nnodes", "1", "--nproc-per-node", "2", "--standalone"], 2, None, None),
            (["--nnodes", "2:2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master-port", "1234"],
             2, 1, "10.0.0.1:1234"),
            (["--nnodes=4", "--node-rank", "0", "--rdzv-backend", "static", "--rdzv-endpoint", "h:5"], 4, 0, "h:5"),
            (["--master-port", "29501", "--nproc-per-node", "2"], 2, None, "127.0.0.1:29501"),
            (["--num-workers", "2", "--nproc-per-node", "2"], 2, None, None),  # the same: no conflict
        ],
    )  # fmt: skip
    def test_aliases_of_ours(self, argv, num_workers, worker_id, coordinator):
        args = parsed(*argv)
        assert (args.num_workers, args.worker_id, args.coordinator) == (num_workers, worker_id, coordinator)

    def test_underscores_and_module(self):
        args = parsed("--num_workers", "2", "--max_restarts", "3", "--log_dir", "/tmp/x")
        assert (args.num_workers, args.max_restarts, args.log_dir) == (2, 3, "/tmp/x")
        assert cli._split_argv(["--module", "pkg.train", "--lr_x", "1"], cli._parser()) == (
            ["-m", "pkg.train"],
            ["--lr_x", "1"],  # the script's own options are its own
        )

    @pytest.mark.parametrize(
        "argv, message",
        [
            (["--nproc", "2"], r"unrecognized option --nproc; did you mean --nproc-per-node\?"),
            (["--num-worker", "2"], r"unrecognized option --num-worker; did you mean --num-workers\?"),
            (["--cores", "2", "--num-workers", "2"], r"did you mean --cores-per-worker\?"),
            (["--nnodes", "1:4"], r"--nnodes 1:4: a job whose number of hosts may change \(MIN:MAX\) needs .* "
             r"pass --rdzv-endpoint HOST:PORT"),
            (["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0"], r"one worker per host here"),
            (["--nnodes", "2"], r"--nnodes 2 needs --rdzv-endpoint HOST:PORT on each host .* or --node-rank I"),
            (["--node-rank", "1", "--num-workers", "2"], r"--node-rank 1 needs --nnodes N > 1"),
            (["--nproc-per-node", "gpu"], r"--nproc-per-node gpu: give a number of workers"),
            (["--rdzv-backend", "etcd", "--num-workers", "2"], r"--rdzv-backend etcd: there is no rendezvous service"),
            (["--rdzv-id", "7", "--num-workers", "2"], r"--rdzv-id is torchrun's; .* drop it"),
            (["--num-workers", "3", "--nproc-per-node", "2"], r"--num-workers 3 and torchrun's .* disagree"),
            (["--coordinator", "a:1", "--master-addr", "b", "--num-workers", "2"], r"--coordinator a:1 and .*disagree"),
            (["--standalone", "--coordinator", "a:1", "--num-workers", "2"], r"--standalone is a job on this machine"),
        ],
    )  # fmt: skip
    def test_refused_with_what_to_pass(self, argv, message, capsys):
        with pytest.raises(SystemExit) as e:
            parsed(*argv)
        assert e.value.code == 2
        assert re.search(message, capsys.readouterr().err), message


class TestAcrossHosts:
    """``--nnodes N|MIN:MAX --rdzv-endpoint HOST:PORT``: one launcher per host through the rendezvous."""

    @pytest.mark.parametrize(
        "argv, hosts, nproc, rank, endpoint",
        [
            (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:5"], (2, 2), 1, None, "127.0.0.1:5"),
            (["--nnodes=1:4", "--nproc_per_node", "2", "--node-rank", "3", "--rdzv-backend", "c10d",
              "--rdzv_endpoint", "h"], (1, 4), 2, 3, "h:29400"),
            (["--rdzv-endpoint", "h:7", "--nproc-per-node", "2"], (1, 1), 2, None, "h:7"),  # torchrun's default 1:1
        ],
    )  # fmt: skip
    def test_rendezvous_mode(self, argv, hosts, nproc, rank, endpoint):
        args = parsed(*argv)
        assert (args.hosts, args.nproc, args.tr_node_rank, args.rdzv_endpoint) == (hosts, nproc, rank, endpoint)
        assert (args.num_workers, args.worker_id, args.coordinator) == (None, None, None)

    def test_single_launcher_modes_are_unchanged(self):
        assert parsed("--num-workers", "2").hosts is None
        assert parsed("--coordinator", "h:1", "--num-workers", "2", "--worker-id", "1").hosts is None

    @pytest.mark.parametrize(
        "argv, message",
        [
            (["--nnodes", "0:2", "--rdzv-endpoint", "h:1"], r"--nnodes '0:2': give the number of hosts N, or MIN:MAX"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--num-workers", "2"], r"--num-workers does not go with "
             r"--rdzv-endpoint .* pass --nproc-per-node"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--worker-id", "1"], r"pass --node-rank"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--coordinator", "h:2"], r"--coordinator does not go"),
            (["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--min-workers", "1"], r"pass --nnodes MIN:MAX"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2"], r"--node-rank 2 is out of range .*0\.\.1"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-heartbeat", "0"], r"--rdzv-heartbeat must be a positive"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc-per-node", "gpu"], r"--nproc-per-node gpu: give a"),
            (["--num-workers", "2", "--rdzv-secret-file", "s"], r"--rdzv-secret-file goes with --rdzv-endpoint"),
        ],
    )  # fmt: skip
    def test_refused_with_what_to_pass(self, argv, message, capsys):
        with pytest.raises(SystemExit) as e:
            parsed(*argv)
        assert e.value.code == 2
        assert re.search(message, capsys.readouterr().err), message

    def test_a_non_loopback_endpoint_needs_a_secret_and_a_bad_secret_file_is_refused(self, tmp_path, capsys):
        env = {**clean_env(), "JAX_PLATFORMS": "cpu"}
        secret = tmp_path / "secret"
        secret.write_text("0123456789abcdef0123")
        secret.chmod(0o644)
        for extra, message in (
            ([], "without a shared secret"),
            (["--rdzv-secret-file", str(secret)], "may be read by others"),
        ):
            proc = subprocess.run(
                [sys.executable, "-m", "replicator.launch", "--nnodes", "2", "--rdzv-endpoint", "0.0.0.0:29401", *extra,
                 TOY],
                capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
            )  # fmt: skip
            assert proc.returncode == 2 and message in proc.stderr, proc.stderr

    @pytest.mark.parametrize(
        "argv, message",
        [
            (["--max-time", "0"], r"--max-time must be a positive number of seconds, got 0.0"),
            (["--kill-grace", "-1"], r"--kill-grace must be >= 0 seconds"),
            (["--max-restarts", "-1"], r"--max-restarts must be a non-negative int \(0: no restarts\), got -1"),
        ],
    )
    def test_settings_are_checked_before_the_rendezvous(self, argv, message, capsys):
        with pytest.raises(SystemExit) as e:
            cli.main(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-join-timeout", "1", *argv, TOY])
        assert e.value.code == 2
        assert re.search(message, capsys.readouterr().err), message

    @pytest.mark.multiprocess
    def test_two_launchers_restart_together_and_finish(self, tmp_path):
        """Two launchers (hosts) on this machine, 2 toy workers each; worker 3 (host 1) fails in the first start."""
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
        env = {**clean_env(), "JAX_PLATFORMS": "cpu"}
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-heartbeat", "0.25",
                  "--max-restarts", "1", "--kill-grace", "1", "--log-dir", str(tmp_path / "logs")]  # fmt: skip
        toy = [TOY, "--fail-worker", "3", "--fail-starts", "1", "--after", "0.3", "--sleep", "3", "--env",
               "REPLICATOR_WORKER_ID", "REPLICATOR_NUM_WORKERS", "REPLICATOR_RESTART_COUNT"]  # fmt: skip
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "replicator.launch", *common, "--node-rank", str(rank), *toy],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                env=env,
            )  # fmt: skip
            for rank in (0, 1)
        ]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=60)[0])
            finally:
                p.kill()
        assert [p.returncode for p in procs] == [0, 0], outs
        assert "restart 1 of at most 1, cause: host rank 1: worker 3 failed with exit code 3" in outs[1], outs[1]
        assert "round 1 was started by another host: stopping this host's workers" in outs[0], outs[0]
        assert "[launcher] stopping worker(s) [0, 1]" in outs[0], outs[0]  # at once, not when they end
        for host, out in enumerate(outs):
            for local in (0, 1):
                wid = host * 2 + local
                assert f"[worker {wid}] REPLICATOR_WORKER_ID={wid}" in out, out
                assert f"[worker {wid}] REPLICATOR_RESTART_COUNT=1" in out, out
            assert "REPLICATOR_NUM_WORKERS=4" in out
            assert "every host's workers finished (round 1)" in out
        # whichever launcher bound the endpoint first serves the rendezvous; the other connects
        assert sorted("(served here)" in out for out in outs) == [False, True], outs

    @pytest.mark.multiprocess
    @pytest.mark.slow
    def test_a_host_that_waits_in_vain_for_a_restart_leaves_the_running_job_alone(self, tmp_path):
        """A launcher that comes while the round runs and sees no restart within --rdzv-join-timeout ends alone."""
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
        env = {**clean_env(), "JAX_PLATFORMS": "cpu"}
        common = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-heartbeat", "0.25", "--rdzv-last-call",
                  "0.5", "--kill-grace", "1", "--max-time", "60"]  # fmt: skip
        command = [sys.executable, "-m", "replicator.launch", *common]
        done = tmp_path / "done"  # the first job runs until the late launcher has given up (at most 60 s)
        first = subprocess.Popen(
            [*command, TOY, "--sleep", "60", "--until-file", str(done)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            StoreClient(endpoint, connect_timeout_s=60).close()
            seen = []
            for line in first.stdout:
                seen.append(line)
                if "round 0: host rank 0 of 1" in line:
                    break
            late = subprocess.run(
                [*command, "--rdzv-join-timeout", "2", TOY], capture_output=True, text=True, cwd=ROOT, env=env,
                timeout=60,
            )  # fmt: skip
            done.touch()
            out0 = "".join(seen) + first.communicate(timeout=60)[0]
        finally:
            first.kill()
        said = late.stdout + late.stderr
        assert late.returncode == hosts.HOST_LOST_EXIT_CODE, said
        assert "not taken into the job: round 0 runs on 1 host(s) without this one" in said, said
        assert first.returncode == 0 and "every host's workers finished (round 0)" in out0, out0  # unaffected

    @pytest.mark.multiprocess
    @pytest.mark.slow
    def test_a_host_that_comes_back_joins_at_the_restart_after(self, tmp_path):
        """``--nnodes 1:2``: host 1's launcher SIGKILLed, the job goes on alone; host 1 started again joins round 2.

        Round 0 has both hosts; round 1 host 0 alone (host 1 gone); the restarted host 1 waits outside the round
        until worker 0 fails in start 1: round 2 has both hosts again, worker ids 0 and 1 of 2.
        """
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
        env = {**clean_env(), "JAX_PLATFORMS": "cpu"}
        common = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-heartbeat", "0.25", "--rdzv-last-call",
                  "5", "--max-restarts", "3", "--kill-grace", "1", "--max-time", "120"]  # fmt: skip
        toy = [TOY, "--fail-worker", "0", "--fail-in-start", "1", "--after", "3", "--sleep", "4", "--env",
               "REPLICATOR_WORKER_ID", "REPLICATOR_NUM_WORKERS", "REPLICATOR_RESTART_COUNT"]  # fmt: skip

        def host(rank: int) -> subprocess.Popen:
            command = [sys.executable, "-m", "replicator.launch", *common, "--node-rank", str(rank), *toy]
            return subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                start_new_session=True,
            )  # fmt: skip

        def until(proc: subprocess.Popen, needle: str, seen: list[str]) -> None:
            for line in proc.stdout:
                seen.append(line)
                if needle in line:
                    return
            raise AssertionError(f"no {needle!r} in {''.join(seen)}")

        procs, seen0, seen1 = [host(0)], [], []
        try:
            StoreClient(endpoint, connect_timeout_s=60).close()  # host 0 serves the rendezvous (it is not killed)
            procs.append(host(1))
            until(procs[1], "round 0: host rank 1 of 2", seen1)
            os.killpg(procs[1].pid, signal.SIGKILL)  # host 1's launcher and its worker
            procs[1].wait(timeout=30)
            until(procs[0], "round 1: host rank 0 of 1", seen0)  # the job went on alone
            procs.append(host(1))  # host 1 comes back: it waits for the next round
            outs = [p.communicate(timeout=90)[0] for p in (procs[0], procs[2])]
        finally:
            for p in procs:
                p.kill()
        out0, back = "".join(seen0) + outs[0], outs[1]
        assert (procs[0].returncode, procs[2].returncode) == (0, 0), out0 + back
        assert "restart 2 of at most 3, cause: host rank 0: worker 0 failed with exit code 3" in out0, out0
        assert "round 2: host rank 0 of 2" in out0 and "round 2: host rank 1 of 2" in back, back
        assert "round 1:" not in back, back  # it did not join the round that was running when it came
        for wid, out in ((0, out0), (1, back)):
            assert f"[worker {wid}] REPLICATOR_WORKER_ID={wid}" in out, out
            assert f"[worker {wid}] REPLICATOR_NUM_WORKERS=2" in out.split("round 2:")[-1], out
            assert f"[worker {wid}] REPLICATOR_RESTART_COUNT=2" in out, out
            assert "every host's workers finished (round 2)" in out, out


class TestRefusedBeforeAnyWorkerStarts:
    @pytest.fixture
    def launched(self, monkeypatch) -> list:
        calls: list = []
        monkeypatch.setattr(cli, "launch", lambda command, **kwargs: calls.append((command, kwargs)) or 0)
        return calls

    @pytest.mark.parametrize(
        "argv, message",
        [
            (["--num-workers", "2", "tests/multiproc/toy_wroker.py"], r"no script 'tests/multiproc/toy_wroker.py' "
             r"\(from .*\); did you mean tests/multiproc/toy_worker.py\?"),
            (["--num-workers", "2", "python", "train.py"], r"no script 'python' .*give the script itself \(train.py\)"),
            (["--num-workers", "2", "tests"], r"'tests' is a directory without __main__.py"),
            (["--num-workers", "2", "-m", "tests.multiproc.no_such_worker"], r"-m tests.multiproc.no_such_worker: "
             r"python -m finds no module"),
            (["--num-workers", "2", "-m", "json"], r"-m json: python -m finds no module 'json' to run .*__main__"),
        ],
    )  # fmt: skip
    def test_a_script_or_module_that_cannot_run(self, argv, message, launched, capsys, monkeypatch):
        monkeypatch.chdir(ROOT)
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and not launched
        assert re.search(message, capsys.readouterr().err), message

    @pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
    def test_an_unreadable_script(self, tmp_path, launched, capsys):
        script = tmp_path / "train.py"
        script.write_text("print(1)\n")
        script.chmod(0)
        with pytest.raises(SystemExit):
            cli.main(["--num-workers", "2", str(script)])
        assert not launched and "cannot read the script" in capsys.readouterr().err

    def test_what_runs_is_passed_on(self, launched, monkeypatch):
        monkeypatch.chdir(ROOT)
        assert cli.main(["--nproc_per_node", "2", "--show-runtime-logs", "-m", "tests.multiproc.toy_worker", "-x"]) == 0
        assert cli.main(["--num-workers", "2", "--log-dir", "/tmp/logs", TOY]) == 0
        (module_command, module_kwargs), (script_command, script_kwargs) = launched
        assert module_command[-3:] == ["-m", "tests.multiproc.toy_worker", "-x"] and script_command[-1] == TOY
        assert module_kwargs["num_workers"] == 2 and module_kwargs["options"].show_runtime_logs is True
        assert script_kwargs["options"] == LaunchOptions(log_dir="/tmp/logs")

    def test_command_line_end_to_end(self, tmp_path):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "replicator.launch", "--nproc-per-node", "2", str(tmp_path / "missing.py")],
            env=clean_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and "no script" in proc.stderr, proc.stderr
        assert "[launcher]" not in proc.stderr and "[worker" not in proc.stdout + proc.stderr
        assert time.monotonic() - started < 30


def test_help_lists_the_exit_codes_and_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for code, meaning in [
        (START_TIMEOUT_EXIT_CODE, "a worker never joined the job"),
        (STALL_EXIT_CODE, "the watchdog stopped the job"),
        (124, "--max-time ran out"),
        (2, "bad launcher arguments"),
    ]:
        assert re.search(rf"^  {code} +{re.escape(meaning)}", text, re.M), (code, text)
    for flag in cli.TORCHRUN:
        assert re.search(rf"^  {flag} ", text, re.M), flag
    parser = cli._parser()
    visible = [a for a in parser._actions if a.help not in (None, "==SUPPRESS==") and a.dest != "help"]
    assert len(visible) > 15
    for action in visible:
        assert "default" in action.help.lower(), action.option_strings
    assert "--cores-per-worker C  devices per worker" in text and "(default: not set" in text


class TestChatter:
    def test_gloo_lines_are_chatter(self):
        for line in GLOO_LINES:
            assert relay.strip_chatter(line) is None
        # Printed at the same moment as the script's own line: the script's part stays.
        assert relay.strip_chatter(GLOO_LINES[0] + "killing myself at 12.5") == "killing myself at 12.5"
        for line in ["step 3 loss 0.25", "", "[Gloo] something else", "Rank 0 is connected to 1 peer ranks."]:
            assert relay.strip_chatter(line) == line

    def test_worker_log(self, tmp_path):
        shown: list[tuple[bool, str]] = []
        for show in (False, True):
            log = relay.WorkerLog(3, lambda err, text: shown.append((err, text)), str(tmp_path / f"{show}.log"),
                                  show_runtime_logs=show)  # fmt: skip
            for line in [*GLOO_LINES, "step 1"]:
                log.line(line, stderr=False)
            log.close()
            assert (tmp_path / f"{show}.log").read_text().splitlines() == [*GLOO_LINES, "step 1"]  # all of it
        assert shown == [(False, "[worker 3] step 1\n"), *((False, f"[worker 3] {x}\n") for x in GLOO_LINES),
                         (False, "[worker 3] step 1\n")]  # fmt: skip

    def test_error_reports(self):
        assert relay.starts_error(PEER_TRACEBACK[0])
        assert relay.summarize(PEER_TRACEBACK) == PEER_TRACEBACK[-2]
        fatal = [
            "F1125 19:10:03.123456   8630 client.cc:77] Terminating process because the JAX distributed service "
            "detected fatal errors.",
            "*** Check failure stack trace: ***",
            "    @     0x7f12a3c4d5e6  absl::log_internal::LogMessageFatal::~LogMessageFatal()",
        ]
        assert relay.starts_error(fatal[0]) and relay.starts_error(fatal[1]) and not relay.starts_error(fatal[2])
        assert relay.summarize(fatal) == fatal[0].split("] ", 1)[1]
        assert not relay.starts_error("ValueError: a message printed by the script")


def job(*worker_args: str, **kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    kwargs = {"env": clean_env(), "max_time_s": 60, "kill_grace_s": 1, "num_workers": 2, **kwargs}
    code = launch.launch(launch.worker_command([NOISY, *worker_args]), stdout=out, stderr=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.multiprocess
class TestJobOutput:
    def test_chatter_is_left_out_unless_asked_for_and_always_logged(self, tmp_path):
        code, out, err = job(log_dir=tmp_path / "quiet")
        assert code == 0, err
        assert "[Gloo]" not in out + err and "[worker 1] hello from worker 1" in out.splitlines()
        (run,) = (tmp_path / "quiet").iterdir()  # a new directory for the run
        assert (run / "worker-1.log").read_text().splitlines()[:2] == [
            GLOO_LINES[0].replace("Rank 0", "Rank 1"),
            GLOO_LINES[1].replace("Rank 1 ", "Rank 2 "),
        ]
        code, out, err = job(show_runtime_logs=True)
        assert code == 0, err
        assert f"[worker 0] {GLOO_LINES[0]}" in out.splitlines()

    def test_the_diagnosis_first_and_the_consequences_condensed(self, tmp_path):
        code, out, err = job("--fail-worker", "1", "--flag", str(tmp_path / "failed"), log_dir=tmp_path / "logs")
        assert code == 1, err
        lines = err.splitlines()
        diagnosis = next(i for i, x in enumerate(lines) if x.startswith("[launcher] worker 1 failed"))
        assert lines[diagnosis].endswith(": ValueError: bad batch in worker 1"), lines[diagnosis]
        # The blamed worker's traceback in full, after the diagnosis.
        assert lines[diagnosis + 1] == "[worker 1] Traceback (most recent call last):", err
        assert "[worker 1] ValueError: bad batch in worker 1" in lines[diagnosis + 2 :]
        # Worker 0's traceback (a consequence) is one line, naming the file that holds it whole.
        assert not [x for x in lines if x.startswith("[worker 0]")], err
        (condensed,) = [x for x in lines if x.startswith("[launcher] worker 0, after the failure:")]
        assert lines.index(condensed) > diagnosis
        match = re.fullmatch(
            r"\[launcher\] worker 0, after the failure: JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: .* "
            r"Connection reset by peer \((\d+) lines in full: (\S+)\)",
            condensed,
        )
        assert match, condensed
        whole = Path(match.group(2)).read_text().splitlines()
        assert Path(match.group(2)).parent.parent == tmp_path / "logs" and whole[2] == "hello from worker 0"
        assert whole[-int(match.group(1)) :][0] == "Traceback (most recent call last):"
        assert int(match.group(1)) >= 20 and len([x for x in whole if x.startswith("  File ")]) >= 8  # every frame
        assert whole[-1].startswith("JaxRuntimeError: UNKNOWN: Gloo all-reduce failed")
        assert lines[-1] == f"[launcher] every worker's whole output: {Path(match.group(2)).parent}/worker-*.log"

    def test_a_traceback_that_the_script_caught_is_shown(self, monkeypatch):
        monkeypatch.setattr(relay, "HOLD_S", 0.3)
        code, out, err = job("--caught", "--sleep", "1.5")
        assert code == 0, err
        for w in (0, 1):
            assert f"[worker {w}] Traceback (most recent call last):" in err.splitlines()
            assert f"[worker {w}] KeyError: 'a missing key, handled'" in err.splitlines()
        assert "after the failure" not in err and "whole output" not in err


def test_rdzv_rejoin_timeout_must_be_below_the_join_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """``--rdzv-rejoin-timeout``: how long a restart round waits for a host still stopping its workers; at or
    above ``--rdzv-join-timeout`` (or below 0) it is refused (exit 2), saying why."""
    toy = str(Path(__file__).resolve().parent / "multiproc" / "toy_worker.py")
    common = ["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-join-timeout", "30"]
    args, _ = cli.parse([*common, "--rdzv-rejoin-timeout", "20", toy])
    assert args.rdzv_rejoin_timeout == 20.0
    assert cli.parse([*common, toy])[0].rdzv_rejoin_timeout is None  # the default: min(60, join / 2)
    for bad in ("30", "-1"):
        with pytest.raises(SystemExit) as e:
            cli.parse([*common, "--rdzv-rejoin-timeout", bad, toy])
        assert e.value.code == 2
        assert "below --rdzv-join-timeout (30)" in capsys.readouterr().err


def test_rdzv_last_call_0_is_allowed_and_a_negative_one_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--rdzv-last-call 0``: close a MIN:MAX round as soon as MIN hosts joined; below 0 is an error (exit 2)."""
    common = ["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-last-call"]
    args, _ = cli.parse([*common, "0", TOY])
    assert (args.rdzv_last_call, args.hosts) == (0.0, (1, 2))
    with pytest.raises(SystemExit) as e:
        cli.parse([*common, "-0.5", TOY])
    assert e.value.code == 2
    assert "--rdzv-last-call must be >= 0 seconds, got -0.5" in capsys.readouterr().err
