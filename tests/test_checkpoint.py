"""Checkpoints: round trips, atomicity under failure and SIGKILL, checks on restore."""

import hashlib
import io
import itertools
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    export_orbax,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)
from replicator.training.checkpoint import agreement as ckpt_agreement
from replicator.training.checkpoint import background as ckpt_background
from replicator.training.checkpoint import encoding as ckpt_encoding
from replicator.training.checkpoint import files as ckpt_files
from replicator.training.checkpoint import manifest as ckpt_manifest


def _reseal(path, manifest):
    """Write ``manifest`` with a fresh digest, as a forger (or a test) who knows the format would."""
    manifest["manifest_sha256"] = ckpt_manifest.manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array | None


def _state():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.float32(0.5)}
    return {
        "params": params,
        "opt": optax.adam(1e-3).init(params),  # a tuple of NamedTuples
        "list": [jnp.int32(7), np.arange(4, dtype=np.int64).astype(np.int32), jnp.array([True, False])],
        "pair": Pair(jnp.ones(2, jnp.bfloat16) * 1.5, None),
        "none": None,
        "half": jnp.linspace(0, 1, 5, dtype=jnp.float16),
    }


def _assert_same(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


class TestRoundTrip:
    def test_pytrees_dtypes_and_extra(self, tmp_path):
        state = _state()
        save_checkpoint(tmp_path, 3, state, extra={"input_position": 3, "note": "hi", "lr": [0.1, 0.01]})
        step, restored, extra = restore_checkpoint(tmp_path, state)
        assert step == 3 and extra == {"input_position": 3, "note": "hi", "lr": [0.1, 0.01]}
        _assert_same(restored, state)
        assert type(restored["opt"][0]).__name__ == "ScaleByAdamState" and restored["pair"].b is None
        assert restored["pair"].a.dtype == jnp.bfloat16

    def test_target_of_shape_dtype_structs_gives_numpy(self, tmp_path):
        state = _state()
        save_checkpoint(tmp_path, 1, state)
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
        _, restored, _ = restore_checkpoint(tmp_path, specs)
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(restored))
        _assert_same(restored, state)

    def test_target_arrays_give_arrays_on_their_sharding(self, tmp_path, repl):
        state = {"w": jnp.arange(3.0)}
        state, _ = repl.run(
            lambda s, b: (s, {}), lambda ctx: iter([{"x": np.ones(repl.num_replicas)}]), state
        )  # now replicated on the mesh
        save_checkpoint(tmp_path, 1, state)
        _, restored, _ = restore_checkpoint(tmp_path, state)
        assert isinstance(restored["w"], jax.Array) and restored["w"].sharding == state["w"].sharding
        np.testing.assert_array_equal(restored["w"], np.arange(3.0))

    def test_leaves_sharded_over_the_mesh(self, tmp_path, repl2d):
        # As ZeRO-1 leaves Adam's mu/nu: split along axis 0 over every replica (and a bfloat16
        # leaf and a key, which are stored another way). Saved whole; restored whole, or onto
        # the target's sharding.
        sharding = NamedSharding(repl2d.mesh, P(("workers", "cores")))
        n = repl2d.num_replicas
        host = {
            "mu": np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3),
            "h": (np.arange(n) / 4).astype(ml_dtypes.bfloat16),
        }
        state = {k: jax.device_put(v, sharding) for k, v in host.items()}
        state["key"] = jax.device_put(jax.random.split(jax.random.key(3), n), sharding)
        assert all(len(x.sharding.device_set) == n and not x.is_fully_replicated for x in state.values())
        save_checkpoint(tmp_path, 1, state)

        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        _, restored, _ = restore_checkpoint(tmp_path, specs)
        for k in ("mu", "h"):
            assert isinstance(restored[k], np.ndarray) and restored[k].dtype == host[k].dtype
            np.testing.assert_array_equal(restored[k], host[k])
        _, on_mesh, _ = restore_checkpoint(tmp_path, state)
        for k in state:
            assert on_mesh[k].sharding == sharding
        _assert_same(on_mesh["mu"], host["mu"])
        _assert_same(on_mesh["h"], host["h"])
        for key in (restored["key"], on_mesh["key"]):
            np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(state["key"]))

    def test_python_numbers_get_jax_dtypes(self, tmp_path):
        save_checkpoint(tmp_path, 1, {"lr": 0.1, "n": 3})
        _, restored, _ = restore_checkpoint(tmp_path, {"lr": jnp.float32(0), "n": jnp.int32(0)})
        assert restored["lr"].dtype == np.float32 and restored["n"].dtype == np.int32

    def test_prng_keys(self, tmp_path):
        state = {"key": jax.random.key(42), "raw": jax.random.PRNGKey(1)}
        save_checkpoint(tmp_path, 1, state)
        _, restored, _ = restore_checkpoint(tmp_path, state)
        np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
        np.testing.assert_array_equal(jax.random.uniform(restored["key"], (3,)), jax.random.uniform(state["key"], (3,)))
        np.testing.assert_array_equal(restored["raw"], state["raw"])

    def test_the_files_are_plain_npz_and_json(self, tmp_path):
        state = {"w": jnp.ones(3), "h": jnp.ones(2, jnp.bfloat16)}
        path = pathlib.Path(save_checkpoint(tmp_path, 12, state, extra={"input_position": 12}))
        assert path == tmp_path / "step_00000012"
        assert sorted(p.name for p in path.iterdir()) == ["arrays.npz", "manifest.json"]
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["format"] == "replicator-checkpoint" and manifest["version"] == 3
        assert manifest["manifest_sha256"] == ckpt_manifest.manifest_digest(manifest)
        assert manifest["step"] == 12 and manifest["extra"] == {"input_position": 12}
        assert manifest["arrays_sha256"] == hashlib.sha256((path / "arrays.npz").read_bytes()).hexdigest()
        assert manifest["leaves"] == [
            {"path": "['h']", "shape": [2], "dtype": "bfloat16", "stored_as": "uint16"},
            {"path": "['w']", "shape": [3], "dtype": "float32"},
        ]
        with np.load(path / "arrays.npz", allow_pickle=False) as npz:
            assert npz["a0"].dtype == np.uint16 and npz["a1"].dtype == np.float32
            np.testing.assert_array_equal(npz["a0"].view(ml_dtypes.bfloat16), np.ones(2, ml_dtypes.bfloat16))


