"""Sharded checkpoints: leaves split over devices are written as their shards and restored onto any layout.

A ZeRO state saved on one mesh (2 x 4 devices, Adam's mu/nu split 1/8 per
device) restores onto another (4 devices replicated, 4 devices with two
replicas each, ...) and back, and training goes on to the numbers of an
uninterrupted run: the reference is ``jax.jit`` of the same step on the
global batch on one device, compared with ``atol=1e-5`` (float32 Adam, a few
steps; the replicated runs differ from it only in the order of the sums).
Also: the files hold each shard once (no whole copy of a split leaf), a
corrupt shard is detected and skipped with ``fallback=True``, the manifest's
shard records are checked, version 2 checkpoints still read, and
``rp.gather_outputs`` reads a split state whole. The 2-process job at the end
restores onto a layout split over both processes (each reading only the
records its devices need) and saves with each process writing its own shards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.training.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from replicator.training.checkpoint import encoding as ckpt_encoding
from replicator.training.checkpoint import files as ckpt_files
from replicator.training.checkpoint import manifest as ckpt_manifest

ROOT = Path(__file__).resolve().parent.parent
MULTIPROC = Path(__file__).resolve().parent / "multiproc"
ATOL = 1e-5  # against one-device jit of the same steps (float32; only the order of the sums differs)
TOTAL, SAVE_AT = 6, 3


def _load_model():
    spec = importlib.util.spec_from_file_location("multiproc_train_sharded", MULTIPROC / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model = _load_model()  # the MLP, Adam, batches and replicated step of tests/multiproc/train.py


def _init_state():
    params = model.init_params()
    return params, model.tx.init(params)


@jax.jit
def _reference_step(state, batch):
    """The step of ``model.train_step`` on one device, over the global batch (no replicas)."""
    params, opt_state = state
    loss, grads = jax.value_and_grad(model.loss_fn)(params, batch)
    updates, opt_state = model.tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


@pytest.fixture(scope="module")
def reference():
    """The one-device run: the state after each step (host arrays) and the losses."""
    state = jax.device_put(_init_state(), jax.devices()[0])
    states, losses = [jax.tree.map(np.asarray, state)], []
    for step in range(TOTAL):
        state, loss = _reference_step(state, model.global_batch(step))
        states.append(jax.tree.map(np.asarray, state))
        losses.append(float(loss))
    return states, np.asarray(losses)


def _assert_close(got, want, what: str) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, atol=ATOL, rtol=0, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def _layout(name: str) -> rp.Replicator:
    """A Replicator of each layout the tests move checkpoints between (8 emulated devices)."""
    zero = rp.PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0)
    zero3 = rp.PassManager.default(zero=3, shard_optimizer_min_bytes=0)  # parameters split too
    four = jax.devices()[:4]
    return {
        "2x4-zero": lambda: rp.Replicator(2, 4, passes=zero),
        "2x4-zero3": lambda: rp.Replicator(2, 4, passes=zero3),
        "1x4": lambda: rp.Replicator(1, 4, devices=four),
        "1x4-zero": lambda: rp.Replicator(1, 4, devices=four, passes=zero),
        "1x8-on-4-zero": lambda: rp.Replicator(
            1, 8, devices=four, parallelism=rp.Parallelism(replicas_per_device=2), passes=zero
        ),
        "1x8-zero3": lambda: rp.Replicator(1, 8, passes=zero3),
        "1x8-on-4-zero3": lambda: rp.Replicator(
            1, 8, devices=four, parallelism=rp.Parallelism(replicas_per_device=2), passes=zero3
        ),
    }[name]()


def _train(repl: rp.Replicator, state, first: int, last: int):
    losses = []
    input_fn = model.input_fn_for(first)
    for _ in range(first, last):
        state, out = repl.run(model.train_step, input_fn, state)
        losses.append(float(rp.replica_invariant(out)["loss"]))
    return state, np.asarray(losses)


def _split(state) -> int:
    """How many leaves (arrays or ShapeDtypeStructs) are split over devices."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(state)]
    return sum(s is not None and not s.is_fully_replicated for s in shardings)


@pytest.fixture(scope="module")
def multi(n_devices):
    if n_devices < 2:
        pytest.skip("no leaf is split over one device")


@pytest.fixture(scope="module")
def n8(n_devices):
    if n_devices != 8:
        pytest.skip("these layouts need 8 devices")


# -- restoring onto another layout, then training on -----------------------------------


