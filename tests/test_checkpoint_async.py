"""Asynchronous checkpoint saves: written in the background, one at a time, failures raised, kills harmless."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.loop import CheckpointHook, Hook, Trainer
from replicator.training.checkpoint import CheckpointError, CheckpointManager, restore_checkpoint, save_checkpoint
from replicator.training.checkpoint import files as ckpt_files
from replicator.training.checkpoint import shards as ckpt_shards

ROOT = Path(__file__).resolve().parents[1]
WAIT = 60  # s: the bound on every wait in these tests


def _state(repl):
    """Leaves of every kind a save handles: split over devices, replicated, host, a PRNG key, bfloat16."""
    n = repl.mesh.devices.size
    split = NamedSharding(repl.mesh, P(("workers", "cores")))
    return {
        "mu": jax.device_put(np.arange(4.0 * n * 3, dtype=np.float32).reshape(4 * n, 3), split),
        "w": jax.device_put(jnp.linspace(-1.0, 1.0, 7), NamedSharding(repl.mesh, P())),
        "host": np.arange(5, dtype=np.int32),
        "key": jax.random.key(3),
        "half": jnp.arange(4.0, dtype=jnp.bfloat16),
    }


def _host(tree):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x) for x in tree]


def _assert_same(got, want):
    for a, b in zip(_host(jax.tree.leaves(got)), _host(jax.tree.leaves(want)), strict=True):
        np.testing.assert_array_equal(a, b)


class _Gate:
    """Makes ``files.write_arrays`` (process 0's last file before the commit) wait until opened."""

    def __init__(self, monkeypatch):
        self.entered, self.opened = threading.Event(), threading.Event()
        self.active = self.most_active = 0
        real = ckpt_files.write_arrays

        def gated(path, arrays, report=True):
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.entered.set()
            try:
                assert self.opened.wait(WAIT), "the gate was never opened"
                real(path, arrays, report)
            finally:
                self.active -= 1

        monkeypatch.setattr(ckpt_files, "write_arrays", gated)


def test_an_async_save_writes_what_a_save_writes(tmp_path, repl2d):
    state = _state(repl2d)
    save_checkpoint(tmp_path / "sync", 1, state)
    manager = CheckpointManager(tmp_path / "async")
    assert manager.save_async(1, state) == str(tmp_path / "async" / "step_00000001")
    manager.wait()
    assert manager.all_steps() == [1] and manager.in_flight is None
    sync, done = (CheckpointManager(tmp_path / d).read_manifest(1) for d in ("sync", "async"))
    assert done["leaves"] == sync["leaves"]  # the same entries, the same shards and their sha256
    mu = next(e for e in done["leaves"] if e["path"] == "['mu']")
    assert len(mu["shards"]) == repl2d.mesh.devices.size
    assert done["arrays_sha256"] == sync["arrays_sha256"]
    step, restored, _ = restore_checkpoint(tmp_path / "async", state)
    assert step == 1
    _assert_same(restored, state)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
def test_writer_nice_lowers_the_priority_of_the_writer_thread_only(tmp_path, repl2d, monkeypatch):
    seen = {}
    real = ckpt_files.write_arrays

    def noting(path, arrays, report=True):
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        real(path, arrays, report)

    monkeypatch.setattr(ckpt_files, "write_arrays", noting)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    manager = CheckpointManager(tmp_path, writer_nice=7)
    manager.save_async(1, _state(repl2d))
    manager.wait()
    assert seen["writer"] == min(19, before + 7) and manager.all_steps() == [1]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the training thread's is unchanged
    with pytest.raises(ValueError, match="writer_nice= must be an int from 0 to 19"):
        CheckpointManager(tmp_path, writer_nice=-1)


def test_the_save_returns_before_the_files_are_written(tmp_path, repl2d, monkeypatch):
    gate = _Gate(monkeypatch)
    manager = CheckpointManager(tmp_path)
    manager.save_async(3, _state(repl2d))
    assert gate.entered.wait(WAIT)
    assert manager.in_flight == 3 and manager.all_steps() == []  # still writing: nothing committed yet
    gate.opened.set()
    manager.wait()
    assert manager.in_flight is None and manager.all_steps() == [3]
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]  # no temporary, no lock left


