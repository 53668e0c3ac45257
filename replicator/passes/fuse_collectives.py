"""``fuse-collectives``: combine independent collectives into one per bucket.

The pass fuses three kinds of collective: all-reduces
(``rp.all_sum``/``rp.all_mean``/..., with the ``ops`` chosen) and, with
``scatter_gather=True`` (the default), reduce-scatters along axis 0 and tiled
all-gathers along axis 0 (those that ``shard-optimizer-update`` emits, one
per tensor). Each kind is bucketed separately. It used to be called
``fuse-allreduce`` (class ``FuseAllReduce``); both old names still work, with a
``DeprecationWarning``.

Many small collectives are much slower than one big one (Horovod's *Tensor
Fusion*, PyTorch DDP's gradient buckets, XLA's all-reduce combiner; figures in
BENCHMARKS.md). A step that averages its gradients leaf by leaf produces
exactly that pattern. This pass runs on the placeholders (before
``lower-collectives``) and rewrites::

    a = rp.all_reduce[op=mean group=None] ga        # f32[4, 4]
    b = rp.all_reduce[op=mean group=None] gb        # f32[4]

into::

    fa = reshape ga (16,) ; fb = reshape gb (4,)
    buf = concatenate fa fb                         # f32[20]
    s = rp.all_reduce[op=mean group=None] buf       # one collective
    a = reshape (slice s 0:16) (4, 4) ; b = slice s 16:20

How it decides, per *region* (the step's jaxpr and, separately, every
sub-jaxpr: ``cond`` branches, ``scan``/``while`` bodies, ``jit``, ``remat``,
custom-derivative calls; callees first). A collective never moves across a
control-flow boundary.

* Walking the equations in order, the pass keeps an open *window* of buckets
  keyed by ``(op, group, dtype)`` (and weak type, so that every value keeps
  its exact type). An ``rp.all_reduce`` whose op is fused and whose inputs do
  not depend on a pending bucket joins the bucket of each of its operands (an
  equation with operands of several dtypes is split across buckets).
* Outputs of bucket members are *tainted*; an equation reading a tainted
  value is deferred (its outputs become tainted too); any other equation is
  emitted at once.
* An all-reduce reading a tainted value, or any equation with effects, first
  *flushes* the window: the fused collectives of every bucket, then the
  deferred equations in their original order. The region's end flushes too.
* A bucket that would grow past ``threshold_bytes`` is closed and a new one
  started (an operand larger than the threshold gets a bucket of its own).

Every fused collective reads only values defined before the flush point, and
deferred equations are emitted after it in program order, so the rewrite
never creates a cycle. Buckets and their members are in program order, so
every replica (and every run) builds the same program. A region where nothing
is fused is kept exactly as it was (reordering alone is not a change), so
running the pass on its own output changes nothing.

**Precondition (soundness).** Collectives share a bucket only when all of
these hold, and the pass checks each:

* same kind and parameters: ``rp.all_reduce`` with the same ``op`` (one of
  ``ops``), or (with ``scatter_gather``) ``rp.reduce_scatter`` along axis 0,
  or tiled ``rp.all_gather`` along axis 0; the same ``group`` and
  ``group_size``; operands of the same dtype *and* weak type (an all-reduce of
  several dtypes is split, one bucket per dtype);
* the same region: the same jaxpr, never across a ``cond``/``while``/``scan``
  body or any other sub-jaxpr (those are fused on their own);
* no data dependence: no member reads, directly or through any chain of
  equations (sub-jaxpr containers included), the result of another member of
  a pending bucket; such an all-reduce first flushes the window;
* no effects crossed: an equation with effects flushes the window, so the
  fused collectives and the deferred equations run before it.

Then every element is reduced over the same replicas with the same op as
before (concatenation and slicing move no element across replicas; a
reduce-scatter's leaf ``(a, ...)`` viewed as ``(N, a/N * ...)`` puts chunk
``r`` in row ``r``, which replica ``r`` keeps; a gather's row ``r`` is replica
``r``'s chunk), and the result is the same up to the order in which the
backend adds the ``N`` values of one element (integers: exactly).
Tests just outside (``tests/passes/test_fuse_collectives.py``): dependent
all-reduces, also through a ``jit``/``cond``/``scan``; mixed dtypes; weak and
strong types; different groups; ops not chosen; reduce-scatters off axis 0
and untiled all-gathers; effects; collectives in different regions.

Example: two gradients and a loss, averaged one by one, travel as one all-reduce
(it is in the default pass manager; ``fusion_report`` lists the planned buckets):

>>> from replicator.passes.fuse_collectives import fusion_report
>>> def step(batch):
...     return rp.all_mean(batch["a"]), rp.all_mean(batch["b"]), rp.all_mean(batch["a"].sum())
>>> batch = {"a": np.ones((8, 4, 4), np.float32), "b": np.ones((8, 4), np.float32)}
>>> repl = rp.Replicator(1, 8)
>>> [(b.kind, b.op, b.num_operands, b.nbytes) for b in fusion_report(repl.lower(step, batch).traced)]
[('all_reduce', 'mean', 3, 84)]
>>> [(r.kind, r.tensors, r.nbytes) for r in repl.explain(step, batch).rows]
[('all_mean', 3, 84)]
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import DropVar, Jaxpr, JaxprEqn, Var

from replicator._jax_compat import user_source_line
from replicator.analysis.records import origin_of, pass_on_origin
from replicator.core.buffers import nbytes, pack, per_dtype_buffers, unpack
from replicator.core.context import ReplicaContext
from replicator.core.graph import Origin, StepGraph
from replicator.core.jaxprs import inline_function, map_subjaxprs, merge_effects, region_name
from replicator.core.primitives import REDUCE_OPS, all_gather_p, all_reduce_p, reduce_scatter_p
from replicator.pass_manager.contract import Pass, PassResult

__all__ = [
    "DEFAULT_MAX_TENSOR_BYTES",
    "DEFAULT_THRESHOLD_BYTES",
    "Bucket",
    "FuseAllReduce",
    "FuseCollectives",
    "fusion_report",
]

Atom = Any  # Var | Literal
BucketKey = tuple  # (kind, op, group, group_size, dtype, weak_type)

#: Bucket size cap, as Horovod's default fusion buffer (DDP uses 25 MiB).
DEFAULT_THRESHOLD_BYTES = 64 * 2**20

#: Tensors larger than this are not fused (each keeps its own collective):
#: copying them into a buffer and back costs more than one more collective.
#: Chosen with ``benchmarks/bench_step.py --workloads threshold`` (see BENCHMARKS.md).
DEFAULT_MAX_TENSOR_BYTES = 64 * 2**10


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket of all-reduce operands, as the pass plans it.

    Attributes:
      region: where the bucket lives: ``'step'`` for the top-level jaxpr, then
        ``/<primitive>@<equation index>.<sub-jaxpr index>`` per nesting level,
        e.g. ``'step/scan@7.0'``.
      op: the reduction (``'sum'``, ``'mean'``, ...).
      group: the replica group (``None``, ``'cores'``, ``'workers'``).
      dtype: the operands' dtype name.
      shapes: each operand's shape, in program order.
      sources: the user's source line of each operand's collective.
      nbytes: the bytes the bucket's collective carries.
      fused: whether the bucket became a new collective (False: one original
        equation kept as it was).
    """

    region: str
    op: str
    group: str | None
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    sources: tuple[str, ...]
    nbytes: int
    fused: bool
    kind: str = "all_reduce"  # or 'reduce_scatter' / 'all_gather' (ZeRO's collectives)

    @property
    def num_operands(self) -> int:
        return len(self.shapes)