@pytest.mark.parametrize(
    "saved_on, restored_on",
    [
        ("2x4-zero", "1x4"),  # 8 devices, sharded -> 4 devices, replicated
        ("1x4", "2x4-zero"),  # and back
        ("1x4-zero", "2x4-zero"),  # 4 shards -> 8: each target shard is half a stored one
        ("2x4-zero", "1x8-on-4-zero"),  # 8 shards -> 4 devices with two replicas each
        ("2x4-zero3", "1x4"),  # ZeRO-3 (parameters split) on 2x4 -> stage 0 on 1x4
        ("1x4", "2x4-zero3"),  # and back
        ("2x4-zero3", "1x8-zero3"),  # the same 8 devices, another mesh shape
        ("1x8-on-4-zero3", "2x4-zero"),  # 8 replicas folded on 4 devices, stage 3 -> unfolded, stage 1
    ],
)
def test_restore_onto_another_layout_trains_on(tmp_path, n8, reference, saved_on, restored_on):
    states, ref_losses = reference
    before = _layout(saved_on)
    state, losses = _train(before, _init_state(), 0, SAVE_AT)
    np.testing.assert_allclose(losses, ref_losses[:SAVE_AT], atol=ATOL, rtol=0)
    assert (_split(state) > 0) == ("zero" in saved_on)
    assert (_split(state[0]) > 0) == ("zero3" in saved_on)  # stage 3 splits the parameters too
    save_checkpoint(tmp_path, SAVE_AT, state, extra={"input_position": SAVE_AT})
    saved = jax.tree.map(np.asarray, state)
    del state

    after = _layout(restored_on)
    probe, _ = after.run(model.train_step, model.input_fn_for(0), _init_state())  # its layout, from a real step
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), probe)
    assert (_split(target) > 0) == ("zero" in restored_on)
    assert (_split(target[0]) > 0) == ("zero3" in restored_on)
    step, restored, extra = restore_checkpoint(tmp_path, target)
    assert step == SAVE_AT and extra == {"input_position": SAVE_AT}
    for a, t, s in zip(jax.tree.leaves(restored), jax.tree.leaves(target), jax.tree.leaves(saved), strict=True):
        assert a.sharding == t.sharding  # onto the target's layout ...
        np.testing.assert_array_equal(np.asarray(a), s)  # ... bit for bit what was saved

    state, losses = _train(after, restored, SAVE_AT, TOTAL)
    np.testing.assert_allclose(losses, ref_losses[SAVE_AT:], atol=ATOL, rtol=0)
    _assert_close(state, states[TOTAL], f"{saved_on} -> {restored_on}")


def test_restore_onto_the_host(tmp_path, n8, reference):
    states, _ = reference
    state, _ = _train(_layout("2x4-zero"), _init_state(), 0, SAVE_AT)
    save_checkpoint(tmp_path, SAVE_AT, state)
    _, host, _ = restore_checkpoint(tmp_path, jax.tree.map(np.asarray, _init_state()))  # numpy: whole arrays
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    _assert_close(host, states[SAVE_AT], "restored on the host")