class TestManager:
    def test_keeps_the_newest(self, tmp_path):
        manager = CheckpointManager(tmp_path, keep=2)
        for step in (1, 2, 5, 7):
            manager.save(step, {"x": jnp.full(2, step)})
        assert manager.all_steps() == [5, 7] and manager.latest_step() == 7 and latest_step(tmp_path) == 7
        assert sorted(os.listdir(tmp_path)) == ["step_00000005", "step_00000007"]
        step, state, _ = manager.restore({"x": jnp.zeros(2, jnp.int32)}, step=5)
        assert step == 5 and state["x"].tolist() == [5, 5]

    def test_keep_none_keeps_all(self, tmp_path):
        for step in range(5):
            save_checkpoint(tmp_path, step, {"x": jnp.zeros(1)}, keep=None)
        assert CheckpointManager(tmp_path).all_steps() == [0, 1, 2, 3, 4]

    def test_empty_or_missing_directory(self, tmp_path):
        assert latest_step(tmp_path / "nope") is None and CheckpointManager(tmp_path).all_steps() == []
        with pytest.raises(CheckpointError, match="no checkpoint in .*nope"):
            restore_checkpoint(tmp_path / "nope", {"x": jnp.zeros(1)})

    def test_missing_step(self, tmp_path):
        save_checkpoint(tmp_path, 2, {"x": jnp.zeros(1)})
        with pytest.raises(CheckpointError, match=r"no checkpoint of step 3 .* has steps \[2\]"):
            restore_checkpoint(tmp_path, {"x": jnp.zeros(1)}, step=3)

    def test_other_files_are_ignored(self, tmp_path):
        (tmp_path / "notes.txt").write_text("hello")
        (tmp_path / "step_x").mkdir()
        save_checkpoint(tmp_path, 1, {"x": jnp.zeros(1)})
        assert latest_step(tmp_path) == 1

    def test_same_or_earlier_step_needs_overwrite(self, tmp_path):
        manager = CheckpointManager(tmp_path, keep=None)
        for step in (2, 4, 6):
            manager.save(step, {"x": jnp.full(1, step)})
        with pytest.raises(CheckpointError, match=r"already has a checkpoint of step 4.*overwrite=True"):
            manager.save(4, {"x": jnp.zeros(1)})
        with pytest.raises(CheckpointError, match=r"checkpoints of later steps \[4, 6\]"):
            manager.save(3, {"x": jnp.zeros(1)})
        assert manager.all_steps() == [2, 4, 6]
        manager.save(4, {"x": jnp.full(1, 40)}, overwrite=True)  # a run restarted from step 4
        assert manager.all_steps() == [2, 4]
        assert manager.restore({"x": jnp.zeros(1, jnp.int32)})[1]["x"].tolist() == [40]
        assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004"]

    def test_only_process_zero_writes(self, tmp_path, monkeypatch):
        monkeypatch.setattr(jax, "process_index", lambda: 1)
        path = save_checkpoint(tmp_path / "c", 5, {"x": jnp.zeros(1)})
        assert path == str(tmp_path / "c" / "step_00000005") and not (tmp_path / "c").exists()

    def test_bad_arguments(self, tmp_path):
        with pytest.raises(ValueError, match="keep= must be a positive int"):
            CheckpointManager(tmp_path, keep=0)
        with pytest.raises(CheckpointError, match="step must be a non-negative int"):
            save_checkpoint(tmp_path, -1, {"x": jnp.zeros(1)})
        with pytest.raises(CheckpointError, match=r"state\['s'\] is of type str; .*numbers or booleans"):
            save_checkpoint(tmp_path, 1, {"s": "abc"})  # no dtype to name
        with pytest.raises(CheckpointError, match=r"state\['s'\] is of type ndarray and dtype <U1; .*numbers or"):
            save_checkpoint(tmp_path, 1, {"s": np.array(["a", "b"])})
        with pytest.raises(CheckpointError, match="extra= must be JSON-serializable.*tolist"):
            save_checkpoint(tmp_path, 1, {"x": jnp.zeros(1)}, extra={"pos": np.arange(2)})
        assert os.listdir(tmp_path) == []  # nothing was written


