"""Checkpoints of a training state: atomic, checked, and never executed.

One directory per step holds the leaves stored whole (``arrays.npz``, read
with ``allow_pickle=False``), the shards of the leaves split over devices (one
raw file per process, each shard written once by the process that holds it)
and a JSON manifest. Saves are atomic and hold a lock on the directory (one
writer at a time); restores check the manifest's digest, its field types, and
the tree paths, shapes, dtypes and sha256 against the target state
(``fallback=True``: the newest intact checkpoint), and re-shard: each leaf is
built on the target's layout, whatever layout saved it. The format and the
multi-process rules are in ``docs/design/checkpoints.md``.

>>> import tempfile
>>> directory = tempfile.mkdtemp()
>>> params = {"w": jnp.arange(3.0), "b": jnp.zeros(())}
>>> rp.save_checkpoint(directory, 10, params, extra={"input_position": 10})
'.../step_00000010'
>>> step, restored, extra = rp.restore_checkpoint(directory, params)  # the newest
>>> step, restored["w"].tolist(), extra
(10, [0.0, 1.0, 2.0], {'input_position': 10})
>>> manager = rp.CheckpointManager(directory, keep=2)  # keeps the 2 newest
>>> for step in (20, 30):
...     _ = manager.save(step, params)
>>> manager.all_steps()
[20, 30]

Modules: :mod:`~.encoding` (leaves <-> stored arrays), :mod:`~.files`
(durable file I/O), :mod:`~.manifest` (the manifest's format, digest and
checks), :mod:`~.shards` (leaves stored as shards), :mod:`~.manager` (:class:`CheckpointManager`, the commit protocol,
and the functions), :mod:`~.agreement` (multi-process save and restore),
:mod:`~.snapshot` and :mod:`~.background` (asynchronous saves:
``CheckpointManager.save_async`` holds the state at the step, a thread
writes and commits it), :mod:`~.interop` (``restore_orbax`` and
``export_orbax``: checkpoints from and for orbax, with the optional extra
``replicator[orbax]``).
"""

from __future__ import annotations

from replicator.training.checkpoint.encoding import CheckpointError
from replicator.training.checkpoint.interop import export_orbax, restore_orbax
from replicator.training.checkpoint.manager import (
    CheckpointManager,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "export_orbax",
    "latest_step",
    "restore_checkpoint",
    "restore_orbax",
    "save_checkpoint",
]