# -- what is on disk ------------------------------------------------------------------


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_each_shard_is_written_once_at_its_size(tmp_path, repl2d, n_devices):
    if repl2d.num_workers < 2 or repl2d.cores_per_worker < 2:
        pytest.skip("needs a mesh of 2 or more workers of 2 or more cores")
    n = n_devices
    mesh = repl2d.mesh
    rows = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
    state = {
        "split": jax.device_put(rows, NamedSharding(mesh, P(("workers", "cores")))),  # 1/n per device
        "cores": jax.device_put(rows, NamedSharding(mesh, P("cores"))),  # each shard on every worker
        "whole": jax.device_put(np.ones(5, np.float32), NamedSharding(mesh, P())),  # replicated
        "host": np.arange(3, dtype=np.int32),
    }
    path = Path(save_checkpoint(tmp_path, 1, state))
    assert sorted(p.name for p in path.iterdir()) == ["arrays.npz", "manifest.json", "shards-p00000.bin"]
    leaves = {e["path"]: e for e in _manifest(path)["leaves"]}
    for name, parts in (("split", n), ("cores", repl2d.cores_per_worker)):
        records = leaves[f"['{name}']"]["shards"]
        assert len(records) == parts  # a replicated copy of a shard is written once
        assert all(r["bytes"] == rows.nbytes // parts and r["file"] == "shards-p00000.bin" for r in records)
        assert [r["index"][0] for r in records] == [
            [k * 2 * n // parts, (k + 1) * 2 * n // parts] for k in range(parts)
        ]
    # The shard file holds one copy of each split leaf, nothing more; the arrays file none of them.
    assert (path / "shards-p00000.bin").stat().st_size == 2 * rows.nbytes
    with np.load(path / "arrays.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == ["a1", "a3"]  # 'host' and 'whole' (leaves sorted: cores, host, split, whole)
    assert "shards" not in leaves["['whole']"] and "shards" not in leaves["['host']"]
    # Each record is its shard's bytes, checked by its sha256.
    raw = (path / "shards-p00000.bin").read_bytes()
    r = leaves["['split']"]["shards"][1]
    chunk = raw[r["offset"] : r["offset"] + r["bytes"]]
    assert hashlib.sha256(chunk).hexdigest() == r["sha256"]
    np.testing.assert_array_equal(np.frombuffer(chunk, "<f4").reshape(2, 3), rows[2:4])


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.float16, jnp.bfloat16, np.complex64, np.uint32])
def test_every_dtype_round_trips_through_shards(tmp_path, multi, repl2d, dtype):
    n = repl2d.num_replicas
    values = (np.arange(2 * n * 3).reshape(2 * n, 3) % 5).astype(dtype)
    x = jax.device_put(values, NamedSharding(repl2d.mesh, P(("workers", "cores"))))
    path = Path(save_checkpoint(tmp_path, 1, {"x": x}))
    assert "shards" in _manifest(path)["leaves"][0]
    other = NamedSharding(repl2d.mesh, P(None, None))  # replicated: every device reads every record
    for target in (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other)):
        _, restored, _ = restore_checkpoint(tmp_path, {"x": target})
        got = np.asarray(restored["x"])
        assert got.dtype == values.dtype
        np.testing.assert_array_equal(got, values)


def test_a_split_leaf_is_never_gathered(tmp_path, multi, repl2d, monkeypatch):
    # Writing reads each owned shard's data (one device-to-host copy each), never the whole array.
    x = jax.device_put(
        np.ones((2 * repl2d.num_replicas, 3), np.float32), NamedSharding(repl2d.mesh, P(("workers", "cores")))
    )

    def no_whole_copy(leaf, fetch=True):
        raise AssertionError(f"{leaf.shape} was copied to the host whole")

    monkeypatch.setattr(ckpt_encoding, "to_host", no_whole_copy)
    save_checkpoint(tmp_path, 1, {"x": x})
    monkeypatch.undo()
    _, restored, _ = restore_checkpoint(tmp_path, {"x": x})
    np.testing.assert_array_equal(np.asarray(restored["x"]), np.ones((2 * repl2d.num_replicas, 3)))


# -- damage ------------------------------------------------------------------------------