class TestRestoreChecks:
    @pytest.fixture
    def saved(self, tmp_path):
        state = {"w": jnp.zeros(3), "b": jnp.zeros((), jnp.int32)}
        save_checkpoint(tmp_path, 1, state)
        return tmp_path, state

    def _still_restorable(self, directory, state):
        _assert_same(restore_checkpoint(directory, state)[1], state)

    def test_shape_mismatch_names_the_leaf(self, saved):
        directory, state = saved
        msg = (
            r"checkpoint .*step_00000001 has state\['w'\] of shape \(3,\) float32 but the model expects \(4,\) float32"
        )
        with pytest.raises(CheckpointError, match=msg):
            restore_checkpoint(directory, {"w": jnp.zeros(4), "b": jnp.zeros((), jnp.int32)})
        self._still_restorable(directory, state)

    def test_dtype_mismatch(self, saved):
        directory, _ = saved
        with pytest.raises(
            CheckpointError, match=r"state\['b'\] of shape \(\) int32 but the model expects \(\) float32"
        ):
            restore_checkpoint(directory, {"w": jnp.zeros(3), "b": jnp.zeros(())})

    def test_another_model(self, saved):
        directory, state = saved
        with pytest.raises(
            CheckpointError,
            match=r"model expects state\['v'\], which the checkpoint lacks; the "
            r"checkpoint has state\['w'\], which the model lacks",
        ):
            restore_checkpoint(directory, {"v": jnp.zeros(3), "b": jnp.zeros((), jnp.int32)})
        with pytest.raises(CheckpointError, match=r"the model expects state\['c'\].*\(2 arrays saved, 3 expected\)"):
            restore_checkpoint(directory, {**state, "c": jnp.zeros(1)})
        with pytest.raises(CheckpointError, match=r"the checkpoint has state\['w'\], which the model lacks"):
            restore_checkpoint(directory, {"b": state["b"]})
        self._still_restorable(directory, state)

    def test_truncated_arrays(self, saved):
        directory, state = saved
        arrays = directory / "step_00000001" / "arrays.npz"
        data = arrays.read_bytes()
        arrays.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError, match=rf"truncated or corrupt \({len(data) // 2} bytes, {len(data)} when"):
            restore_checkpoint(directory, state)

    def test_corrupt_byte(self, saved):
        directory, state = saved
        arrays = directory / "step_00000001" / "arrays.npz"
        data = bytearray(arrays.read_bytes())
        data[len(data) // 2] ^= 0xFF
        arrays.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="sha256 differs from the manifest"):
            restore_checkpoint(directory, state)

    @pytest.mark.parametrize(
        "manifest, match",
        [
            ("{not json", "is not valid JSON"),
            ('{"format": "orbax"}', "not a replicator checkpoint manifest"),
            ('{"format": "replicator-checkpoint", "version": 99}', "format version 99"),
            ('{"format": "replicator-checkpoint", "version": 1}', "lacks .*the checkpoint is damaged"),
            ("[1, 2]", "not a replicator checkpoint manifest"),
        ],
    )
    def test_foreign_or_damaged_manifest(self, saved, manifest, match):
        directory, state = saved
        (directory / "step_00000001" / "manifest.json").write_text(manifest)
        with pytest.raises(CheckpointError, match=match):
            restore_checkpoint(directory, state)

    def test_missing_files(self, saved):
        directory, state = saved
        (directory / "step_00000001" / "arrays.npz").unlink()
        with pytest.raises(CheckpointError, match="lacks arrays.npz"):
            restore_checkpoint(directory, state)
        (directory / "step_00000001" / "manifest.json").unlink()
        with pytest.raises(CheckpointError, match="has no manifest.json"):
            restore_checkpoint(directory, state)

    def test_never_unpickles(self, tmp_path):
        """A pickled object array with a matching checksum is refused, and its payload never runs."""
        marker = tmp_path / "pwned"

        class Payload:
            def __reduce__(self):
                return (pathlib.Path.touch, (marker,))

        save_checkpoint(tmp_path, 1, {"x": jnp.zeros(1)})
        path = tmp_path / "step_00000001"
        evil = np.empty(1, dtype=object)
        evil[0] = Payload()
        with open(path / "arrays.npz", "wb") as f:
            np.savez(f, a0=evil)  # numpy pickles object arrays
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["arrays_sha256"] = hashlib.sha256((path / "arrays.npz").read_bytes()).hexdigest()
        _reseal(path, manifest)
        with pytest.raises(CheckpointError, match="cannot read arrays.npz.*allow_pickle=False"):
            restore_checkpoint(tmp_path, {"x": jnp.zeros(1)})
        assert not marker.exists()

    def test_stored_dtype_differs_from_manifest(self, saved):
        directory, state = saved
        path = directory / "step_00000001"
        with open(path / "arrays.npz", "wb") as f:
            np.savez(f, a0=np.zeros((), np.int64), a1=np.zeros(3, np.float32))
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["arrays_sha256"] = hashlib.sha256((path / "arrays.npz").read_bytes()).hexdigest()
        _reseal(path, manifest)
        with pytest.raises(CheckpointError, match=r"state\['b'\]\) is stored as int64, its manifest says int32"):
            restore_checkpoint(directory, state)