@dataclasses.dataclass
class _Member:
    eqn: JaxprEqn  # the original collective (invars already substituted)
    index: int  # which of its operands

    @property
    def atom(self) -> Atom:
        return self.eqn.invars[self.index]

    @property
    def outvar(self) -> Var:
        return self.eqn.outvars[self.index]


@dataclasses.dataclass
class _Pending:
    key: BucketKey
    members: list[_Member] = dataclasses.field(default_factory=list)
    nbytes: int = 0


def _kind(eqn: JaxprEqn) -> str:
    return eqn.primitive.name.removeprefix("rp.")


def _is_whole_eqn(members: Sequence[_Member]) -> bool:
    """True if ``members`` are one equation's only operand: nothing to fuse.

    An equation with several operands (a pytree all-reduce) is still fused:
    XLA would otherwise run it as a tuple all-reduce of many small buffers,
    which is as slow on CPU as separate all-reduces.
    """
    eqn = members[0].eqn
    return len(members) == 1 and len(eqn.invars) == 1


def _fused_reduce_scatter(params: dict) -> Any:
    """``fn(*xs)``: one reduce-scatter along axis 0 of many leaves.

    Each leaf ``(a, ...)`` is viewed as ``(N, a/N * ...)``, the views are
    concatenated along axis 1 and scattered along axis 0, so row ``r`` of the
    buffer holds the ``r``-th chunk of every leaf.
    """
    n = params["group_size"]

    def fn(*xs: Any) -> list:
        buf, cols = pack(xs, rows=n)
        mine = reduce_scatter_p.bind(buf, **params)  # (1, K)
        return unpack(mine, cols, [(x.shape[0] // n, *x.shape[1:]) for x in xs])

    return fn


def _fused_all_gather(params: dict) -> Any:
    """``fn(*xs)``: one tiled all-gather along axis 0 of many chunks."""
    n = params["group_size"]

    def fn(*xs: Any) -> list:
        buf, cols = pack(xs, rows=1)
        every = all_gather_p.bind(buf, **params)  # (N, K)
        return unpack(every, cols, [(n * x.shape[0], *x.shape[1:]) for x in xs])

    return fn


def _fused_all_reduce(params: dict) -> Any:
    """``fn(*xs)``: one all-reduce of all ``xs`` (one dtype) flattened and concatenated."""

    def fn(*xs: Any) -> list:
        if len(xs) == 1:
            return all_reduce_p.bind(xs[0], **params)
        return per_dtype_buffers(xs, lambda buffers: all_reduce_p.bind(*buffers, **params), skip_empty=False)

    return fn


class _Window:
    """The rewrite of one region: emitted equations, pending buckets, deferrals."""

    def __init__(
        self,
        fuser: FuseCollectives,
        context: ReplicaContext,
        region: str,
        report: list[Bucket],
        origins: dict[Var, Origin],
    ):
        self.fuser = fuser
        self.context = context
        self.region = region
        self.report = report
        #: Read and extended: what each placeholder carries (``StepGraph.collective_origins``).
        self.origins = origins
        self.out: list[JaxprEqn] = []
        self.env: dict[Var, Atom] = {}
        self.changed = False
        self._buckets: list[_Pending] = []  # open and closed, in creation order
        self._open: dict[BucketKey, _Pending] = {}
        self._deferred: list[JaxprEqn] = []
        self._tainted: set[Var] = set()

    # -- helpers ---------------------------------------------------------------

    def read(self, atom: Atom) -> Atom:
        return self.env.get(atom, atom) if isinstance(atom, Var) else atom

    def _substitute(self, eqn: JaxprEqn) -> JaxprEqn:
        if any(isinstance(v, Var) and v in self.env for v in eqn.invars):
            return eqn.replace(invars=[self.read(v) for v in eqn.invars])
        return eqn

    def _reads_tainted(self, eqn: JaxprEqn) -> bool:
        return any(isinstance(v, Var) and v in self._tainted for v in eqn.invars)

    def _taint(self, eqn: JaxprEqn) -> None:
        self._tainted.update(v for v in eqn.outvars if not isinstance(v, DropVar))

    def _origin(self, member: _Member) -> Origin:
        """The user's tensors one operand carries (one, unless a pass already combined several)."""
        known = self.origins.get(member.outvar)
        if known is not None:
            return known
        return Origin(1, origin_of(member.eqn, {}).sources)

    # -- the walk ----------------------------------------------------------------

    def process(self, eqn: JaxprEqn) -> None:
        """Emit, defer or bucket one equation (its sub-jaxprs already fused)."""
        eqn = self._substitute(eqn)
        if self.fuser.is_candidate(eqn):
            if self._reads_tainted(eqn):
                self.flush()
                eqn = self._substitute(eqn)  # it may read what the flush just produced
            self._join(eqn)
        elif eqn.effects:
            self.flush()
            self.out.append(self._substitute(eqn))
        elif self._reads_tainted(eqn):
            self._deferred.append(eqn)
            self._taint(eqn)
        else:
            self.out.append(eqn)

    def _join(self, eqn: JaxprEqn) -> None:
        params = eqn.params
        for index, atom in enumerate(eqn.invars):
            aval = atom.aval
            key = (_kind(eqn), params.get("op"), params["group"], params["group_size"], aval.dtype, aval.weak_type)
            size = nbytes(aval)
            if self.fuser.max_tensor_bytes is not None and size > self.fuser.max_tensor_bytes:
                # A large tensor travels alone: copying it into a buffer costs more than it saves.
                alone = _Pending(key, [_Member(eqn, index)], size)
                self._buckets.append(alone)
                continue
            bucket = self._open.get(key)
            if bucket is None or (bucket.members and bucket.nbytes + size > self.fuser.threshold_bytes):
                bucket = self._open[key] = _Pending(key)
                self._buckets.append(bucket)
            bucket.members.append(_Member(eqn, index))
            bucket.nbytes += size
        self._taint(eqn)

    def flush(self) -> None:
        """Emit every pending bucket, then the deferred equations in order."""
        for bucket in self._buckets:
            self._emit(bucket)
        for eqn in self._deferred:
            self.out.append(self._substitute(eqn))
        self._buckets, self._open, self._deferred = [], {}, []
        self._tainted = set()

    def _emit(self, bucket: _Pending) -> None:
        members = bucket.members
        first = members[0].eqn
        fused = not _is_whole_eqn(members)
        self.report.append(
            Bucket(
                region=self.region,
                op=first.params.get("op", _kind(first)),
                group=first.params["group"],
                dtype=str(members[0].atom.aval.dtype),
                shapes=tuple(tuple(m.atom.aval.shape) for m in members),
                sources=tuple(user_source_line(m.eqn.source_info) for m in members),
                nbytes=bucket.nbytes,
                fused=fused,
                kind=_kind(first),
            )
        )
        if not fused:
            self.out.append(first)
            return
        self.changed = True
        params = dict(first.params)
        fused_fn = {"all_reduce": _fused_all_reduce, "reduce_scatter": _fused_reduce_scatter}.get(
            _kind(first), _fused_all_gather
        )(params)
        eqns, outs = inline_function(fused_fn, [m.atom for m in members], context=self.context, like=first)
        carried = Origin.merge(self._origin(m) for m in members)
        self.origins.update(pass_on_origin(carried, eqns))
        self.out.extend(eqns)
        for member, atom in zip(members, outs, strict=True):
            if not isinstance(member.outvar, DropVar):
                self.env[member.outvar] = atom


class FuseCollectives(Pass):
    """Fuse independent all-reduces, and reduce-scatters and all-gathers, into buckets.

    Not only all-reduces: with ``scatter_gather`` (the default) the
    reduce-scatters and tiled all-gathers along axis 0 are bucketed too, each
    kind in buckets of its own.

    Args:
      threshold_bytes: the most bytes one fused collective carries; a bucket
        that would grow past it is closed and a new one started.
      ops: the reductions to fuse (any of ``'sum'``, ``'mean'``, ``'max'``,
        ``'min'``); all-reduces with other ops are left alone.
      scatter_gather: also bucket the reduce-scatters and tiled all-gathers
        along axis 0 that ``shard-optimizer-update`` emits.
      max_tensor_bytes: tensors larger than this keep their own collective
        (``None``: fuse every size).
    """

    name = "fuse-collectives"
    #: ZeRO's reduce-scatters and all-gathers are fused only if they exist already.
    run_after = ("shard-optimizer-update",)

    def __init__(
        self,
        threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
        ops: Sequence[str] = ("sum", "mean"),
        *,
        scatter_gather: bool = True,
        max_tensor_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES,
    ):
        if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, (int, np.integer)):
            raise TypeError(f"FuseCollectives: threshold_bytes must be an int, got {threshold_bytes!r}.")
        if threshold_bytes <= 0:
            raise ValueError(f"FuseCollectives: threshold_bytes must be positive, got {threshold_bytes}.")
        if isinstance(ops, str):
            ops = (ops,)
        unknown = [op for op in ops if op not in REDUCE_OPS]
        if unknown:
            raise ValueError(f"FuseCollectives: unknown ops {unknown}; choose from {list(REDUCE_OPS)}.")
        self.threshold_bytes = int(threshold_bytes)
        self.ops = tuple(dict.fromkeys(ops))
        self.scatter_gather = bool(scatter_gather)
        if max_tensor_bytes is not None and (isinstance(max_tensor_bytes, bool) or max_tensor_bytes < 0):
            raise ValueError(f"FuseCollectives: max_tensor_bytes must be None or >= 0, got {max_tensor_bytes!r}.")
        self.max_tensor_bytes = None if max_tensor_bytes is None else int(max_tensor_bytes)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold_bytes={self.threshold_bytes}, ops={self.ops!r}, "
            f"scatter_gather={self.scatter_gather}, max_tensor_bytes={self.max_tensor_bytes})"
        )

    def is_candidate(self, eqn: JaxprEqn) -> bool:
        """A collective this pass may put into a bucket.

        All-reduces with one of ``ops``; with ``scatter_gather``, also the
        reduce-scatters and tiled all-gathers along axis 0 that
        ``shard-optimizer-update`` emits (one per tensor).
        """
        if not (len(eqn.invars) > 0 and all(isinstance(getattr(v.aval, "dtype", None), np.dtype) for v in eqn.invars)):
            return False
        if eqn.primitive is all_reduce_p:
            return eqn.params["op"] in self.ops
        if not self.scatter_gather or eqn.params.get("axis") != 0:
            return False
        return eqn.primitive is reduce_scatter_p or (eqn.primitive is all_gather_p and eqn.params["tiled"])

    def run(self, graph: StepGraph) -> PassResult:
        new, _ = self._fuse_graph(graph)
        return new

    def plan(self, graph: StepGraph) -> list[Bucket]:
        """The buckets this pass forms on ``graph``, in program order per region."""
        return self._fuse_graph(graph)[1]

    def _fuse_graph(self, graph: StepGraph) -> tuple[PassResult, list[Bucket]]:
        report: list[Bucket] = []
        origins = dict(graph.collective_origins)
        new, changed = self._fuse_region(graph.jaxpr.jaxpr, graph.context, "step", report, origins)
        return PassResult.rewritten(graph, new, changed, origins=origins), report

    def _fuse_region(
        self, jaxpr: Jaxpr, context: ReplicaContext, region: str, report: list[Bucket], origins: dict[Var, Origin]
    ) -> tuple[Jaxpr, bool]:
        """Fuse one jaxpr (sub-jaxprs first); return it unchanged if nothing fused."""
        window = _Window(self, context, region, report, origins)
        subs_changed = False
        for index, eqn in enumerate(jaxpr.eqns):
            counter = itertools.count()

            def fuse_sub(sub: Jaxpr, *, eqn: JaxprEqn = eqn, index: int = index, counter: Any = counter) -> Jaxpr:
                nonlocal subs_changed
                where = region_name(region, eqn, index, next(counter))
                new, changed = self._fuse_region(sub, context, where, report, origins)
                subs_changed |= changed
                return new

            window.process(map_subjaxprs(eqn, fuse_sub))
        window.flush()
        if not (window.changed or subs_changed):
            return jaxpr, False
        return jaxpr.replace(
            eqns=window.out,
            outvars=[window.read(v) for v in jaxpr.outvars],
            effects=merge_effects(window.out),
        ), True


def fusion_report(graph: StepGraph, fuser: FuseCollectives | None = None) -> list[Bucket]:
    """The all-reduce buckets of ``graph`` (with placeholders), region by region.

    On a graph that ``fuse-collectives`` already rewrote, every bucket is one
    existing collective (``fused=False``) and the report lists the collectives
    that will run.

    Args:
      graph: a step graph before ``lower-collectives``.
      fuser: the pass configuration to plan with (default: ``FuseCollectives()``).

    Returns:
      One :class:`Bucket` per collective the fused graph has, in program order
      within each region (sub-regions are listed before the region holding them).
    """
    return (fuser if fuser is not None else FuseCollectives()).plan(graph)


class FuseAllReduce(FuseCollectives):
    """Deprecated: the old name of :class:`FuseCollectives` (it fuses more than all-reduces)."""

    def __init__(self, *args: Any, **kwargs: Any):
        warnings.warn(
            "FuseAllReduce is deprecated: use FuseCollectives (the pass is now named 'fuse-collectives').",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