@pytest.fixture
def two_sharded(tmp_path, multi, repl2d):
    """Checkpoints of steps 1 and 2 of a state with a leaf split over every device."""
    sharding = NamedSharding(repl2d.mesh, P(("workers", "cores")))
    n = repl2d.num_replicas
    for step in (1, 2):
        x = jax.device_put(np.full((2 * n, 3), step, np.float32), sharding)
        save_checkpoint(tmp_path, step, {"x": x, "b": np.float32(step)}, keep=None)
    target = {"x": jax.ShapeDtypeStruct((2 * n, 3), jnp.float32, sharding=sharding), "b": np.float32(0)}
    return tmp_path, tmp_path / "step_00000002", target


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_shard_is_detected_and_skipped_with_fallback(two_sharded, damage):
    directory, path, target = two_sharded
    shard_file = path / "shards-p00000.bin"
    data = bytearray(shard_file.read_bytes())
    if damage == "flip":
        data[len(data) // 2 + 1] ^= 0x40
        shard_file.write_bytes(bytes(data))
        match = r"shards-p00000.bin \(the shard of state\['x'\] at .*\) is corrupt \(its sha256 differs"
    elif damage == "truncate":
        shard_file.write_bytes(bytes(data[: len(data) - 5]))
        match = r"is truncated \(19 of 24 bytes\)"  # the last record: 2 rows of 3 float32
    else:
        shard_file.unlink()
        match = "lacks shards-p00000.bin"
    with pytest.raises(ckpt_manifest.DamagedCheckpoint, match=match + r".*fallback=True"):
        restore_checkpoint(directory, target)
    with pytest.warns(RuntimeWarning, match=r"step 2: checkpoint .*step_00000002: .*restoring the newest intact.*1"):
        step, state, _ = restore_checkpoint(directory, target, fallback=True)
    assert step == 1 and np.all(np.asarray(state["x"]) == 1.0) and state["x"].sharding == target["x"].sharding


def _reseal(path: Path, manifest: dict) -> None:
    manifest["manifest_sha256"] = ckpt_manifest.manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda r: r[1].update(index=[[0, 4], [0, 3]], bytes=48), "do not tile axis 0"),  # overlaps another
        (lambda r: r.pop(), "do not tile axis 0"),  # a gap at the end
        (lambda r: r[0].update(bytes=5), r"record 0 has 5 bytes, its index \[\[0, 2\], \[0, 3\]\] holds 6"),
        (lambda r: r[0].update(file="../x.bin"), "record 0 has file '../x.bin', expected a file name"),
        (lambda r: r[0].update(sha256="zz"), "record 0 has sha256 'zz'"),
        (lambda r: r[0].update(index=[[0, 2]]), r"record 0 has index \[\[0, 2\]\], expected \[start, stop\]"),
        (lambda r: r[0].update(offset=-1), "record 0 has offset -1"),
        (lambda r: r.clear(), "is not a non-empty list of shards"),
    ],
)
def test_shard_records_are_checked(two_sharded, edit, match):
    directory, path, target = two_sharded
    manifest = _manifest(path)
    edit(manifest["leaves"][1]["shards"])  # state['x'] (leaves sorted: b, x)
    _reseal(path, manifest)  # a forger who knows the format: the checks still refuse it
    with pytest.raises(ckpt_manifest.DamagedCheckpoint, match=r"leaves\[1\]\.shards \(state\['x'\]\) " + match):
        restore_checkpoint(directory, target, step=2)


def test_an_edited_shard_record_breaks_the_manifest_digest(two_sharded):
    directory, path, target = two_sharded
    manifest = _manifest(path)
    manifest["leaves"][1]["shards"][0]["sha256"] = "0" * 64  # well-formed, but not what was saved
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json was modified or corrupted"):
        restore_checkpoint(directory, target, step=2)


def test_shards_in_a_version_2_manifest_are_refused(two_sharded):
    directory, path, target = two_sharded
    manifest = _manifest(path)
    manifest["version"] = 2
    _reseal(path, manifest)
    with pytest.raises(CheckpointError, match=r"leaves\[1\]\.shards is .*no shards in a version 2 manifest"):
        restore_checkpoint(directory, target, step=2)


# -- the previous format -------------------------------------------------------------