class TestAtomicity:
    def test_failure_while_writing_arrays_keeps_the_last_checkpoint(self, tmp_path, monkeypatch):
        manager = CheckpointManager(tmp_path, keep=1)
        manager.save(1, {"x": jnp.full(4, 1.0)})

        def half_then_fail(path, arrays):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04" + b"\0" * 100)  # the start of a zip file
            raise OSError("disk full")

        monkeypatch.setattr(ckpt_files, "write_arrays", half_then_fail)
        with pytest.raises(OSError, match="disk full"):
            manager.save(2, {"x": jnp.full(4, 2.0)})
        assert manager.all_steps() == [1] and os.listdir(tmp_path) == ["step_00000001"]
        assert manager.restore({"x": jnp.zeros(4)})[1]["x"].tolist() == [1.0] * 4

    def test_failure_before_the_rename(self, tmp_path, monkeypatch):
        manager = CheckpointManager(tmp_path, keep=1)
        manager.save(1, {"x": jnp.full(4, 1.0)})

        def fail(path):
            raise OSError("I/O error")

        monkeypatch.setattr(ckpt_files, "fsync_dir", fail)
        with pytest.raises(OSError, match="I/O error"):
            manager.save(2, {"x": jnp.full(4, 2.0)})
        assert manager.all_steps() == [1]
        assert manager.restore({"x": jnp.zeros(4)})[1]["x"].tolist() == [1.0] * 4

    def test_crash_while_overwriting_keeps_the_old_checkpoint(self, tmp_path, monkeypatch):
        manager = CheckpointManager(tmp_path, keep=None)
        manager.save(1, {"x": jnp.full(2, 1.0)})
        real_rename = os.rename

        def rename(src, dst):
            if os.path.basename(src).startswith(".tmp-"):
                raise KeyboardInterrupt  # dies after the old one was moved aside
            real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(KeyboardInterrupt):
            manager.save(1, {"x": jnp.full(2, 9.0)}, overwrite=True)
        monkeypatch.setattr(os, "rename", real_rename)
        assert manager.all_steps() == [1]  # the moved-aside checkpoint still counts
        assert manager.restore({"x": jnp.zeros(2)})[1]["x"].tolist() == [1.0, 1.0]
        manager.save(2, {"x": jnp.full(2, 2.0)})  # the next save tidies up
        assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]
        assert manager.restore({"x": jnp.zeros(2)}, step=1)[1]["x"].tolist() == [1.0, 1.0]

    @staticmethod
    def _kill_while_saving(directory: pathlib.Path) -> None:
        """Start a process that saves large checkpoints in a loop; SIGKILL it mid-save."""
        code = textwrap.dedent(
            f"""
            import itertools, numpy as np
            from replicator.training.checkpoint import save_checkpoint
            for step in itertools.count(1):
                state = {{"w": np.full(4_000_000, step, np.float32), "step": np.int32(step)}}
                save_checkpoint({str(directory)!r}, step, state, extra={{"input_position": step}}, keep=2)
            """
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                steps = CheckpointManager(directory).all_steps()
                names = os.listdir(directory) if directory.exists() else []
                if steps and steps[-1] >= 2 and any(n.startswith(".tmp-") for n in names):
                    break  # a save of a later step is under way
                time.sleep(0.002)
            assert proc.poll() is None, proc.stderr.read().decode()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL

    def test_sigkill_during_large_saves(self, tmp_path):
        """Kill -9 a process while it saves; the newest complete checkpoint restores."""
        for attempt in range(3):  # the save may, rarely, finish between our look and the kill
            directory = tmp_path / f"ckpt{attempt}"
            self._kill_while_saving(directory)
            if any(n.startswith(".tmp-") for n in os.listdir(directory)):
                break
        else:
            pytest.fail("the process was never killed in the middle of a save")
        manager = CheckpointManager(directory, keep=2)
        target = {"w": jax.ShapeDtypeStruct((4_000_000,), jnp.float32), "step": jnp.int32(0)}
        step, state, extra = manager.restore(target)
        assert step >= 2 and int(state["step"]) == step and extra == {"input_position": step}
        np.testing.assert_array_equal(state["w"], np.full(4_000_000, step, np.float32))
        manager.save(step + 1, {"w": np.zeros(4_000_000, np.float32), "step": np.int32(0)})
        assert not any(n.startswith(".") for n in os.listdir(directory))  # the half-written save is removed


# -- bit-identical resumption through Replicator.run ---------------------------------------

GLOBAL_ROWS = 32


def _batches(ctx):
    """Deterministic per step and worker."""
    rows = ctx.worker_batch_size(GLOBAL_ROWS)
    for i in range(1000):
        rng = np.random.default_rng([i, ctx.worker_id])
        x = rng.normal(size=(rows, 3)).astype(np.float32)
        yield {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1).astype(np.float32)}


_opt = optax.adam(0.05)


