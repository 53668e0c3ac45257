"""Corners of replicator/training/checkpoint/ that scripts/mutate.py found untested.

Process 0's side of the multi-process agreement, the bounded wait for a background save,
a lock file that keeps being replaced, orbax export of typed keys, the manifest digest of
non-ASCII extras, malformed shard indices, and the multi-process restore paths that a
single process reaches with ``jax.process_count`` patched (as test_checkpoint.py patches
``jax.process_index``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    export_orbax,
    restore_checkpoint,
    save_checkpoint,
)
from replicator.training.checkpoint import agreement as ckpt_agreement
from replicator.training.checkpoint import background as ckpt_background
from replicator.training.checkpoint import encoding as ckpt_encoding
from replicator.training.checkpoint import files as ckpt_files
from replicator.training.checkpoint import manifest as ckpt_manifest


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
    try:
        start = time.monotonic()
        failure = save.join(0.05)
        elapsed = time.monotonic() - start
        assert isinstance(failure, CheckpointError) and "still writing after 0.05 s" in str(failure)
        assert elapsed < 0.6, f"join(0.05) waited {elapsed:.2f} s"
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
