"""The manifest of a checkpoint: its format, fields, digest, and how a manifest is read and checked.

A checkpoint directory holds :data:`ARRAYS_FILE` (the leaves stored whole),
the shard files ``shards-p<process>.bin`` (leaves split over devices, see
:mod:`~replicator.training.checkpoint.shards`) and :data:`MANIFEST_FILE`, a
JSON object: ``format`` (:data:`FORMAT`), ``version``
(:data:`FORMAT_VERSION`; :data:`READABLE_VERSIONS` are read), ``step``,
``extra``, ``arrays_file``, ``arrays_sha256``, ``arrays_bytes``, ``treedef``,
``leaves`` (one entry per leaf, see
:func:`~replicator.training.checkpoint.encoding.entry`; a leaf stored as
shards has ``shards``: per shard its ``file``, ``offset``, ``bytes``,
``index`` and ``sha256``) and :data:`DIGEST_FIELD`, the sha256 of all the
rest (:func:`manifest_digest`). How a checkpoint is committed is
:mod:`~replicator.training.checkpoint.manager`'s.

Promises:

1. A manifest reads back as it was written, every field (and ``path``)
   (tests/test_checkpoint_faults.py::test_a_manifest_reads_back_as_written_and_any_edit_is_refused_in_every_version_with_a_digest).
2. :data:`DIGEST_FIELD` is the sha256 of the canonical ASCII JSON of every field but itself and ``path``:
   re-indenting the JSON is no change, a non-ASCII ``extra`` keeps its digest
   (tests/test_checkpoint.py::test_the_manifest_digest_is_over_ascii_json_so_non_ascii_extras_keep_their_digest,
   tests/test_checkpoint_faults.py::TestManifestDigest::test_reformatting_the_json_is_not_a_change).
3. The digest is checked for every version that has one (2 and 3): an edited field (step, extra, a leaf's shape
   or dtype, arrays_bytes, the version, a shard record) is a :class:`DamagedCheckpoint` "modified or
   corrupted", and so is a removed digest
   (tests/test_checkpoint_faults.py::test_a_manifest_reads_back_as_written_and_any_edit_is_refused_in_every_version_with_a_digest,
   tests/test_checkpoint_faults.py::TestManifestDigest::test_an_edited_manifest_is_refused,
   tests/test_checkpoint.py::test_an_edited_version_2_manifest_is_refused,
   tests/test_checkpoint_faults.py::TestManifestDigest::test_a_removed_digest_is_refused,
   tests/test_checkpoint_sharded.py::test_an_edited_shard_record_breaks_the_manifest_digest).
4. Version 1 manifests (no digest) are still read; any other version (4, 3.0, "3", True) is a CheckpointError
   naming the versions read (tests/test_checkpoint_faults.py::TestManifestDigest::test_version_1_checkpoints_still_restore,
   tests/test_checkpoint_faults.py::TestManifestDigest::test_unknown_version).
5. Every field is type-checked (``step`` a non-negative int, not a bool; ``extra`` an object; ``arrays_file`` a
   bare file name; a sha256 64 lowercase hex digits; a leaf's path, shape, dtype and stored_as), a wrong one a
   :class:`DamagedCheckpoint` naming it (tests/test_checkpoint_faults.py::TestStrictManifest::test_field_types,
   tests/test_checkpoint_faults.py::TestStrictManifest::test_leaf_types).
6. The manifest's step is its directory's (tests/test_checkpoint_faults.py::TestStrictManifest::test_step_must_match_the_directory).
7. A stray file named like a checkpoint, a directory without a manifest, and a manifest that is not JSON, not an
   object, of another format or unreadable are each a :class:`DamagedCheckpoint`
   (tests/test_checkpoint_faults.py::TestStrictManifest::test_a_stray_file_named_like_a_checkpoint,
   tests/test_checkpoint.py::TestRestoreChecks::test_foreign_or_damaged_manifest,
   tests/test_checkpoint.py::TestRestoreChecks::test_missing_files,
   tests/test_checkpoint_faults.py::TestStrictManifest::test_an_unreadable_manifest).
8. Each shard record is an object of a bare file name, non-negative offset and bytes, an index of ``[start,
   stop]`` within the shape per axis, and a sha256, its bytes its index's size
   (tests/test_checkpoint_sharded.py::test_shard_records_are_checked,
   tests/test_checkpoint.py::test_a_shard_index_that_is_not_start_stop_pairs_is_refused).
9. The records a manifest is accepted with tile their leaf, every element in exactly one record (a repeated,
   moved, grown or missing record is refused), and every grid of records, as a sharding makes, is accepted
   (tests/test_checkpoint_sharded.py::test_shard_records_accepted_by_the_manifest_check_cover_every_element_exactly_once).
10. Shards in a version 1 or 2 manifest are refused
    (tests/test_checkpoint_sharded.py::test_shards_in_a_version_2_manifest_are_refused).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from replicator.training.checkpoint import files
from replicator.training.checkpoint.encoding import CheckpointError

__all__ = [
    "ARRAYS_FILE",
    "DIGEST_FIELD",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "READABLE_VERSIONS",
    "SHARDS_VERSION",
    "DamagedCheckpoint",
    "build_manifest",
    "manifest_digest",
    "parse_manifest",
]

FORMAT = "replicator-checkpoint"
# 2: the manifest carries manifest_sha256; version 1 (without it) is still read.
# 3: leaves split over devices are stored as shards (a leaf entry's "shards"); versions 1 and 2 hold none.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
SHARDS_VERSION = 3  # the first version whose leaves may have "shards"
DIGEST_FIELD = "manifest_sha256"
ARRAYS_FILE = "arrays.npz"
MANIFEST_FILE = "manifest.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_STORED_AS = ("uint8", "uint16", "uint32", "uint64")


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files fail verification (as opposed to one that does not fit the target)."""


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The sha256 of a manifest's canonical JSON: every field but the digest itself (and ``path``).

    The manifest holds ``arrays_sha256``, so the digest covers the arrays too.
    """
    content = {k: v for k, v in manifest.items() if k not in (DIGEST_FIELD, "path")}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def build_manifest(directory: str, step: int, extra: Any, treedef: Any, leaves: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest, with its digest, of the checkpoint of ``step`` whose arrays are in ``directory``."""
    arrays_path = os.path.join(directory, ARRAYS_FILE)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "extra": extra,
        "arrays_file": ARRAYS_FILE,
        "arrays_sha256": files.sha256(arrays_path),
        "arrays_bytes": os.path.getsize(arrays_path),
        "treedef": str(treedef),
        "leaves": leaves,
    }
    manifest[DIGEST_FIELD] = manifest_digest(manifest)
    return manifest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shards_problem(entry: Mapping[str, Any]) -> str | None:
    """What is wrong with a leaf entry's ``shards`` (None if nothing): types, sizes, and that they tile the leaf."""
    shards, shape = entry["shards"], entry["shape"]
    if not isinstance(shards, list) or not shards or not shape:
        return "is not a non-empty list of shards of an array of one or more axes"
    try:
        itemsize = np.dtype(entry.get("stored_as", entry["dtype"])).itemsize
    except TypeError:
        return f"has an unknown dtype {entry['dtype']!r}"
    seen: set[tuple[tuple[int, int], ...]] = set()
    cuts: list[set[tuple[int, int]]] = [set() for _ in shape]
    for k, r in enumerate(shards):
        if not isinstance(r, dict) or set(r) != {"file", "offset", "bytes", "index", "sha256"}:
            return f"record {k} is not an object of file, offset, bytes, index and sha256"
        file = r["file"]
        if not isinstance(file, str) or not file or os.path.basename(file) != file or file.startswith("."):
            return f"record {k} has file {file!r}, expected a file name"
        if not _is_int(r["offset"]) or not _is_int(r["bytes"]):
            return f"record {k} has offset {r['offset']!r} and bytes {r['bytes']!r}, expected non-negative ints"
        if not isinstance(r["sha256"], str) or not _SHA256.match(r["sha256"]):
            return f"record {k} has sha256 {r['sha256']!r}, expected 64 lowercase hex digits"
        index = r["index"]
        if (
            not isinstance(index, list)
            or len(index) != len(shape)
            or not all(isinstance(p, list) and len(p) == 2 and all(_is_int(v) for v in p) for p in index)
            or not all(a <= b <= dim for (a, b), dim in zip(index, shape, strict=True))
        ):
            return f"record {k} has index {index!r}, expected [start, stop] within {shape} for each axis"
        bounds = tuple((a, b) for a, b in index)
        if bounds in seen:
            return f"record {k} repeats index {index}"
        seen.add(bounds)
        for axis, cut in enumerate(bounds):
            cuts[axis].add(cut)
        if r["bytes"] != math.prod(b - a for a, b in bounds) * itemsize:
            return f"record {k} has {r['bytes']} bytes, its index {index} holds {math.prod(b - a for a, b in bounds)}"
    for axis, (dim, axis_cuts) in enumerate(zip(shape, cuts, strict=True)):  # each axis cut into a partition
        position = 0
        for a, b in sorted(axis_cuts):
            if a != position:  # (an empty part, as an uneven split may leave at the end, is fine)
                return f"do not tile axis {axis} of shape {shape} (a gap or an overlap at {position})"
            position = b
        if position != dim:
            return f"do not tile axis {axis} of shape {shape} (they end at {position})"
    if len(seen) != math.prod(len(c) for c in cuts):
        return f"do not tile shape {shape} ({len(seen)} records for a grid of {math.prod(len(c) for c in cuts)})"
    return None