def _train_step(state, batch):
    params, opt_state = state

    def loss_fn(p):
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = _opt.update(rp.all_mean(grads), opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": rp.all_mean(loss)}


def _init():
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    return params, _opt.init(params)


def test_resume_is_bit_identical(tmp_path, repl2d):
    total, k = 7, 4

    def ref_input(ctx):  # a new function: Replicator continues the iterators of one it has seen
        return _batches(ctx)

    ref = _init()
    for _ in range(total):
        ref, _ = repl2d.run(_train_step, ref_input, ref)

    def input_fn(ctx):
        return _batches(ctx)

    state = _init()
    for step in range(1, k + 1):
        state, _ = repl2d.run(_train_step, input_fn, state)
        save_checkpoint(tmp_path, step, state, extra={"input_position": step}, keep=2)
    del state  # "crash"

    fresh = rp.Replicator(repl2d.num_workers, repl2d.cores_per_worker)
    step, state, extra = restore_checkpoint(tmp_path, _init())
    assert step == k and extra["input_position"] == k

    def resumed_input(ctx):
        batches = _batches(ctx)
        for _ in range(extra["input_position"]):
            next(batches)
        return batches

    for _ in range(step, total):
        state, _ = fresh.run(_train_step, resumed_input, state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(state[0]["w"]).sum()) > 0  # it did train


# -- found by mutation testing (scripts/mutate.py) ---------------------------------------
# Corners of replicator/training/checkpoint/ that scripts/mutate.py found untested.
#
# Process 0's side of the multi-process agreement, the bounded wait for a background save,
# a lock file that keeps being replaced, orbax export of typed keys, the manifest digest of
# non-ASCII extras, malformed shard indices, and the multi-process restore paths that a
# single process reaches with ``jax.process_count`` patched (as test_checkpoint.py patches
# ``jax.process_index``).


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


# -- agreement: process 0's side ----------------------------------------------------------


def test_process_zero_learns_its_own_temporary_and_raises_its_own_error():
    """In a one-process run process 0 is the sender: it gets its name back, or its own exception (not a copy)."""
    assert jax.process_index() == 0
    assert (
        ckpt_agreement.share_temporary(None, ".tmp-step_00000003-abc", "/c/step_00000003") == ".tmp-step_00000003-abc"
    )
    error = OSError("disk full")
    with pytest.raises(OSError, match="^disk full$") as info:
        ckpt_agreement.share_temporary(error, "", "/c/step_00000003")
    assert info.value is error


# -- the background save's bounded wait -----------------------------------------------------


def test_join_gives_up_on_a_stuck_save_after_its_timeout_not_a_second_later():
    release = threading.Event()
    save = ckpt_background.BackgroundSave(7, "/c/step_00000007", lambda: release.wait(30))
    # Each wait on the thread is bounded by what is left of the timeout (read from the waits asked
    # for, not from the clock: a loaded machine may take long to wake a thread up).
    asked: list[float] = []
    thread_join = save._thread.join

    def spy(timeout=None):
        asked.append(timeout)
        thread_join(timeout)

    save._thread.join = spy
    try:
        start = time.monotonic()
        failure = save.join(0.05)
        elapsed = time.monotonic() - start
        assert isinstance(failure, CheckpointError) and "still writing after 0.05 s" in str(failure)
        assert asked and all(t is not None and t <= 0.05 for t in asked), asked
        assert elapsed < 10, f"join(0.05) waited {elapsed:.2f} s"
        assert save.running
    finally:
        release.set()
    assert save.join(10) is None and not save.running


# -- the directory lock ---------------------------------------------------------------------


def test_a_lock_file_replaced_on_every_try_is_not_taken(tmp_path, monkeypatch):
    """Each locked file turns out to be no longer the path's (another writer replaced it): after its tries, no lock."""
    monkeypatch.setattr(ckpt_files.os.path, "samestat", lambda a, b: False)
    lock = ckpt_files.DirectoryLock(str(tmp_path), ".lock")
    assert lock.acquire() is False
    monkeypatch.undo()
    other = ckpt_files.DirectoryLock(str(tmp_path), ".lock")
    assert other.acquire() is True  # nothing was left locked
    other.release()


# -- orbax interop --------------------------------------------------------------------------


def test_export_orbax_writes_a_typed_key_that_orbax_and_restore_orbax_read_back(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed")
    from replicator.training.checkpoint import restore_orbax

    key = jax.random.key(5)
    state = {"key": key, "w": np.arange(4, dtype=np.float32)}
    path = export_orbax(tmp_path / "exported", state)
    with ocp.StandardCheckpointer() as checkpointer:
        raw = checkpointer.restore(path)
    np.testing.assert_array_equal(np.asarray(raw["w"]), state["w"])
    restored = restore_orbax(path, {"key": jax.random.key(0), "w": jnp.zeros(4)})
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.uniform(restored["key"], (3,)), jax.random.uniform(key, (3,)))


def test_export_orbax_refuses_one_process_of_two_and_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(CheckpointError, match=r"process 0 of 2\).*restore_checkpoint\(directory, host_target\)"):
        export_orbax(tmp_path / "e", {"w": np.zeros(2, np.float32)})
    assert not (tmp_path / "e").exists()


# -- background saves and the watchdog ------------------------------------------------------


def test_a_background_save_never_counts_as_progress_of_the_training_thread(tmp_path, monkeypatch):
    """The watchdog's clock is the training thread's: a background write must not restart it (it would hide a hang)."""
    from replicator.runtime.distributed import progress

    touched_by: list[str] = []
    real_touch = progress.touch

    def touch() -> None:
        touched_by.append(threading.current_thread().name)
        real_touch()

    monkeypatch.setattr(progress, "touch", touch)
    state = {"w": np.arange(3 * 1024, dtype=np.float32), "b": jnp.ones(5)}
    manager = CheckpointManager(tmp_path)
    manager.save_async(4, state)
    manager.wait()
    assert [t for t in touched_by if t != threading.main_thread().name] == []
    _, restored, _ = restore_checkpoint(tmp_path, {"w": np.zeros(3 * 1024, np.float32), "b": jnp.zeros(5)})
    np.testing.assert_array_equal(restored["w"], state["w"])


# -- multi-process restore paths ------------------------------------------------------------


def test_a_restore_onto_host_targets_in_a_multi_process_job_is_not_a_collective(tmp_path, monkeypatch):
    """Targets without a sharding (numpy) span no process: each process just reads, no agreement is asked for."""
    save_checkpoint(tmp_path, 3, {"w": np.arange(4, dtype=np.float32)})
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    asked: list[str] = []
    monkeypatch.setattr(ckpt_agreement, "check_same_checkpoint", asked.append)
    step, restored, _ = restore_checkpoint(tmp_path, {"w": np.zeros(4, np.float32)})
    assert step == 3 and asked == []
    np.testing.assert_array_equal(restored["w"], np.arange(4, dtype=np.float32))


class _SpansProcesses:
    """A sharding as a multi-process job has it: not every device is this process's."""

    is_fully_addressable = False


def test_a_failed_read_on_a_spanning_restore_tells_the_others_and_raises_its_own_error(tmp_path, monkeypatch):
    """The read error is shared (so the others fail too rather than wait) and raised, not the agreement's own error."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(ckpt_encoding, "target_sharding", lambda target: _SpansProcesses())
    told: list[str] = []

    def check_same_checkpoint(what: str) -> None:
        told.append(what)
        raise CheckpointError("the processes read different checkpoints")

    monkeypatch.setattr(ckpt_agreement, "check_same_checkpoint", check_same_checkpoint)
    with pytest.raises(CheckpointError, match="no checkpoint") as info:
        restore_checkpoint(tmp_path, {"w": np.zeros(4, np.float32)})
    assert "different checkpoints" not in str(info.value)
    assert len(told) == 1 and told[0].startswith("error: ") and str(info.value) in told[0]


# -- the manifest ---------------------------------------------------------------------------


def test_the_manifest_digest_is_over_ascii_json_so_non_ascii_extras_keep_their_digest(tmp_path):
    """The digest is sha256 of the manifest as canonical ASCII JSON (sorted keys, no spaces, \\u escapes)."""
    extra = {"note": "résumé ✓", "input_position": 3}
    path = Path(save_checkpoint(tmp_path, 3, {"w": np.zeros(2, np.float32)}, extra=extra))
    manifest = _manifest(path)
    content = {k: v for k, v in manifest.items() if k not in ("manifest_sha256", "path")}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))  # JSON's default: ensure_ascii
    assert "\\u00e9" in canonical
    assert manifest["manifest_sha256"] == hashlib.sha256(canonical.encode("ascii")).hexdigest()
    assert restore_checkpoint(tmp_path, {"w": np.zeros(2, np.float32)})[2] == extra


@pytest.fixture
def sharded(tmp_path, n_devices):
    if n_devices < 2:
        pytest.skip("no leaf is split over one device")
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    x = jax.device_put(np.arange(2 * n_devices * 3, dtype=np.float32).reshape(2 * n_devices, 3), sharding)
    path = Path(save_checkpoint(tmp_path, 2, {"x": x}))
    return tmp_path, path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}


@pytest.mark.parametrize(
    "index",
    [[[0, 2, 2], [0, 3]], [[0], [0, 3]], [["0", "2"], [0, 3]]],
    ids=["three-numbers", "one-number", "strings"],
)
def test_a_shard_index_that_is_not_start_stop_pairs_is_refused(sharded, index):
    directory, path, target = sharded
    manifest = _manifest(path)
    manifest["leaves"][0]["shards"][0]["index"] = index
    manifest["manifest_sha256"] = ckpt_manifest.manifest_digest(manifest)  # a forger who knows the format
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt_manifest.DamagedCheckpoint, match=r"record 0 has index .*, expected \[start, stop\]"):
        restore_checkpoint(directory, target, step=2)


def test_a_snapshot_holds_this_process_shards_matched_by_value_not_identity():
    """A process finds its own shard records by its index's value: in a job of more than 256 processes the
    record's index and ``jax.process_index()`` are equal ints that are different objects."""
    from replicator.training.checkpoint import shards, snapshot

    device = jax.devices()[0]
    leaf = jax.device_put(jnp.arange(4.0), device)
    process = int("300")  # as jax.process_index() would return it
    record = shards.Record(0, ((0, 4),), 299 + 1, device, 0, 16)  # as the plan computes it
    assert record.process == process and record.process is not process
    entries = [{"shape": [4], "dtype": "float32"}]
    snap = snapshot.capture([leaf], entries, {0: [record]}, process, writer=False, copy_on_device=False)
    assert list(snap.shards) == [(0, ((0, 4),))]
    np.testing.assert_array_equal(np.asarray(snap.shards[0, ((0, 4),)]), np.arange(4.0))


def test_an_edited_version_2_manifest_is_refused(tmp_path):
    """Version 2 manifests carry a digest too: one edited without re-sealing is refused like a version 3 one."""
    path = Path(save_checkpoint(tmp_path, 4, {"w": np.arange(3, dtype=np.float32)}, extra={"lr": 0.1}))
    manifest = _manifest(path)
    manifest["version"] = 2  # no leaf of this checkpoint has shards: a valid version 2 manifest once resealed
    _reseal(path, manifest)
    assert restore_checkpoint(tmp_path, {"w": np.zeros(3, np.float32)})[2] == {"lr": 0.1}
    manifest["extra"] = {"lr": 0.2}  # edited, the digest left as it was
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt_manifest.DamagedCheckpoint, match="modified or corrupted"):
        restore_checkpoint(tmp_path, {"w": np.zeros(3, np.float32)})