def test_a_failed_async_save_raises_at_the_next_save_and_leaves_the_earlier_ones(tmp_path, repl2d, monkeypatch):
    state = _state(repl2d)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state)
    real = ckpt_shards.write_own

    def half_then_fail(directory, *args, **kwargs):
        real(directory, *args, **kwargs)
        raise OSError("injected: disk full")

    monkeypatch.setattr(ckpt_shards, "write_own", half_then_fail)
    manager.save_async(2, state)  # returns: the failure happens in the background
    monkeypatch.setattr(ckpt_shards, "write_own", real)
    with pytest.raises(
        CheckpointError,
        match=r"asynchronous save of step 2 into .*step_00000002 failed, so it was not committed; the checkpoints "
        r"before it are unchanged \(steps \[1\]\). OSError: injected: disk full",
    ):
        manager.save_async(3, state)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]  # the temporary removed, the lock released
    _assert_same(restore_checkpoint(tmp_path, state)[1], state)
    manager.save_async(3, state)  # the directory is usable again
    manager.wait()
    assert manager.all_steps() == [1, 3]


def test_a_deleted_state_is_reported_and_copy_on_device_keeps_it(tmp_path, repl2d, monkeypatch):
    gate = _Gate(monkeypatch)
    gate.opened.set()
    real = ckpt_shards.write_own
    deleted = threading.Event()

    def after_delete(*args, **kwargs):
        assert deleted.wait(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_shards, "write_own", after_delete)
    for copy_on_device in (False, True):
        manager = CheckpointManager(tmp_path / str(copy_on_device))
        state = _state(repl2d)
        want = _host(jax.tree.leaves(state))
        deleted.clear()
        manager.save_async(1, state, copy_on_device=copy_on_device)
        for leaf in jax.tree.leaves(state):
            if isinstance(leaf, jax.Array):
                leaf.delete()  # as a donating step does
        deleted.set()
        if not copy_on_device:
            with pytest.raises(CheckpointError, match=r"state\['mu'\] was deleted .*copy_on_device=True"):
                manager.wait()
            assert manager.all_steps() == []
        else:
            manager.wait()
            target = jax.tree.map(lambda x: x, _state(repl2d))
            got = restore_checkpoint(tmp_path / "True", target)[1]
            for a, b in zip(_host(jax.tree.leaves(got)), want, strict=True):
                np.testing.assert_array_equal(a, b)


# -- with the Trainer -----------------------------------------------------------------------------------------


def _input_fn(ctx):
    i = 0
    while True:
        rng = np.random.default_rng([i, ctx.worker_id])
        yield {"x": rng.normal(size=(ctx.cores_per_worker, 3)).astype(np.float32)}
        i += 1


def _step_fn(w, batch):
    grad = rp.all_mean(jnp.mean(batch["x"], axis=0) * w + 1.0)
    return w - 0.1 * grad, {}


def _trajectory(repl, steps):
    """The state after each step, without checkpoints (the reference)."""
    states, w = [], jnp.ones(3)
    for _ in range(steps):
        w, _ = repl.run(_step_fn, _input_fn, w)
        states.append(np.asarray(w))
    repl.forget_input(_input_fn)
    return states


def test_trainer_saves_every_step_of_a_donated_state_one_at_a_time(tmp_path, n_devices, monkeypatch):
    # Every save overlaps the next step, which donates the state the save holds: the checkpoints must
    # still hold the states of their steps. Each write is slowed, so every save waits for the previous one.
    reference = _trajectory(rp.Replicator(1, n_devices), 6)
    real = ckpt_files.write_arrays
    active = []

    def slow(path, arrays, report=True):
        active.append(path)
        assert len(active) == 1, active  # never two saves at once
        time.sleep(0.2)
        real(path, arrays, report)
        active.remove(path)

    monkeypatch.setattr(ckpt_files, "write_arrays", slow)
    hook = CheckpointHook(tmp_path, every=1, keep=None, async_save=True)
    lines = []
    trainer = Trainer(rp.Replicator(1, n_devices, donate_state=True), _step_fn, _input_fn, jnp.ones(3), hooks=[hook])
    trainer.log = lines.append
    trainer.run(6)
    assert hook.manager.in_flight is None and hook.manager.all_steps() == [1, 2, 3, 4, 5, 6]  # run() waited
    for step in range(1, 7):
        got = restore_checkpoint(tmp_path, np.zeros(3, np.float32), step)[1]
        np.testing.assert_allclose(got, reference[step - 1], rtol=0, atol=1e-6)
    assert hook.waits and all(seconds > 0 for _, seconds in hook.waits)
    assert any(line.startswith(f"checkpoint: step {hook.waits[0][0]} waited") for line in lines), lines