def parse_manifest(path: str, step: int | None, all_steps: Any) -> dict[str, Any]:
    """Read, verify and type-check the manifest of the checkpoint directory ``path`` (of ``step``)."""
    manifest_path = os.path.join(path, MANIFEST_FILE)

    def other_steps() -> str:
        return f"Restore another step with step= (steps: {all_steps()}), or the newest intact one with fallback=True."

    if not os.path.isdir(path):
        raise DamagedCheckpoint(
            f"{path!r} is a file, not a checkpoint directory (a stray file named like one); remove or rename it."
        )
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path!r} has no {MANIFEST_FILE}: it is not a replicator checkpoint.") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedCheckpoint(
            f"{manifest_path} is not valid JSON ({e}); the checkpoint is damaged. {other_steps()}"
        ) from None
    except OSError as e:
        raise DamagedCheckpoint(f"cannot read {manifest_path} ({e}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedCheckpoint(
            f"{manifest_path} is not a replicator checkpoint manifest (format "
            f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r})."
        )
    version = manifest.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}; this replicator reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Use the replicator version that wrote it."
        )
    if version >= 2:  # version 1 manifests have no digest: only their arrays are checked
        recorded = manifest.get(DIGEST_FIELD)
        if not isinstance(recorded, str):
            raise DamagedCheckpoint(
                f"{manifest_path} lacks its {DIGEST_FIELD} (a version {version} manifest has one); it was modified "
                f"or corrupted. {other_steps()}"
            )
        if manifest_digest(manifest) != recorded:
            raise DamagedCheckpoint(
                f"{manifest_path} was modified or corrupted after it was saved: the sha256 of its content differs "
                f"from its {DIGEST_FIELD}. Checkpoint files must not be edited; {other_steps()}"
            )

    def bad(field: str, value: Any, expected: str) -> CheckpointError:
        return DamagedCheckpoint(
            f"{manifest_path}: {field} is {value!r} ({type(value).__name__}), expected {expected}; the checkpoint "
            f"is damaged. {other_steps()}"
        )

    missing = {"step", "extra", "arrays_file", "arrays_sha256", "leaves"} - manifest.keys()
    if missing:
        raise DamagedCheckpoint(f"{manifest_path} lacks {sorted(missing)}; the checkpoint is damaged. {other_steps()}")
    if not _is_int(manifest["step"]):
        raise bad("step", manifest["step"], "a non-negative int")
    if step is not None and manifest["step"] != step:
        raise DamagedCheckpoint(
            f"{manifest_path} says step {manifest['step']} but its directory is of step {step}; the checkpoint "
            f"was renamed or damaged. {other_steps()}"
        )
    if not isinstance(manifest["extra"], dict):
        raise bad("extra", manifest["extra"], "a JSON object")
    arrays_file = manifest["arrays_file"]
    if not isinstance(arrays_file, str) or not arrays_file or os.path.basename(arrays_file) != arrays_file:
        raise bad("arrays_file", arrays_file, "a file name")
    if not isinstance(manifest["arrays_sha256"], str) or not _SHA256.match(manifest["arrays_sha256"]):
        raise bad("arrays_sha256", manifest["arrays_sha256"], "64 lowercase hex digits")
    if "arrays_bytes" in manifest and not _is_int(manifest["arrays_bytes"]):
        raise bad("arrays_bytes", manifest["arrays_bytes"], "a non-negative int")
    if "treedef" in manifest and not isinstance(manifest["treedef"], str):
        raise bad("treedef", manifest["treedef"], "a string")
    leaves = manifest["leaves"]
    if not isinstance(leaves, list):
        raise bad("leaves", leaves, "a list")
    for i, entry in enumerate(leaves):
        if not isinstance(entry, dict) or not {"path", "shape", "dtype"} <= entry.keys():
            raise DamagedCheckpoint(f"{manifest_path}: leaf {i} lacks path, shape or dtype; the checkpoint is damaged.")
        for field in ("path", "dtype", "key_impl"):
            if field in entry and not isinstance(entry[field], str):
                raise bad(f"leaves[{i}].{field}", entry[field], "a string")
        if not isinstance(entry["shape"], list) or not all(_is_int(d) for d in entry["shape"]):
            raise bad(f"leaves[{i}].shape", entry["shape"], "a list of non-negative ints")
        if "stored_as" in entry and entry["stored_as"] not in _STORED_AS:
            raise bad(f"leaves[{i}].stored_as", entry["stored_as"], f"one of {list(_STORED_AS)}")
        if "shards" in entry:
            if version < SHARDS_VERSION or "key_impl" in entry:
                raise bad(f"leaves[{i}].shards", "...", f"no shards in a version {version} manifest or a PRNG key")
            problem = _shards_problem(entry)
            if problem:
                raise DamagedCheckpoint(
                    f"{manifest_path}: leaves[{i}].shards (state{entry['path']}) {problem}; the checkpoint is "
                    f"damaged. {other_steps()}"
                )
    manifest["path"] = path
    return manifest