def test_every_data_file_is_fsynced_before_the_step_directory_is_renamed_into_place(tmp_path, n_devices, monkeypatch):
    """A crash after the commit leaves whole files: arrays.npz, the shard files and the manifest are each fsynced
    before the rename that commits the step."""
    from jax.sharding import Mesh

    events: list[tuple] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", os.fspath(dst)))
        return real_rename(src, dst, *args, **kwargs)

    state = {"w": np.arange(3, dtype=np.float32)}
    if n_devices >= 2:
        mesh = Mesh(np.array(jax.devices()), ("d",))
        state["x"] = jax.device_put(np.arange(2.0 * n_devices, dtype=np.float32), NamedSharding(mesh, P("d")))
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    final = Path(save_checkpoint(tmp_path, 5, state))
    monkeypatch.undo()
    commit = events.index(("rename", os.fspath(final)))
    synced = {ino for kind, ino in events[:commit] if kind == "fsync"}
    data = [p for p in final.iterdir() if p.is_file()]
    assert "arrays.npz" in {p.name for p in data} and "manifest.json" in {p.name for p in data}
    if n_devices >= 2:
        assert len(data) > 2, f"no shard file among {sorted(p.name for p in data)}"
    for p in data:
        assert p.stat().st_ino in synced, f"{p.name} was not fsynced before the step directory's rename"


def test_fallback_skips_only_damaged_checkpoints_not_one_that_does_not_fit_the_target(tmp_path):
    """An intact newest checkpoint of another shape is the caller's error: restore(fallback=True) says so rather
    than silently restoring an older checkpoint that happens to fit."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"w": np.arange(3, dtype=np.float32)})
    manager.save(2, {"w": np.arange(4, dtype=np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipped it; restoring the newest intact checkpoint" warning
        with pytest.raises(CheckpointError, match=r"has state\['w'\] of shape .*but the model expects") as info:
            manager.restore({"w": np.zeros(3, np.float32)}, fallback=True)
    assert "no intact checkpoint" not in str(info.value)
    assert not isinstance(info.value, ckpt_manifest.DamagedCheckpoint)
    step, restored, _ = manager.restore({"w": np.zeros(4, np.float32)}, fallback=True)
    assert step == 2
    np.testing.assert_array_equal(restored["w"], np.arange(4, dtype=np.float32))


# -- promises without a test before (issue #41 item 4) --------------------------------------
# Each module of replicator/training/checkpoint/ lists its promises at the end of its docstring, each with
# the test that checks it; these are the tests written for the promises that had none.

# Every dtype a JAX state holds without x64 (64-bit numpy leaves are narrowed as JAX narrows them).
_DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]


@hypothesis.settings(max_examples=60, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    dtype=st.sampled_from(_DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    seed=st.integers(0, 2**32 - 1),
    on_device=st.booleans(),
)
def test_a_leaf_round_trips_through_its_stored_array_with_its_dtype_shape_and_bits(dtype, shape, seed, on_device):
    """encoding: entry -> stored -> an .npz read with allow_pickle=False -> decode gives the leaf back, bit for bit,
    with its own dtype and shape (bfloat16, float8, float16, int8, bool, 0-d ones too), on the host or not."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1  # a bool byte is 0 or 1
    value = raw.view(dtype).reshape(shape)
    leaf = jnp.asarray(value) if on_device else value
    entry = ckpt_encoding.entry("['x']", leaf)
    assert entry["dtype"] == dtype.name and entry["shape"] == list(shape)
    array = ckpt_encoding.stored(leaf, entry)
    assert array.dtype == np.dtype(ckpt_encoding.stored_dtype(entry)) and array.dtype.isbuiltin == 1
    buffer = io.BytesIO()
    np.savez(buffer, a0=array)
    buffer.seek(0)
    with np.load(buffer, allow_pickle=False) as npz:
        back = ckpt_encoding.decode(npz["a0"], entry)
    assert back.dtype == dtype and back.shape == tuple(shape)
    assert back.tobytes() == value.tobytes()