def test_trainer_waits_for_the_save_in_flight_when_a_step_raises(tmp_path, repl, monkeypatch):
    gate = _Gate(monkeypatch)

    class Crash(Hook):
        def after_step(self, trainer):
            if trainer.step == 3:
                assert gate.entered.wait(WAIT)  # the save of step 2 is being written
                threading.Timer(0.3, gate.opened.set).start()
                raise KeyboardInterrupt("killed")

    hook = CheckpointHook(tmp_path, every=2, async_save=True)
    trainer = Trainer(repl, _step_fn, _input_fn, jnp.ones(3), hooks=[hook, Crash()])
    with pytest.raises(KeyboardInterrupt):
        trainer.run(10)
    assert hook.manager.all_steps() == [2]  # committed before run() raised
    assert not [t for t in threading.enumerate() if t.name.startswith("replicator-checkpoint")]


def test_a_failed_save_during_a_failed_run_is_logged_not_raised(tmp_path, repl, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("injected: disk full")

    monkeypatch.setattr(ckpt_files, "write_arrays", fail)

    class Crash(Hook):
        def after_step(self, trainer):
            if trainer.step == 1:
                raise ValueError("the step's own error")

    lines = []
    trainer = Trainer(
        repl, _step_fn, _input_fn, jnp.ones(3), hooks=[CheckpointHook(tmp_path, 1, async_save=True), Crash()]
    )
    trainer.log = lines.append
    with pytest.raises(ValueError, match="the step's own error"):
        trainer.run(3)
    assert any("asynchronous save of step 1" in line and "injected: disk full" in line for line in lines), lines
    assert os.listdir(tmp_path) == []


# -- kill -9 in the middle of an async save -------------------------------------------------------------------

_KILLED = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import replicator as rp
    from replicator.training.checkpoint import CheckpointManager, files, shards

    where, directory = sys.argv[1], sys.argv[2]
    state = {"w": np.arange(1000.0, dtype=np.float32), "b": np.float32(1.0)}
    manager = CheckpointManager(directory, keep=None)
    manager.save(1, state)

    def stop_here(real):
        def wrapper(path, *args, **kwargs):
            real(path, *args, **kwargs)
            print("inside", flush=True)
            time.sleep(600)  # killed here
        return wrapper

    if where == "writing":
        files.write_arrays = stop_here(files.write_arrays)
    else:  # committing: the manifest is written, the directory not yet renamed
        files.write_text = stop_here(files.write_text)
    state["w"] = state["w"] + 1
    manager.save_async(2, state)
    print("training on", flush=True)
    time.sleep(600)
    """
)


@contextlib.contextmanager
def _child(script: str, *args: str) -> Iterator[subprocess.Popen]:
    """A Python process running ``script`` with ``args``; killed on the way out if still alive."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=WAIT)


@pytest.mark.parametrize("where", ["writing", "committing"])
def test_kill_9_during_an_async_save_loses_nothing(tmp_path, where):
    with _child(_KILLED, where, str(tmp_path)) as proc:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert sorted(lines) == ["inside\n", "training on\n"], (lines, proc.stderr.read() if proc.poll() else "")
        _kill_9(proc)
    assert any(name.startswith(".tmp-step_00000002") for name in os.listdir(tmp_path))  # killed mid-save
    target = {"w": np.zeros(1000, np.float32), "b": np.float32(0)}
    step, state, _ = restore_checkpoint(tmp_path, target, fallback=True)
    assert step == 1
    np.testing.assert_array_equal(state["w"], np.arange(1000.0, dtype=np.float32))
    manager = CheckpointManager(tmp_path)
    manager.save_async(2, target)  # the next save removes the dead one's temporary
    manager.wait()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]


