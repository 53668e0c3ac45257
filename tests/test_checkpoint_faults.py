"""Checkpoint faults: an edited manifest, strict parsing, one writer at a time, falling back to an intact one."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import warnings

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from replicator.training.checkpoint import CheckpointError, CheckpointManager, restore_checkpoint, save_checkpoint
from replicator.training.checkpoint import files as ckpt_files
from replicator.training.checkpoint import manifest as ckpt_manifest

STATE = {"w": jnp.arange(3.0), "b": jnp.float32(0.5)}


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _reseal(path, manifest):
    manifest["manifest_sha256"] = ckpt_manifest.manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def saved(tmp_path):
    save_checkpoint(tmp_path, 5, STATE, extra={"input_position": 5})
    return tmp_path, tmp_path / "step_00000005"


# -- 1. the manifest is covered by a digest -----------------------------------------------


class TestManifestDigest:
    @pytest.mark.parametrize(
        "edit",
        [
            lambda m: m.update(step=7),
            lambda m: m.update(extra={"input_position": 99}),
            lambda m: m["leaves"].reverse(),
            lambda m: m.update(arrays_bytes=1),
        ],
    )
    def test_an_edited_manifest_is_refused(self, saved, edit):
        directory, path = saved
        manifest = _manifest(path)
        edit(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
        with pytest.raises(CheckpointError, match=r"step_00000005/manifest.json was modified or corrupted"):
            restore_checkpoint(directory, STATE)

    def test_reformatting_the_json_is_not_a_change(self, saved):
        directory, path = saved
        (path / "manifest.json").write_text(json.dumps(_manifest(path), indent=4, sort_keys=True))
        assert restore_checkpoint(directory, STATE)[0] == 5

    def test_a_removed_digest_is_refused(self, saved):
        directory, path = saved
        manifest = _manifest(path)
        del manifest["manifest_sha256"]
        (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="lacks its manifest_sha256.*modified or corrupted"):
            restore_checkpoint(directory, STATE)

    @pytest.mark.parametrize("version", [4, 3.0, "3", True])
    def test_unknown_version(self, saved, version):
        directory, path = saved
        manifest = _manifest(path)
        manifest["version"] = version
        _reseal(path, manifest)
        with pytest.raises(CheckpointError, match=r"format version .*; this replicator reads versions 1, 2, 3\. Use"):
            restore_checkpoint(directory, STATE)

    def test_version_1_checkpoints_still_restore(self, saved):
        directory, path = saved
        manifest = _manifest(path)
        del manifest["manifest_sha256"]
        manifest["version"] = 1  # as the previous format wrote it
        (path / "manifest.json").write_text(json.dumps(manifest))
        step, state, extra = restore_checkpoint(directory, STATE)
        assert (step, state["w"].tolist(), extra) == (5, [0.0, 1.0, 2.0], {"input_position": 5})


# -- 2. strict parsing -------------------------------------------------------------------


class TestStrictManifest:
    @pytest.mark.parametrize(
        "field, value, match",
        [
            ("step", "abc", r"step is 'abc' \(str\), expected a non-negative int"),
            ("step", True, r"step is True \(bool\)"),
            ("step", -1, r"step is -1 \(int\)"),
            ("extra", [1], r"extra is \[1\] \(list\), expected a JSON object"),
            ("arrays_file", 3, r"arrays_file is 3 \(int\), expected a file name"),
            ("arrays_file", "../x.npz", "expected a file name"),
            ("arrays_sha256", "zz", "expected 64 lowercase hex digits"),
            ("arrays_bytes", "12", "arrays_bytes is '12'"),
            ("treedef", 1, "treedef is 1"),
            ("leaves", {}, r"leaves is \{\} \(dict\), expected a list"),
        ],
    )
    def test_field_types(self, saved, field, value, match):
        directory, path = saved
        manifest = _manifest(path)
        manifest[field] = value
        _reseal(path, manifest)  # a well-formed digest: the types are checked on their own
        with pytest.raises(CheckpointError, match=match):
            restore_checkpoint(directory, STATE)

    @pytest.mark.parametrize(
        "field, value, match",
        [
            ("shape", ["3"], r"leaves\[1\].shape is \['3'\] \(list\), expected a list of non-negative ints"),
            ("shape", 3, r"leaves\[1\].shape is 3"),
            ("dtype", 5, r"leaves\[1\].dtype is 5 \(int\), expected a string"),
            ("path", None, r"leaves\[1\].path is None"),
            ("stored_as", "object", r"leaves\[1\].stored_as is 'object'"),
        ],
    )
    def test_leaf_types(self, saved, field, value, match):
        directory, path = saved
        manifest = _manifest(path)
        manifest["leaves"][1][field] = value
        _reseal(path, manifest)
        with pytest.raises(CheckpointError, match=match):
            restore_checkpoint(directory, STATE)

    def test_step_must_match_the_directory(self, saved):
        directory, path = saved
        manifest = _manifest(path)
        manifest["step"] = 7
        _reseal(path, manifest)
        with pytest.raises(CheckpointError, match="says step 7 but its directory is of step 5"):
            restore_checkpoint(directory, STATE)

    def test_a_stray_file_named_like_a_checkpoint(self, saved):
        directory, _ = saved
        (directory / "step_00000009").write_text("not a checkpoint")
        with pytest.raises(CheckpointError, match="step_00000009' is a file, not a checkpoint directory"):
            restore_checkpoint(directory, STATE)
        assert restore_checkpoint(directory, STATE, step=5)[0] == 5

    def test_restoring_from_a_file_path(self, saved):
        _, path = saved
        for wrong in (path / "manifest.json", path / "arrays.npz"):
            with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory; pass the directory"):
                restore_checkpoint(wrong, STATE)
            with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
                save_checkpoint(wrong, 6, STATE)

    def test_an_unreadable_manifest(self, saved):
        directory, path = saved
        (path / "manifest.json").unlink()
        (path / "manifest.json").mkdir()
        with pytest.raises(CheckpointError, match="cannot read .*manifest.json"):
            restore_checkpoint(directory, STATE)


# -- 3. one writer at a time -------------------------------------------------------------


class TestLock:
    def test_a_second_manager_saving_meanwhile_is_refused(self, tmp_path, monkeypatch):
        first, second = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
        first.save(1, STATE)
        real_write = ckpt_files.write_arrays
        seen = {}

        def write_then_interleave(path, arrays):
            real_write(path, arrays)
            mine = os.path.basename(os.path.dirname(path))
            with pytest.raises(CheckpointError, match=r"another writer is saving into .*\.lock.*step 3 was not"):
                second.save(3, {"w": jnp.zeros(3), "b": jnp.float32(9)})
            seen["kept"] = os.path.isdir(os.path.dirname(path))  # the second did not touch our temporary
            seen["name"] = mine

        monkeypatch.setattr(ckpt_files, "write_arrays", write_then_interleave)
        first.save(2, STATE)
        monkeypatch.setattr(ckpt_files, "write_arrays", real_write)
        assert seen["kept"] and first._token in seen["name"]
        assert first.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]
        assert first.restore(STATE)[1]["w"].tolist() == [0.0, 1.0, 2.0]
        second.save(3, STATE)  # once the first is done, the lock is free again
        assert first.all_steps() == [1, 2, 3] and ".lock" not in os.listdir(tmp_path)

    def test_another_process_holding_the_lock(self, tmp_path):
        save_checkpoint(tmp_path, 1, STATE)
        code = textwrap.dedent(
            f"""
            import sys
            from replicator.training.checkpoint import files
            lock = files.DirectoryLock({str(tmp_path)!r}, ".lock")
            assert lock.acquire()
            print("locked", flush=True)
            sys.stdin.read()  # until the test closes it
            lock.release()
            """
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert proc.stdout.readline() == b"locked\n", proc.stderr.read().decode()
            with pytest.raises(CheckpointError, match="another writer is saving into"):
                save_checkpoint(tmp_path, 2, STATE)
            assert CheckpointManager(tmp_path).all_steps() == [1]
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        save_checkpoint(tmp_path, 2, STATE)
        assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]

    def test_a_dead_writers_temporary_is_removed_under_the_lock(self, tmp_path):
        save_checkpoint(tmp_path, 1, STATE)
        (tmp_path / ".tmp-step_00000002-deadbeefdeadbeef-1").mkdir()  # a save killed with kill -9
        save_checkpoint(tmp_path, 2, STATE)
        assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]

    def test_temporaries_carry_the_writers_token(self, tmp_path, monkeypatch):
        manager = CheckpointManager(tmp_path)
        names = []
        real_write = ckpt_files.write_arrays

        def record(path, arrays):
            names.append(os.path.basename(os.path.dirname(path)))
            real_write(path, arrays)

        monkeypatch.setattr(ckpt_files, "write_arrays", record)
        manager.save(1, STATE)
        manager.save(2, STATE)
        assert names == [f".tmp-step_00000001-{manager._token}-1", f".tmp-step_00000002-{manager._token}-2"]


# -- 4. falling back to the newest intact checkpoint -------------------------------------


def _p(manager, step):
    return pathlib.Path(manager.path(step))


def _corrupt(path):
    data = bytearray((path / "arrays.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "arrays.npz").write_bytes(bytes(data))


class TestFallback:
    @pytest.fixture
    def three(self, tmp_path):
        manager = CheckpointManager(tmp_path, keep=None)
        for step in (1, 2, 3):
            manager.save(step, {"w": jnp.full(3, float(step)), "b": jnp.float32(step)}, extra={"at": step})
        return manager

    def test_off_by_default(self, three):
        _corrupt(_p(three, 3))
        with pytest.raises(CheckpointError, match="step_00000003: arrays.npz is truncated or corrupt.*fallback=True"):
            three.restore(STATE)

    def test_warns_and_restores_the_newest_intact(self, three):
        _corrupt(_p(three, 3))
        manifest = _manifest(_p(three, 2))
        manifest["extra"] = {"at": 20}
        (_p(three, 2) / "manifest.json").write_text(json.dumps(manifest))
        with pytest.warns(RuntimeWarning) as record:
            step, state, extra = three.restore(STATE, fallback=True)
        assert (step, state["w"].tolist(), extra) == (1, [1.0, 1.0, 1.0], {"at": 1})
        messages = [str(w.message) for w in record]
        assert len(messages) == 2
        assert "step 3:" in messages[0] and "truncated or corrupt" in messages[0] and "step 1." in messages[0]
        assert "step 2:" in messages[1] and "modified or corrupted" in messages[1]

    def test_function_and_stray_file(self, three):
        (_p(three, 3).parent / "step_00000009").write_text("")
        with pytest.warns(RuntimeWarning, match="step 9: .*is a file, not a checkpoint directory"):
            step, _, _ = restore_checkpoint(three.directory, STATE, fallback=True)
        assert step == 3

    def test_no_warning_when_the_newest_is_intact(self, three):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert three.restore(STATE, fallback=True)[0] == 3

    def test_all_broken(self, three):
        for step in (1, 2, 3):
            _corrupt(_p(three, step))
        with pytest.raises(CheckpointError, match="no intact checkpoint in .*every one failed verification"):
            three.restore(STATE, fallback=True)

    def test_a_mismatching_target_does_not_fall_back(self, three):
        _corrupt(_p(three, 1))
        with pytest.raises(CheckpointError, match=r"has state\['w'\] of shape \(3,\)"):
            three.restore({"w": jnp.zeros(4), "b": jnp.float32(0)}, fallback=True)

    def test_an_explicit_step_does_not_fall_back(self, three):
        _corrupt(_p(three, 2))
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            three.restore(STATE, step=2, fallback=True)
        np.testing.assert_array_equal(three.restore(STATE, step=1, fallback=True)[1]["w"], np.full(3, 1.0))


def test_a_polled_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """Sidecars and failure reports are polled by process 0: while their text is written, the name that
    process 0 looks for must not exist yet (an empty report once lost the failing process's error)."""
    path = tmp_path / "shards-p00001.failed"
    seen_while_writing = []
    real_fsync = os.fsync

    def fsync(fd):
        seen_while_writing.append(path.exists())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckpt_files.write_text(str(path), "OSError: injected: disk full")
    assert seen_while_writing == [False]
    assert path.read_text() == "OSError: injected: disk full"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards-p00001.failed"]  # no temporary left
    with pytest.raises(FileExistsError):
        ckpt_files.write_text(str(path), "another")
    assert path.read_text() == "OSError: injected: disk full"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards-p00001.failed"]


# -- promises without a test before (issue #41 item 4) ---------------------------------


def test_a_data_file_is_never_written_over(tmp_path):
    """files.write_arrays makes a new file: an existing one (another save's) is refused and left as it was."""
    path = tmp_path / "arrays.npz"
    path.write_bytes(b"another save's arrays")
    with pytest.raises(FileExistsError):
        ckpt_files.write_arrays(str(path), {"a0": np.zeros(2, np.float32)})
    assert path.read_bytes() == b"another save's arrays"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_EDITS = {
    "step": lambda m: m.update(step=m["step"] + 1),
    "extra": lambda m: m["extra"].update(edited=True),
    "shape": lambda m: m["leaves"][0].update(shape=[3]),
    "dtype": lambda m: m["leaves"][0].update(dtype="int32"),
    "arrays_bytes": lambda m: m.update(arrays_bytes=m["arrays_bytes"] + 1),
    "version": lambda m: m.update(version=5 - m["version"]),  # 2 <-> 3, both readable
}


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    step=st.integers(0, 10**9),
    extra=st.dictionaries(st.text(max_size=6), _JSON, max_size=4),
    version=st.sampled_from([2, 3]),
    edit=st.sampled_from(sorted(_EDITS)),
)
def test_a_manifest_reads_back_as_written_and_any_edit_is_refused_in_every_version_with_a_digest(
    step, extra, version, edit
):
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, f"step_{step:08d}")
        os.mkdir(path)
        ckpt_files.write_arrays(os.path.join(path, "arrays.npz"), {"a0": np.zeros(2, np.float32)})
        leaves = [{"path": "['w']", "shape": [2], "dtype": "float32"}]
        manifest = ckpt_manifest.build_manifest(path, step, extra, "PyTreeDef({'w': *})", leaves)
        manifest["version"] = version
        manifest["manifest_sha256"] = ckpt_manifest.manifest_digest(manifest)
        manifest_path = pathlib.Path(path) / "manifest.json"
        manifest_path.write_text(json.dumps(manifest, indent=1))
        assert ckpt_manifest.parse_manifest(path, step, lambda: [step]) == {**manifest, "path": path}
        _EDITS[edit](manifest)  # the digest left as it was
        manifest_path.write_text(json.dumps(manifest, indent=1))
        with pytest.raises(ckpt_manifest.DamagedCheckpoint, match="modified or corrupted"):
            ckpt_manifest.parse_manifest(path, step, lambda: [step])