# -- agreement ------------------------------------------------------------------------------


def test_an_attempt_keeps_an_exception_only_in_a_multi_process_job_and_never_a_keyboard_interrupt():
    alone = ckpt_agreement.Attempt(multi=False)
    with pytest.raises(OSError, match="disk full"), alone:
        raise OSError("disk full")
    assert alone.error is None
    multi = ckpt_agreement.Attempt(multi=True)
    with multi:
        raise OSError("disk full")  # kept for the collective that follows
    assert isinstance(multi.error, OSError)
    interrupted = ckpt_agreement.Attempt(multi=True)
    with pytest.raises(KeyboardInterrupt), interrupted:
        raise KeyboardInterrupt
    assert interrupted.error is None


def test_a_process_other_than_zero_learns_the_temporary_or_raises_process_zeros_error_quoted(monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    sent = []

    def from_process0(value, told):
        sent.append(value)
        return told

    failed = (np.int32(1), ckpt_agreement._pack("OSError: disk full"))
    monkeypatch.setattr(ckpt_agreement, "from_process0", lambda value: from_process0(value, failed))
    with pytest.raises(
        CheckpointError, match=r"^process 0 failed to save the checkpoint /c/step_00000003: OSError: disk full$"
    ):
        ckpt_agreement.share_temporary(None, "", "/c/step_00000003")
    told = (np.int32(0), ckpt_agreement._pack(".tmp-step_00000003-abc-1"))
    monkeypatch.setattr(ckpt_agreement, "from_process0", lambda value: from_process0(value, told))
    assert ckpt_agreement.share_temporary(None, "", "/c/step_00000003") == ".tmp-step_00000003-abc-1"
    assert len(sent) == 2  # every process takes part in the collective


def test_a_process_that_wrote_its_part_names_the_first_process_that_did_not(monkeypatch):
    from jax.experimental import multihost_utils

    rows = [(0, ""), (1, "OSError: disk full"), (1, "OSError: another")]  # process 0 (this one), 1, 2
    gathered = (np.array([f for f, _ in rows], np.int32), np.stack([ckpt_agreement._pack(m) for _, m in rows]))
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda value: gathered)
    with pytest.raises(
        CheckpointError,
        match=r"^process 1 failed to write its part of the checkpoint /c/step_00000003, so it was not saved: "
        r"OSError: disk full$",
    ):
        ckpt_agreement.agree_written(None, "/c/step_00000003")
    own = OSError("mine")
    with pytest.raises(OSError) as info:
        ckpt_agreement.agree_written(own, "/c/step_00000003")
    assert info.value is own  # the process that failed raises its own exception
    ok = (np.zeros(3, np.int32), np.stack([ckpt_agreement._pack("")] * 3))
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda value: ok)
    assert ckpt_agreement.agree_written(None, "/c/step_00000003") is None


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    head=st.text(st.characters(blacklist_characters="\0"), max_size=20),  # lone surrogates too
    filler=st.sampled_from(["a", "é", "✓", "😀", "\udcff"]),  # 1 to 4 bytes (the cut may fall inside one) or none
    count=st.integers(0, 2100),
    tail=st.text(st.characters(blacklist_characters="\0"), max_size=20),
)
def test_an_error_message_reaches_the_other_processes_whole_or_cut_at_its_bound(head, filler, count, tail):
    """Any message (a path's undecodable byte, as a lone surrogate, included) is packed without an error, which
    would leave the other processes waiting in the collective: whole up to MESSAGE_BYTES bytes, else cut there."""
    text = head + filler * count + tail
    packed = ckpt_agreement._pack(text)
    assert packed.dtype == np.uint8 and packed.shape == (ckpt_agreement.MESSAGE_BYTES,)
    raw = text.encode(errors="backslashreplace")  # what UTF-8 cannot encode, as a \udcxx escape
    got = ckpt_agreement._unpack(packed)
    if len(raw) <= ckpt_agreement.MESSAGE_BYTES:
        assert got == raw.decode()
        assert got == text or any("\ud800" <= c <= "\udfff" for c in text)
    else:  # cut to its first MESSAGE_BYTES bytes, a character split there replaced, never an error
        assert got == raw[: ckpt_agreement.MESSAGE_BYTES].decode(errors="replace")


def test_processes_that_read_different_checkpoints_get_a_checkpoint_error(monkeypatch):
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda local: np.stack([local, local + 1]))
    with pytest.raises(CheckpointError, match="restored checkpoint.*same directory and step= on every process"):
        ckpt_agreement.check_same_checkpoint("step 3 sha256 ab")
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda local: np.stack([local, local]))
    ckpt_agreement.check_same_checkpoint("step 3 sha256 ab")  # the same: no error


# -- background -----------------------------------------------------------------------------