_KILLED_ANYWHERE = textwrap.dedent(
    """
    import sys, time
    import jax.numpy as jnp
    from replicator.training.checkpoint import CheckpointManager

    manager = CheckpointManager(sys.argv[1], keep=1)
    state = {"w": jnp.arange(4 << 20, dtype=jnp.float32), "b": jnp.float32(1.0)}  # 16 MB
    manager.save(1, state)
    state = {"w": state["w"] + 1, "b": state["b"] + 1}
    start = time.perf_counter()
    manager.save_async(2, state)
    print("started", flush=True)
    manager.wait()
    print(f"done {time.perf_counter() - start:.3f}", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_kill_9_at_any_moment_of_an_async_save_leaves_an_intact_checkpoint(tmp_path):
    # The first run measures how long the save takes; the others are killed at fractions of that,
    # from right after save_async returned to after the commit. Whatever the moment, the newest
    # checkpoint restores (no fallback) to the values of its step: step 1's or step 2's.
    duration = None
    for k, fraction in enumerate([None, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0]):
        directory = tmp_path / str(k)
        with _child(_KILLED_ANYWHERE, str(directory)) as proc:
            assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.poll() is not None else ""
            if fraction is None:
                duration = float(proc.stdout.readline().split()[1])
            else:
                time.sleep(fraction * duration)
            _kill_9(proc)
        target = {"w": np.zeros(4 << 20, np.float32), "b": np.float32(0)}
        step, state, _ = restore_checkpoint(directory, target)
        assert step in (1, 2) and (fraction is not None or step == 2)
        np.testing.assert_array_equal(state["w"], np.arange(4 << 20, dtype=np.float32) + (step - 1))
        assert float(state["b"]) == step


def test_an_async_save_keeps_host_leaves_as_they_were_when_it_was_called(tmp_path, monkeypatch):
    """The caller changing a host array in place before the write does not change the checkpoint."""
    gate = _Gate(monkeypatch)
    host = np.arange(6, dtype=np.float32)
    original = host.copy()
    manager = CheckpointManager(tmp_path)
    manager.save_async(1, {"w": host})
    assert gate.entered.wait(WAIT), "the write never started"
    host[:] = 99  # before the arrays are written
    gate.opened.set()
    manager.wait()
    _, restored, _ = restore_checkpoint(tmp_path, {"w": np.zeros(6, np.float32)})
    np.testing.assert_array_equal(restored["w"], original)


# -- promises without a test before (issue #41 item 4) ------------------------------------------------------


def test_only_the_writer_holds_the_leaves_stored_whole_and_they_are_what_a_save_stores():
    """A process that does not write the arrays file (not process 0) holds none of its leaves; process 0's held
    leaves become exactly the arrays a synchronous save stores (bfloat16 as uint16, a key as its key data)."""
    from replicator.training.checkpoint import encoding, snapshot

    leaves = [jnp.arange(3.0), np.arange(4, dtype=np.int32), jnp.ones(2, jnp.bfloat16), jax.random.key(7)]
    entries = [encoding.entry(f"[{i}]", leaf) for i, leaf in enumerate(leaves)]
    other = snapshot.capture(leaves, entries, {}, process=0, writer=False, copy_on_device=False)
    assert other.whole == {} and other.ready == {} and other.shards == {}
    writer = snapshot.capture(leaves, entries, {}, process=0, writer=True, copy_on_device=True)
    got = writer.stored_whole()
    assert list(got) == ["a0", "a1", "a2", "a3"]
    for i, (leaf, entry) in enumerate(zip(leaves, entries, strict=True)):
        want = encoding.stored(leaf, entry)
        assert got[f"a{i}"].dtype == want.dtype and got[f"a{i}"].tobytes() == want.tobytes()
    writer.release()
    assert writer.whole == {} and writer.shards == {} and writer.ready == {}
