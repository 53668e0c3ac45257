"""ZeRO for the user's own step on a pipeline: state leaves stored ``1/D`` per device of a stage, and the
update cut from the step (:mod:`replicator.stages.user_step`) run on those chunks.

A *chunked* leaf is flattened, padded with zeros to a multiple of ``D`` (the devices of a stage, its data
axes :data:`~replicator.stages.programs.DATA_AXES`) and cut in ``D`` contiguous chunks; device ``r`` (its
index over the data axes) holds chunk ``r``. :class:`ChunkPacking` lays a stage's chunked leaves out
*chunk-major*, one buffer per dtype ``(D * w,)``: chunk ``r`` of every leaf, in order, is the ``r``-th
contiguous ``1/D`` of the buffer, so the buffers sharded ``P('stages', DATA_AXES)`` give each device exactly
its chunks.

:func:`run_chunked` interprets the update's equations where a chunked value is its flat chunk (the
precondition reasoning of :mod:`replicator.passes.shard_optimizer`, on a stage's devices):

* an element-wise equation (:data:`~replicator.passes.shard_optimizer.ELEMENTWISE`) with a chunked operand,
  whose operands are all of the output's shape or scalars, runs on chunks: a whole operand of that shape is
  sliced to this device's chunk, a scalar used whole. A chunk of ``f(x, y)`` is ``f`` of the chunks;
* a ``reduce_sum`` / ``reduce_max`` / ``reduce_min`` over every axis of a chunked floating-point value is
  reduced on the chunk (its padding masked: ``0``, ``-inf``, ``+inf``) and combined with ``psum`` / ``pmax``
  / ``pmin`` over the data axes: every device gets the whole result (a global gradient norm);
* a ``jit`` call never reaches it: :func:`~replicator.stages.split.split_stages` inlines them all first;
* with ``scatter`` (ZeRO-2), an ``rp.all_mean`` / ``rp.all_sum`` over every replica of a floating-point
  value of the step's forward and backward (a gradient) becomes a ``psum_scatter`` (``/ D`` for a mean):
  each device receives only its chunk of the averaged gradient;
* any other equation that reads a chunked value (a ``dot``, a reshape, a partial reduction, control flow)
  reads it whole, all-gathered once (correct, not memory-saving).

:func:`plan` runs the same rules on the equations alone, so that the step can keep whole a leaf whose update
would gather it (its storage would save nothing).

>>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
>>> chunks = ChunkPacking([[f32(3), f32(2, 2)], [f32(5)]], 2)
>>> chunks.buffers()
{'chunks_float32': (dtype('float32'), 8)}
>>> row = chunks.pack(0, [jnp.arange(3.0), 10 + jnp.arange(4.0).reshape(2, 2)])
>>> row["chunks_float32"].reshape(2, 4).tolist()  # device 0: [0, 1 | 10, 11], device 1: [2, pad | 12, 13]
[[0.0, 1.0, 10.0, 11.0], [2.0, 0.0, 12.0, 13.0]]
>>> [x.tolist() for x in chunks.unpack(0, row)]
[[0.0, 1.0, 2.0], [[10.0, 11.0], [12.0, 13.0]]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import DropVar, JaxprEqn, Literal, Var

from replicator.core.primitives import PLACEHOLDERS, all_reduce_p
from replicator.passes.shard_optimizer import ELEMENTWISE
from replicator.stages.programs import DATA_AXES, _collective, _run
from replicator.stages.stack_update import StageSlices, run_on_slices

__all__ = ["ChunkPacking", "Chunks", "chunkable", "plan", "run_chunked"]

PREFIX = "chunks_"

#: Reductions over every axis computed on chunks: the padding's value, the combining collective.
_REDUCE: dict[str, tuple[float, Callable]] = {
    "reduce_sum": (0.0, lax.psum),
    "reduce_max": (-np.inf, lax.pmax),
    "reduce_min": (np.inf, lax.pmin),
}


def _size(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def chunkable(aval: Any) -> bool:
    """A leaf that can be stored in chunks: floating point, at least one axis, not empty."""
    return jnp.issubdtype(aval.dtype, jnp.inexact) and len(aval.shape) >= 1 and _size(aval) > 0


class ChunkPacking:
    """Per stage, its chunked leaves (avals) as one chunk-major buffer per dtype (see the module docstring):
    ``"<prefix><dtype>"`` (``"chunks_float32"``), ``D * w`` long, ``w`` the largest stage's chunks of that dtype together. Offers
    what :class:`~replicator.stages.rows.RowPacker` and :class:`~replicator.stages.rows.RowUnpacker` use of a
    :class:`~replicator.stages.packing.Packing` (``buffers``, ``pack``, ``unpack``: whole rows), and
    ``local_unpack`` / ``local_pack`` for a device's own chunk of a row."""

    def __init__(self, layouts: Sequence[Sequence[Any]], replicas: int, prefix: str = PREFIX):
        self.layouts = [list(layout) for layout in layouts]
        self.replicas, self.prefix = replicas, prefix
        widths: dict[Any, int] = {}
        for layout in self.layouts:
            per: dict[Any, int] = {}
            for aval in layout:
                per[jnp.dtype(aval.dtype)] = per.get(jnp.dtype(aval.dtype), 0) + self.chunk(aval)
            for dtype, w in per.items():
                widths[dtype] = max(widths.get(dtype, 0), w)
        #: Per dtype, the width ``w`` of a device's chunk of the buffer.
        self.widths = dict(sorted(widths.items(), key=lambda kv: str(kv[0])))

    def chunk(self, aval: Any) -> int:
        """The length of one chunk of a leaf: its size over ``D``, rounded up."""
        return -(-_size(aval) // self.replicas)

    def buffers(self) -> dict[str, tuple[Any, int]]:
        return {f"{self.prefix}{d}": (d, self.replicas * w) for d, w in self.widths.items()}

    @property
    def nbytes(self) -> int:
        """The bytes of one device's chunks (``1/D`` of a stage's buffers)."""
        return sum(w * d.itemsize for d, w in self.widths.items())

    def zeros(self, lead: tuple[int, ...] = ()) -> dict:
        return {k: jnp.zeros((*lead, n), d) for k, (d, n) in self.buffers().items()}

    def offsets(self, stage: int) -> list[int]:
        """Where each of ``stage``'s chunked leaves starts in a device's chunk of its dtype's buffer."""
        ends = dict.fromkeys(self.widths, 0)
        out = []
        for aval in self.layouts[stage]:
            out.append(ends[jnp.dtype(aval.dtype)])
            ends[jnp.dtype(aval.dtype)] += self.chunk(aval)
        return out

    def pack(self, stage: int, values: Sequence[Any]) -> dict:
        """Whole leaves as ``stage``'s whole buffers ``(D * w,)``, chunk-major."""
        d = self.replicas
        parts: dict[Any, list] = {dtype: [] for dtype in self.widths}
        for aval, value in zip(self.layouts[stage], values, strict=True):
            c = self.chunk(aval)
            flat = jnp.ravel(value).astype(aval.dtype)
            parts[jnp.dtype(aval.dtype)].append(jnp.pad(flat, (0, d * c - flat.shape[0])).reshape(d, c))
        out = {}
        for dtype, w in self.widths.items():
            table = jnp.concatenate(parts[dtype], axis=1) if parts[dtype] else jnp.zeros((d, 0), dtype)
            out[f"{self.prefix}{dtype}"] = jnp.pad(table, ((0, 0), (0, w - table.shape[1]))).reshape(-1)
        return out

    def unpack(self, stage: int, buffers: dict) -> list:
        """``stage``'s whole leaves from its whole buffers ``(D * w,)``."""
        out = []
        for aval, start in zip(self.layouts[stage], self.offsets(stage), strict=True):
            dtype, c = jnp.dtype(aval.dtype), self.chunk(aval)
            table = buffers[f"{self.prefix}{dtype}"].reshape(self.replicas, self.widths[dtype])
            out.append(table[:, start : start + c].reshape(-1)[: _size(aval)].reshape(aval.shape))
        return out

    def local_unpack(self, stage: int, buffers: dict) -> list:
        """This device's flat chunk of each of ``stage``'s leaves, from its chunk of the buffers ``(1, w)``."""
        return [
            buffers[f"{self.prefix}{jnp.dtype(aval.dtype)}"][0, start : start + self.chunk(aval)]
            for aval, start in zip(self.layouts[stage], self.offsets(stage), strict=True)
        ]

    def local_pack(self, stage: int, chunks: Sequence[Any]) -> dict:
        """This device's chunks of ``stage``'s leaves as its chunk of the buffers ``(1, w)``."""
        parts: dict[Any, list] = {dtype: [] for dtype in self.widths}
        for aval, value in zip(self.layouts[stage], chunks, strict=True):
            parts[jnp.dtype(aval.dtype)].append(value.astype(aval.dtype))
        out = {}
        for dtype, w in self.widths.items():
            flat = jnp.concatenate(parts[dtype]) if parts[dtype] else jnp.zeros((0,), dtype)
            out[f"{self.prefix}{dtype}"] = jnp.pad(flat, (0, w - flat.shape[0]))[None]
        return out


class Chunks:
    """This device's chunks of leaf-shaped values on a stage's ``D`` devices (inside ``shard_map``)."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def width(self, aval: Any) -> int:
        return -(-_size(aval) // self.replicas)

    def valid(self, aval: Any) -> jax.Array:
        """Which elements of this device's chunk are the leaf's (``False``: padding)."""
        c = self.width(aval)
        return lax.axis_index(DATA_AXES) * c + jnp.arange(c) < _size(aval)

    def mine(self, value: Any, aval: Any) -> jax.Array:
        """This device's chunk of a whole leaf-shaped value (padding zeros)."""
        c = self.width(aval)
        flat = jnp.ravel(jnp.broadcast_to(value, aval.shape))
        flat = jnp.pad(flat, (0, self.replicas * c - flat.shape[0]))
        return lax.dynamic_slice_in_dim(flat, lax.axis_index(DATA_AXES) * c, c)

    def gather(self, chunk: jax.Array, aval: Any) -> jax.Array:
        """The whole value from every device's chunk, in order."""
        return lax.all_gather(chunk, DATA_AXES, tiled=True)[: _size(aval)].reshape(aval.shape)

    def scatter(self, value: jax.Array, aval: Any, mean: bool) -> jax.Array:
        """This device's chunk of the sum (``mean``: the mean) of ``value`` over the devices."""
        c = self.width(aval)
        flat = jnp.ravel(value)
        flat = jnp.pad(flat, (0, self.replicas * c - flat.shape[0]))
        out = lax.psum_scatter(flat, DATA_AXES, scatter_dimension=0, tiled=True)
        return (out / self.replicas).astype(value.dtype) if mean else out


def _vars(atoms: Sequence[Any]) -> list[Var]:
    return [v for v in atoms if isinstance(v, Var)]


def _how(eqn: JaxprEqn, chunked: Callable[[Any], bool], scatter: frozenset) -> str:
    """How :func:`run_chunked` runs ``eqn``: ``"whole"``, ``"elementwise"``, ``"reduce"``, ``"scatter"`` or
    ``"gather"`` (its chunked operands read whole: a ``jit`` call too, which the split has already inlined)."""
    reads = [v for v in eqn.invars if chunked(v)]
    if eqn.primitive in PLACEHOLDERS:
        if (
            not reads
            and eqn.primitive is all_reduce_p
            and eqn.params.get("op") in ("mean", "sum")
            and eqn.params.get("group") is None
            and any(isinstance(v, Var) and v in scatter for v in eqn.invars)
        ):
            return "scatter"
        return "gather" if reads else "whole"
    if not reads:
        return "whole"
    if eqn.effects:
        return "gather"
    name = eqn.primitive.name
    shape = reads[0].aval.shape
    if (
        name in ELEMENTWISE
        and len(eqn.outvars) == 1
        and eqn.outvars[0].aval.shape == shape
        and all(getattr(v.aval, "shape", ()) in ((), shape) for v in eqn.invars)
    ):
        return "elementwise"
    if (
        name in _REDUCE
        and len(eqn.invars) == 1
        and tuple(eqn.params.get("axes", ())) == tuple(range(len(shape)))
        and jnp.issubdtype(reads[0].aval.dtype, jnp.floating)
    ):
        return "reduce"
    return "gather"


def _scatters(eqn: JaxprEqn, scatter: frozenset) -> list[bool]:
    """Per operand of a ``"scatter"`` all-reduce: whether it is reduce-scattered (else all-reduced)."""
    return [isinstance(v, Var) and v in scatter and chunkable(v.aval) for v in eqn.invars]


def plan(eqns: Sequence[JaxprEqn], chunked: set[Var], scatter: frozenset = frozenset()) -> tuple[set, set]:
    """What :func:`run_chunked` does with ``chunked`` variables given as chunks: the variables it computes as
    chunks (``chunked`` included) and the chunked ones it reads whole (all-gathers)."""
    chunks, gathered = set(chunked), set()
    for eqn in eqns:
        how = _how(eqn, lambda v: isinstance(v, Var) and v in chunks, scatter)
        if how in ("elementwise", "scatter"):
            parts = [True] * len(eqn.outvars) if how == "elementwise" else _scatters(eqn, scatter)
            chunks.update(o for o, part in zip(eqn.outvars, parts, strict=True) if part and isinstance(o, Var))
        elif how == "gather":
            gathered.update(v for v in _vars(eqn.invars) if v in chunks)
    return chunks, gathered


def run_chunked(
    eqns: Sequence[JaxprEqn],
    env: dict[Var, Any],
    chunks: dict[Var, Any],
    on: Chunks,
    scatter: frozenset = frozenset(),
    sliced: StageSlices | None = None,
) -> None:
    """Bind ``eqns`` in order (see the module docstring): ``env`` holds whole values, ``chunks`` this device's
    chunk of the chunked ones (a chunked value read whole is all-gathered once, into ``env``). ``sliced``: the
    values ``env`` holds as this stage's slice of a stack (:mod:`~replicator.stages.stack_update`), with their
    ``(start, stop)``; an equation other than a collective that reads one runs on the slices (none reads a
    chunked value: the caller plans the two apart)."""

    def chunked(v: Any) -> bool:
        return isinstance(v, Var) and v in chunks

    def whole(v: Any) -> Any:
        if isinstance(v, Literal):
            return v.val
        if v not in env:
            env[v] = on.gather(chunks[v], aval(v))
        return env[v]

    def aval(v: Any) -> Any:  # a sliced value's aval is its slice's
        return sliced.aval(v) if sliced is not None else v.aval

    for eqn in eqns:
        if (
            sliced
            and eqn.primitive not in PLACEHOLDERS
            and not any(chunked(v) for v in eqn.invars)
            and any(isinstance(v, Var) and v in sliced for v in eqn.invars)
        ):
            run_on_slices(eqn, env, sliced)
            continue
        how = _how(eqn, chunked, scatter)
        if how in ("whole", "gather"):
            for v in eqn.invars:  # "gather": its chunked operands read whole
                if chunked(v):
                    whole(v)
            if eqn.primitive in PLACEHOLDERS:
                _collective(eqn, env)
            else:
                _run([eqn], env)
            continue
        if how == "scatter":
            op = eqn.params["op"]
            for v, out, part in zip(eqn.invars, eqn.outvars, _scatters(eqn, scatter), strict=True):
                if isinstance(out, DropVar):
                    continue
                if part:
                    chunks[out] = on.scatter(whole(v), aval(v), mean=op == "mean")
                else:
                    env[out] = (lax.pmean if op == "mean" else lax.psum)(whole(v), DATA_AXES)
            continue
        (out,) = eqn.outvars
        if how == "reduce":
            (x,) = eqn.invars
            fill, combine = _REDUCE[eqn.primitive.name]
            part = jnp.where(on.valid(aval(x)), chunks[x], jnp.asarray(fill, x.aval.dtype))
            local = {"reduce_sum": jnp.sum, "reduce_max": jnp.max, "reduce_min": jnp.min}[eqn.primitive.name](part)
            if not isinstance(out, DropVar):
                env[out] = combine(local, DATA_AXES).astype(out.aval.dtype)
            continue
        # "elementwise": the chunks of the leaf-shaped operands, the scalars whole. On a slice of a stack, an
        # operand computed whole (not sliced) is sliced first.
        first = next(v for v in eqn.invars if chunked(v))
        shape = aval(first)
        args = []
        for v in eqn.invars:
            if chunked(v):
                args.append(chunks[v])
            elif getattr(v.aval, "shape", ()) == ():
                args.append(whole(v))
            elif sliced and first in sliced and v not in sliced:
                args.append(on.mine(lax.slice_in_dim(whole(v), *sliced[first]), shape))
            else:
                args.append(on.mine(whole(v), shape))
        bound = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        value = eqn.primitive.bind(*subfuns, *args, **params)
        if not isinstance(out, DropVar):
            chunks[out] = value