def test_join_returns_what_the_work_raised_even_a_base_exception():
    def raising(error):
        def work():
            raise error

        return work

    for error in (OSError("disk full"), KeyboardInterrupt("stop")):
        save = ckpt_background.BackgroundSave(3, "/c/step_00000003", raising(error))
        assert save.join(60) is error and not save.running
    done = ckpt_background.BackgroundSave(4, "/c/step_00000004", lambda: None)
    assert done.join(60) is None and not done.running
    # Not a daemon: an interpreter that exits without waiting still lets the save finish.
    assert done._thread.name == "replicator-checkpoint-4" and not done._thread.daemon


def test_waiting_for_a_background_save_counts_as_progress_of_the_waiting_thread(monkeypatch):
    from replicator.runtime.distributed import progress

    touched: list[str] = []
    monkeypatch.setattr(progress, "touch", lambda: touched.append(threading.current_thread().name))
    release = threading.Event()
    save = ckpt_background.BackgroundSave(5, "/c/step_00000005", lambda: release.wait(60))
    try:
        assert isinstance(save.join(0.05), CheckpointError)  # still writing
    finally:
        release.set()
    assert save.join(60) is None
    assert touched and set(touched) == {threading.main_thread().name}


# -- the manager ----------------------------------------------------------------------------


def test_the_directory_is_fsynced_after_the_rename_that_commits_a_checkpoint(tmp_path, monkeypatch):
    """The rename is durable: a power cut after save() returns cannot undo it."""
    events: list[tuple[str, str]] = []
    real_fsync_dir, real_rename = ckpt_files.fsync_dir, os.rename

    def fsync_dir(path):
        events.append(("fsync_dir", os.path.realpath(path)))
        real_fsync_dir(path)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", os.path.realpath(dst)))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(ckpt_files, "fsync_dir", fsync_dir)
    monkeypatch.setattr(os, "rename", rename)
    final = save_checkpoint(tmp_path, 5, {"w": np.arange(3, dtype=np.float32)})
    monkeypatch.undo()
    commit = events.index(("rename", os.path.realpath(final)))
    assert ("fsync_dir", os.path.realpath(tmp_path)) in events[commit + 1 :], events


@hypothesis.settings(max_examples=25, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    gaps=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    keep=st.none() | st.integers(1, 4),
    restart=st.none() | st.integers(0, 24),
)
def test_pruning_keeps_exactly_the_keep_newest_checkpoints(gaps, keep, restart):
    """After every save the directory holds exactly the ``keep`` newest steps (all with keep=None), also after
    an overwrite=True save of an earlier step (a restart), which first discards the steps after it."""
    steps = list(itertools.accumulate(gaps))
    with tempfile.TemporaryDirectory() as directory:
        manager = CheckpointManager(directory, keep=keep)
        expected: list[int] = []
        for step in [*steps, *([] if restart is None else [restart])]:
            overwrite = bool(expected) and step <= expected[-1]
            manager.save(step, {"x": np.full(2, step, np.int32)}, overwrite=overwrite)
            expected = sorted({s for s in expected if s < step} | {step})
            expected = expected if keep is None else expected[-keep:]
            assert manager.all_steps() == expected
            assert sorted(os.listdir(directory)) == [f"step_{s:08d}" for s in expected]
        assert manager.restore({"x": np.zeros(2, np.int32)})[1]["x"].tolist() == [expected[-1]] * 2


def test_a_restore_spanning_processes_asks_them_all_to_have_read_the_same_step_and_digest(tmp_path, monkeypatch):
    path = Path(save_checkpoint(tmp_path, 3, {"w": np.arange(4, dtype=np.float32)}))
    digest = _manifest(path)["manifest_sha256"]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(ckpt_encoding, "target_sharding", lambda target: _SpansProcesses())
    monkeypatch.setattr(ckpt_encoding, "place_like", lambda leaf, sharding: leaf)
    told: list[str] = []
    monkeypatch.setattr(ckpt_agreement, "check_same_checkpoint", told.append)
    step, restored, _ = restore_checkpoint(tmp_path, {"w": np.zeros(4, np.float32)})
    assert step == 3 and told == [f"step 3 sha256 {digest}"]
    np.testing.assert_array_equal(restored["w"], np.arange(4, dtype=np.float32))


# -- interop --------------------------------------------------------------------------------


def test_restore_and_export_orbax_without_orbax_say_how_to_install_it(tmp_path, monkeypatch):
    from replicator.training.checkpoint import restore_orbax

    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # `import orbax.checkpoint` raises ImportError
    with pytest.raises(CheckpointError, match=r"need orbax-checkpoint.*pip install 'replicator\[orbax\]'"):
        restore_orbax(tmp_path, {"w": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match=r"need orbax-checkpoint.*pip install 'replicator\[orbax\]'"):
        export_orbax(tmp_path / "e", {"w": np.zeros(2, np.float32)})
    assert not (tmp_path / "e").exists()


# -- the promises themselves ----------------------------------------------------------------

_MODULES = ["agreement", "background", "encoding", "files", "interop", "manager", "manifest", "shards", "snapshot"]


@pytest.mark.parametrize("name", _MODULES)
def test_every_promise_of_a_checkpoint_module_cites_tests_that_exist(name):
    """Each module's docstring ends with "Promises:", a numbered list whose every item names its tests."""
    import ast
    import importlib
    import re

    module = importlib.import_module(f"replicator.training.checkpoint.{name}")
    doc = module.__doc__
    assert "\nPromises:\n" in doc, f"{name} has no Promises: section"
    items = re.split(r"\n(?=\d+\. )", doc.split("\nPromises:\n", 1)[1].strip())
    assert [int(item.split(".", 1)[0]) for item in items] == list(range(1, len(items) + 1))
    root = Path(__file__).resolve().parent
    for item in items:
        cited = re.findall(r"(tests/[\w/]+\.py)::([\w:]+)", item)
        assert cited, f"{name}: promise {item[:60]!r} cites no test"
        for file, test in cited:
            tree = ast.parse((root.parent / file).read_text())
            scope = tree.body
            for part in test.split("::"):
                found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
                assert found, f"{name}: {file}::{test} does not exist"
                scope = found[0].body