def _save_version_2(directory: Path, step: int, state) -> Path:
    """Write a checkpoint as the version 2 writer did: every leaf whole (split ones gathered) in arrays.npz."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    entries = [ckpt_encoding.entry(jax.tree_util.keystr(k), leaf) for k, leaf in flat]
    path = directory / f"step_{step:08d}"
    path.mkdir(parents=True)
    arrays = {
        f"a{i}": ckpt_encoding.stored(leaf, e) for i, ((_, leaf), e) in enumerate(zip(flat, entries, strict=True))
    }
    ckpt_files.write_arrays(str(path / "arrays.npz"), arrays)
    manifest = ckpt_manifest.build_manifest(str(path), step, {"input_position": step}, treedef, entries)
    manifest["version"] = 2
    _reseal(path, manifest)
    return path


def test_version_2_checkpoints_restore_onto_any_layout(tmp_path, n8, reference):
    states, _ = reference
    state, _ = _train(_layout("2x4-zero"), _init_state(), 0, SAVE_AT)
    _save_version_2(tmp_path, SAVE_AT, state)
    assert _manifest(tmp_path / f"step_{SAVE_AT:08d}")["version"] == 2
    after = _layout("1x4-zero")
    probe, _ = after.run(model.train_step, model.input_fn_for(0), _init_state())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), probe)
    step, restored, extra = restore_checkpoint(tmp_path, target)
    assert step == SAVE_AT and extra == {"input_position": SAVE_AT} and _split(restored) == 10
    _assert_close(restored, states[SAVE_AT], "version 2 onto 1x4 ZeRO")
    _, host, _ = restore_checkpoint(tmp_path, _init_state())
    _assert_close(host, states[SAVE_AT], "version 2 onto the host")


# -- gather_outputs ---------------------------------------------------------------------


def test_gather_outputs_reads_a_split_state_whole(n8, reference):
    states, _ = reference
    state, _ = _train(_layout("2x4-zero"), _init_state(), 0, SAVE_AT)
    assert _split(state) == 10  # Adam's mu and nu of the 5 leaves with an axis that divides by 8
    whole = rp.gather_outputs(state)
    for (path, got), x in zip(jax.tree_util.tree_leaves_with_path(whole), jax.tree.leaves(state), strict=True):
        assert isinstance(got, np.ndarray) and got.shape == x.shape, jax.tree_util.keystr(path)
        rebuilt = np.empty(x.shape, x.dtype)
        for shard in x.addressable_shards:  # the global value, from every device's part
            rebuilt[shard.index] = np.asarray(shard.data)
        np.testing.assert_array_equal(got, rebuilt)
    _assert_close(whole, states[SAVE_AT], "gather_outputs")


# -- two processes ------------------------------------------------------------------------


def _job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPLICATOR_", "SLURM_", "OMPI_"))}
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count per worker
    return env


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_processes_restore_their_parts_and_write_their_own_shards(tmp_path, n8, reference, mode):
    # In this process: 1 x 4 devices under ZeRO to step k1, saved (4 shards per split leaf).
    # A 2-process job (2 x 4 devices) restores it onto a layout split over both processes,
    # each process reading only the records its devices need, trains to k2, saves (each
    # process writing its own shards) and trains to the end. Then this process restores
    # that checkpoint onto 4 devices, replicated, and trains to the end.
    states, ref_losses = reference
    k1, k2 = 2, 4
    first, second = tmp_path / "first", tmp_path / "second"
    state, _ = _train(_layout("1x4-zero"), _init_state(), 0, k1)
    save_checkpoint(first, k1, state, extra={"input_position": k1})
    saved = _manifest(first / f"step_{k1:08d}")

    start = time.time()
    proc = subprocess.run(
        [
            sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", "4",
            str(MULTIPROC / "checkpoint_worker.py"), "--out", str(tmp_path / "job"), "--resume", str(first),
            "--save-at", str(k2), "--ckpt", str(second), "--steps", str(TOTAL),
            *(["--async-save"] if mode == "async" else []),
        ],
        env=_job_env(), cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(f"\n2 processes x 4 devices, restored at {k1}, saved at {k2}: job took {time.time() - start:.1f} s")
    job = [{p.stem[3:]: np.load(p) for p in (tmp_path / "job").glob(f"w{w}_*.npy")} for w in (0, 1)]
    split_leaves = [i for i, e in enumerate(saved["leaves"]) if "shards" in e]
    # What each worker restored and saved, from its files (its stdout lines may interleave with
    # Gloo's own output): both restored step k1 with leaves split over both processes, and saved
    # step k2 with leaves split over processes.
    for w in (0, 1):
        assert int(job[w]["restored_step"]) == k1
        print(f"worker {w}: {int(job[w]['restored_spanning'])} leaves restored split over both processes, "
              f"{int(job[w]['saved_split'])} saved split")  # fmt: skip
        assert int(job[w]["restored_spanning"]) >= int(job[w]["saved_split"]) == len(split_leaves)

    # Restored: the saved values, whole through gather_outputs, on both processes.
    for w in (0, 1):
        got = [job[w][f"restored_{i}"] for i in range(len(jax.tree.leaves(state)))]
        for a, b in zip(got, jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    # Each process read only the records overlapping its half of each split leaf (4 stored shards
    # of 16 rows: rows 0-8 are process 0's, 8-16 process 1's), each once.
    assert len(split_leaves) == 10  # mu and nu of w0 (4 rows) and of the 4 leaves of 16 rows
    for w in (0, 1):
        reads: dict[int, list[tuple[int, int]]] = {}
        for leaf, a, b in job[w]["reads"]:
            reads.setdefault(int(leaf), []).append((int(a), int(b)))
        assert sorted(reads) == split_leaves
        for leaf, got in reads.items():
            rows = saved["leaves"][leaf]["shape"][0]
            quarters = [(k * rows // 4, (k + 1) * rows // 4) for k in range(4)]
            # Split 8 ways in the job: this process's half, 2 records; w0's 4 rows stay replicated: all 4.
            assert sorted(got) == (quarters[2 * w : 2 * w + 2] if rows % 8 == 0 else quarters), (w, leaf, got)
    # Saved by both: each process's file holds its half of every split leaf, nothing gathered.
    path = second / f"step_{k2:08d}"
    assert sorted(os.listdir(second)) == [path.name]  # committed, nothing left over
    names = sorted(p.name for p in path.iterdir())
    assert names == ["arrays.npz", "manifest.json", "shards-p00000.bin", "shards-p00001.bin"]
    manifest = _manifest(path)
    per_file = {"shards-p00000.bin": 0, "shards-p00001.bin": 0}
    for e in manifest["leaves"]:
        for r in e.get("shards", []):
            per_file[r["file"]] += r["bytes"]
            # the axis the leaf is split along (ZeRO splits w0's (4, 16) state along axis 1 over 8 replicas)
            (k,) = [k for k, (a, b) in enumerate(r["index"]) if (a, b) != (0, e["shape"][k])]
            assert r["file"] == ("shards-p00000.bin" if r["index"][k][1] <= e["shape"][k] // 2 else "shards-p00001.bin")
    for name, size in per_file.items():
        assert size > 0 and (path / name).stat().st_size == size

    # The job's numbers, and this process resuming from the job's checkpoint.
    for w in (0, 1):
        np.testing.assert_allclose(job[w]["losses"], ref_losses[k1:], atol=ATOL, rtol=0)
        got = [job[w][f"final_{i}"] for i in range(len(jax.tree.leaves(state)))]
        _assert_close(got, jax.tree.leaves(states[TOTAL]), f"worker {w}")
    after = _layout("1x4")
    mesh = after.mesh
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=NamedSharding(mesh, P())),
        _init_state(),
    )
    step, restored, _ = restore_checkpoint(second, target)
    assert step == k2
    state, losses = _train(after, restored, k2, TOTAL)
    np.testing.assert_allclose(losses, ref_losses[k2:], atol=ATOL, rtol=0)
    _assert_close(state, states[TOTAL], "resumed from the 2-process checkpoint")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_process_that_fails_to_write_its_shards_fails_the_save_everywhere(tmp_path, n8, mode):
    # Worker 1's shard file fails halfway: the save must raise on both workers (neither goes on as
    # if it were saved, neither hangs) and leave nothing: no checkpoint, no temporary, no lock. One
    # launcher per worker, so that neither is stopped by the other's failure before it says why.
    from replicator.launch import free_port

    first, second = tmp_path / "first", tmp_path / "second"
    save_checkpoint(first, 0, jax.tree.map(np.asarray, _init_state()), extra={"input_position": 0})
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "replicator.launch", "--coordinator", f"127.0.0.1:{port}",
                "--num-workers", "2", "--worker-id", str(w), "--cores-per-worker", "4",
                str(MULTIPROC / "checkpoint_worker.py"), "--out", str(tmp_path / "job"), "--resume", str(first),
                "--save-at", "1", "--ckpt", str(second), "--steps", "2", "--fail-write-worker", "1",
                *(["--async-save"] if mode == "async" else []),
            ],
            env=_job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for w in (0, 1)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], [err[-3000:] for _, err in outs]
    if mode == "sync":
        expected = {
            1: r"OSError: injected: disk full",
            0: r"replicator(\.\w+)*\.CheckpointError: process 1 failed to write its part of the checkpoint "
            r".*step_00000001, so it was not saved: OSError: injected: disk full",
        }
    else:  # raised by wait() on both: worker 1 its own failure, worker 0 the failure it read from worker 1's file
        failed = (
            r".*CheckpointError: the asynchronous save of step 1 into .*step_00000001 failed, so it was not committed"
        )
        expected = {
            1: rf"{failed}.*OSError: injected: disk full",
            0: rf"{failed}.*process 1 failed to write its part of the checkpoint: OSError: injected: disk full",
        }
    for w, pattern in expected.items():
        # ".*": a line of the worker's may begin with the end of an interleaved line of Gloo's
        assert re.search(rf"\[worker {w}\] .*{pattern}", outs[w][1]), outs[w][1][-3000:]
    assert "saved step" not in outs[0][0] + outs[1][0]
    assert os.listdir(second) == []  # nothing committed, the temporary removed, the lock released


@pytest.mark.parametrize("field", ["offset", "bytes"])
def test_a_sidecar_whose_offsets_or_sizes_differ_from_the_layout_is_refused(tmp_path, field):
    """Process 1 listing the expected shards at other offsets or of other sizes wrote another layout: refused."""
    from replicator.training.checkpoint import shards as ckpt_shards

    expected = [
        ckpt_shards.Record(0, ((0, 4), (0, 3)), 1, None, 0, 48),
        ckpt_shards.Record(0, ((4, 8), (0, 3)), 1, None, 48, 48),
    ]
    sha = hashlib.sha256(b"").hexdigest()

    def write(edit: dict) -> None:
        records = [
            {"leaf": r.leaf, "index": r.index, "offset": r.offset, "bytes": r.nbytes, "sha256": sha, **edit}
            if i == 1
            else {"leaf": r.leaf, "index": r.index, "offset": r.offset, "bytes": r.nbytes, "sha256": sha}
            for i, r in enumerate(expected)
        ]
        text = json.dumps({"process": 1, "file": ckpt_shards.shard_file(1), "records": records})
        (tmp_path / "shards-p00001.json").write_text(text)

    write({})  # as the layout says: taken, and its digests noted
    digests: dict = {}
    ckpt_shards._take_sidecar(str(tmp_path), 1, expected, digests, wait_s=1.0)
    assert digests == {(0, r.bounds): sha for r in expected}
    write({field: {"offset": 40, "bytes": 40}[field]})
    with pytest.raises(CheckpointError, match="process 1 wrote other shards than process 0 expects"):
        ckpt_shards._take_sidecar(str(tmp_path), 1, expected, {}, wait_s=1.0)


# -- promises without a test before (issue #41 item 4) ------------------------------------


@st.composite
def _shard_records(draw):
    """A leaf's shape and shard records: a grid of cuts (possibly empty parts at the end), then perhaps damaged."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    axes = []
    for dim in shape:
        inner = sorted(draw(st.sets(st.integers(1, dim - 1), max_size=3))) if dim > 1 else []
        points = [0, *inner, dim] + ([dim] if draw(st.booleans()) else [])  # an uneven split's empty last part
        axes.append(list(zip(points, points[1:], strict=False)))
    cells = [list(map(list, cell)) for cell in itertools.product(*axes)]
    how = draw(st.sampled_from(["intact", "drop", "repeat", "move", "grow"]))
    k = draw(st.integers(0, len(cells) - 1))
    axis = draw(st.integers(0, len(shape) - 1))
    intact = how == "intact"
    if how == "drop" and len(cells) > 1:
        cells.pop(k)
    elif how == "repeat":
        cells.insert(draw(st.integers(0, len(cells))), list(map(list, cells[k])))
    elif how in ("move", "grow"):
        a, b = cells[k][axis]
        delta = draw(st.sampled_from([-1, 1]))
        cells[k][axis] = [a + delta, b + delta] if how == "move" else [a, b + delta]
    records = [
        {"file": "shards-p00000.bin", "offset": 0, "bytes": 4 * math.prod(b - a for a, b in index), "index": index}
        for index in cells
    ]
    for r in records:
        r["sha256"] = "0" * 64
        r["bytes"] = max(r["bytes"], 0)
    return shape, records, intact


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_shard_records())
def test_shard_records_accepted_by_the_manifest_check_cover_every_element_exactly_once(drawn):
    """The records a manifest may hold tile the leaf (parse_manifest refuses the others, e.g. a repeated, moved,
    grown or missing record), and every grid of records, as any sharding makes, is accepted."""
    shape, records, intact = drawn
    entry = {"path": "['x']", "shape": shape, "dtype": "float32", "shards": records}
    problem = ckpt_manifest._shards_problem(entry)
    covered = np.zeros(shape, np.int64)
    valid = True
    for r in records:
        bounds = r["index"]
        if any(not 0 <= a <= b <= dim for (a, b), dim in zip(bounds, shape, strict=True)):
            valid = False
            continue
        covered[tuple(slice(a, b) for a, b in bounds)] += 1
    if problem is None:
        assert valid and np.all(covered == 1), (records, covered)
    if intact:
        assert problem is None, problem


def test_each_shard_is_written_by_its_holder_of_lowest_process_and_id_at_consecutive_offsets(repl2d):
    if repl2d.num_workers < 2:
        pytest.skip("needs a mesh of 2 or more workers")
    from replicator.training.checkpoint import shards as ckpt_shards

    n = repl2d.cores_per_worker
    x = jax.device_put(np.zeros((2 * n, 3), np.float32), NamedSharding(repl2d.mesh, P("cores")))  # on every worker
    layout = ckpt_shards.plan([x], [ckpt_encoding.entry("['x']", x)])
    holders: dict = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        holders.setdefault(ckpt_shards._bounds(index, x.shape), []).append(device)
    records = layout[0]
    assert [r.bounds for r in records] == sorted(holders)  # each distinct shard once, in order
    for r in records:
        assert len(holders[r.bounds]) == repl2d.num_workers
        assert r.device == min(holders[r.bounds], key=lambda d: (d.process_index, d.id))
        assert r.process == r.device.process_index and r.nbytes == 2 * 3 * 4
    assert [r.offset for r in records] == [k * 2 * 3 * 4 for k in range(len(records))]


def test_a_region_reads_only_the_records_that_overlap_it_each_once(tmp_path, multi, repl2d, monkeypatch):
    from replicator.training.checkpoint import shards as ckpt_shards

    n = repl2d.num_replicas
    values = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
    x = jax.device_put(values, NamedSharding(repl2d.mesh, P(("workers", "cores"))))  # 2 rows per record
    save_checkpoint(tmp_path, 1, {"x": x})
    manifest = rp.CheckpointManager(tmp_path).read_manifest(1)
    reader = ckpt_shards.LeafReader(manifest["path"], manifest["leaves"][0], ckpt_manifest.DamagedCheckpoint)
    real_open = open
    opened: list[str] = []

    def counting_open(file, *args, **kwargs):
        opened.append(os.path.basename(os.fspath(file)))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    np.testing.assert_array_equal(reader.region((slice(1, 3), slice(None))), values[1:3])  # records 0 and 1
    assert opened == ["shards-p00000.bin"] * 2
    np.testing.assert_array_equal(reader.region((slice(0, 4), slice(1, 2))), values[0:4, 1:2])  # the same two
    assert len(opened) == 2  # each record is read (and its sha256 checked) once
    monkeypatch.undo()


def test_a_strided_shard_is_refused():
    from replicator.training.checkpoint import shards as ckpt_shards

    with pytest.raises(CheckpointError, match="a shard with a strided index .* cannot be saved; use a NamedSharding"):
        ckpt_shards._bounds((slice(0, 4, 2),), (4,))


def test_a_shard_file_shorter_than_its_records_is_refused(tmp_path):
    from replicator.training.checkpoint import shards as ckpt_shards

    records = [
        ckpt_shards.Record(0, ((0, 4), (0, 3)), 0, None, 0, 48),
        ckpt_shards.Record(0, ((4, 8), (0, 3)), 0, None, 48, 48),
    ]
    own = {(0, r.bounds): "0" * 64 for r in records}
    (tmp_path / "shards-p00000.bin").write_bytes(bytes(90))
    with pytest.raises(CheckpointError, match=r"shards-p00000.bin has 90 bytes, 96 expected; process 0 did not"):
        ckpt_shards.collect(str(tmp_path), {0: records}, own)
    (tmp_path / "shards-p00000.bin").write_bytes(bytes(96))
    got = ckpt_shards.collect(str(tmp_path), {0: records}, own)
    assert [(r["offset"], r["bytes"], r["index"]) for r in got[0]] == [
        (0, 48, [[0, 4], [0, 3]]),
        (48, 48, [[4, 8], [0, 3]]),
    ]


def _waiting(call) -> BaseException | None:
    """What ``call()`` raised, run in a thread waited for at most 60 s (a wait that is not bounded fails)."""
    raised: list[BaseException | None] = []

    def run():
        try:
            call()
            raised.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "still waiting after 60 s"
    return raised[0]


def test_process_zero_waits_for_a_missing_sidecar_at_most_its_bound(tmp_path):
    from replicator.training.checkpoint import shards as ckpt_shards

    expected = [ckpt_shards.Record(0, ((4, 8), (0, 3)), 1, None, 0, 48)]
    error = _waiting(lambda: ckpt_shards._take_sidecar(str(tmp_path), 1, expected, {}, wait_s=0.1))
    assert isinstance(error, CheckpointError)
    assert re.search(r"cannot see .*shards-p00001.json.* after 0.1 s\. .*shares", str(error)), error


def test_a_failure_report_ends_the_wait_for_a_sidecar_with_that_process_error(tmp_path):
    from replicator.training.checkpoint import shards as ckpt_shards

    expected = [ckpt_shards.Record(0, ((4, 8), (0, 3)), 1, None, 0, 48)]
    ckpt_shards.write_failure(str(tmp_path), 1, OSError("injected: disk full"))
    error = _waiting(lambda: ckpt_shards._take_sidecar(str(tmp_path), 1, expected, {}, wait_s=5))
    assert isinstance(error, CheckpointError)
    assert str(error) == "process 1 failed to write its part of the checkpoint: OSError: injected: disk full"
