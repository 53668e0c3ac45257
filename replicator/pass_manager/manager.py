"""The pass manager: ordered named passes, checked, dumped, disableable.

(Formerly ``replicator.pipeline.pipeline.Pipeline``: "pipeline" now means pipeline parallelism only.)

A :class:`PassManager` runs its passes in order on a :class:`StepGraph` and keeps
every intermediate graph (a :class:`PassSnapshot`, in :attr:`Lowered.snapshots`) so users
can see what each pass did. Around each pass it can run the invariant checks of
:mod:`replicator.pass_manager.verify` (``verify=True``), write the graph before and
after each pass into a directory (``dump_dir=`` or the environment variable
``REPLICATOR_DUMP_DIR``), and skip passes by name (``disable=``). A pass
that fails is re-raised naming it and the passes that ran before it.

Example::

    pipe = PassManager.default(disable=["check-replica-invariance"], verify=True)
    lowered = pipe.run(graph)
    print(lowered)            # the graph after each pass
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from replicator.core.graph import StepGraph
from replicator.core.layout import FoldLayout
from replicator.errors import PassError, ReplicationError
from replicator.pass_manager.contract import Pass
from replicator.pass_manager.verify import GraphInvariantError, check_defined, verify_graph

__all__ = [
    "DUMP_ENV",
    "HOOKS",
    "VALIDATE_ENV",
    "VERIFY_ENV",
    "Hooks",
    "Lowered",
    "PassManager",
    "PassSnapshot",
    "check_options",
    "unknown_options_message",
    "warn_renamed",
]

DUMP_ENV = "REPLICATOR_DUMP_DIR"
VERIFY_ENV = "REPLICATOR_VERIFY"
VALIDATE_ENV = "REPLICATOR_VALIDATE"


def flag_from_env(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass
class Hooks:
    """What the layers above the pass manager plug in when ``replicator`` is imported.

    The pass manager knows no concrete pass and runs nothing itself; these are set
    once, by the module that owns each (importing ``replicator`` imports all):

    Attributes:
      default_passes: ``(**options) -> list[Pass]``, :func:`replicator.passes.defaults.default_passes`.
      auto_pass_manager: ``(topology, *, options, **settings) -> PassManager``,
        :class:`replicator.cost.auto.AutoPassManager`.
      graph_runner: ``(graph, *, fold) -> runner`` whose ``run(graph)`` executes a
        graph on fixed inputs, :class:`replicator.tools.validate.GraphRunner`.
      compare_results: ``(before, after, graph, pass_name, *, exact)``, raising
        :class:`~replicator.errors.MiscompileError`, :func:`replicator.tools.validate.compare_results`.
    """

    default_passes: Callable[..., list[Pass]] | None = None
    auto_pass_manager: Callable[..., PassManager] | None = None
    graph_runner: Callable[..., Any] | None = None
    compare_results: Callable[..., None] | None = None

    def get(self, name: str) -> Callable[..., Any]:
        hook = getattr(self, name)
        if hook is None:  # only if a lower module is used without `import replicator`
            raise RuntimeError(f"the pass manager's '{name}' hook is not set: `import replicator` first.")
        return hook


HOOKS = Hooks()


def warn_renamed(message: str, *, stacklevel: int = 2) -> None:
    """A ``DeprecationWarning`` for an old spelling, attributed as ``warnings.warn(..., stacklevel=stacklevel)``
    from the caller would attribute it. The package itself spells every name the new way, so only users' code
    warns."""
    caller = sys._getframe(stacklevel).f_globals.get("__name__")
    # ``from package import name`` asks ``hasattr`` in importlib first, then takes the name: warn once, there.
    if caller == "importlib._bootstrap":
        return
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def unknown_options_message(where: str, unknown: Iterable[str], valid: Iterable[str]) -> str:
    """``where(): unknown option 'hierarchy'; did you mean 'hierarchical'? Valid options: ...``."""
    valid = sorted(valid)
    guesses = [(name, difflib.get_close_matches(name, valid, n=1, cutoff=0.5)) for name in unknown]
    if len(guesses) == 1:
        (name, close), *_ = guesses
        head = f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else ".")
    else:
        hints = (f"{n!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for n, c in guesses)
        head = f"unknown options {', '.join(hints)}."
    return f"{where}(): {head} Valid options: {', '.join(valid)}."


class RenamedAttribute:
    """A class attribute's old name: reading or setting it warns (a ``DeprecationWarning`` naming the new one,
    attributed to the user's line) and reads or sets the attribute ``new``.

    >>> import warnings
    >>> class Box:
    ...     old = RenamedAttribute("new", "Box.old is now Box.new.")
    >>> box = Box()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     box.old = 3
    ...     seen = box.old
    >>> (box.new, seen, [str(w.message) for w in caught])
    (3, 3, ['Box.old is now Box.new.', 'Box.old is now Box.new.'])
    """

    def __init__(self, new: str, message: str) -> None:
        self.new, self.message = new, message

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warn_renamed(self.message)
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        warn_renamed(self.message)
        setattr(obj, self.new, value)


def take_renamed(where: str, kwargs: dict[str, Any], renamed: Mapping[str, str]) -> None:
    """Move each old keyword of ``kwargs`` (``renamed``: old -> new) to its new name, in place, warning.

    For a wrapper called by the user's code (the ``DeprecationWarning`` points there). Both names given is a
    ``TypeError``, as Python's "got multiple values for argument" is.

    >>> kwargs = {"zero": 1, "zero_stage": 1}
    >>> take_renamed("f", kwargs, {"zero_stage": "zero"})
    Traceback (most recent call last):
    ...
    TypeError: f(): zero_stage= is the old name of zero=; give zero= only.
    """
    for old in [name for name in kwargs if name in renamed]:
        new = renamed[old]
        if new in kwargs:
            raise TypeError(f"{where}(): {old}= is the old name of {new}=; give {new}= only.")
        warn_renamed(f"{where}({old}=...) is now {where}({new}=...); {old}= will be removed.", stacklevel=3)
        kwargs[new] = kwargs.pop(old)


def check_options(
    function: Callable[..., Any] | None = None, *, renamed: Mapping[str, str] | None = None
) -> Callable[..., Any]:
    """``function``, with an unknown keyword argument raising a ``TypeError`` that lists its keyword-only options.

    Python's own error names the unknown keyword only; this one suggests the closest
    valid option and lists them all. The signature (``help()``,
    ``inspect.signature``) stays ``function``'s.

    Args:
      renamed: old keyword -> its new name (``{"zero_stage": "zero"}``): the old one still
        works, with a ``DeprecationWarning`` naming the new one; giving both is a ``TypeError`` (as Python's
        "got multiple values for argument" is).
        Use as ``@check_options(renamed={...})``.
    """
    if function is None:
        return functools.partial(check_options, renamed=renamed)
    renamed = dict(renamed or {})
    parameters = inspect.signature(function).parameters.values()
    valid = frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)
    where = function.__qualname__

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        take_renamed(where, kwargs, renamed)
        unknown = [name for name in kwargs if name not in valid]
        if unknown:
            raise TypeError(unknown_options_message(where, unknown, valid))
        return function(*args, **kwargs)

    return checked


#: Old pass names that still work (with a ``DeprecationWarning``) in ``disable=`` and ``Lowered.after``.
RENAMED_PASSES: dict[str, str] = {"fuse-allreduce": "fuse-collectives"}


def current_pass_name(name: str) -> str:
    """``name``, or the new name of a renamed pass (with a ``DeprecationWarning``)."""
    if name in RENAMED_PASSES:
        new = RENAMED_PASSES[name]
        warnings.warn(f"the pass '{name}' is now named '{new}'; use the new name.", DeprecationWarning, stacklevel=3)
        return new
    return name


@dataclasses.dataclass(frozen=True)
class PassSnapshot:
    """The graph after one pass (``name='traced'`` for the input), as :attr:`Lowered.snapshots` keeps it.

    Formerly ``Stage`` (a stage is a pipeline stage only); the old name still works, with a
    ``DeprecationWarning``. Not :class:`~replicator.pass_manager.contract.PassResult`, what a pass returns.
    """

    name: str
    graph: StepGraph
    changed: bool
    #: The pass that produced the graph, with its options (``None`` for ``'traced'``).
    by: Pass | None = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        flag = "changed" if self.changed else "unchanged"
        return (
            f"=== after {self.name} ({flag}) ===\n{self.graph.jaxpr}"
            if self.name != "traced"
            else (f"=== traced (per replica, with placeholders) ===\n{self.graph.jaxpr}")
        )


@dataclasses.dataclass(frozen=True)
class Lowered:
    """The graph of a step after each pass of the pass manager (:attr:`snapshots`); ``str()`` prints them all."""

    #: The traced graph, then the graph after each pass that ran, in order.
    snapshots: tuple[PassSnapshot, ...]
    #: What the pass manager wants a reader to know (``auto=True``: the options it chose and why).
    notes: tuple[str, ...] = ()
    #: Compiles the final graph on its devices and returns its per-device memory; set by
    #: ``Replicator.lower``, which knows the devices (the pass manager runs nothing).
    memory_fn: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def memory(self) -> Any:
        """Per-device bytes of the compiled step (a :class:`~replicator.runtime.memory.MemoryUsage`).

        Compiles the step with XLA (as its first run would) and reads XLA's compiled
        memory analysis: ``arguments``, ``outputs``, ``aliased``, ``temporaries`` and ``peak``.
        """
        if self.memory_fn is None:
            raise ValueError(
                "Lowered.memory(): this Lowered does not know its devices; use the one "
                "Replicator.lower(step_fn, batch, state) returns."
            )
        return self.memory_fn()

    #: Deprecated: :attr:`snapshots` (a stage is a pipeline stage only).
    stages = RenamedAttribute("snapshots", "Lowered.stages is now Lowered.snapshots: a stage is a pipeline stage only.")

    @property
    def traced(self) -> StepGraph:
        """The per-replica graph with placeholders, before any pass."""
        return self.snapshots[0].graph

    @property
    def final(self) -> StepGraph:
        """The graph that runs: every placeholder lowered."""
        return self.snapshots[-1].graph

    def after(self, pass_name: str) -> StepGraph:
        """The graph right after the pass named ``pass_name``."""
        pass_name = current_pass_name(pass_name)
        for snapshot in self.snapshots:
            if snapshot.name == pass_name:
                return snapshot.graph
        raise KeyError(f"no pass named {pass_name!r} ran; ran: {[s.name for s in self.snapshots[1:]]}")

    def __str__(self) -> str:
        return "\n\n".join(str(s) for s in self.snapshots)


class PassManager:
    """An ordered list of passes, itself usable like one pass.

    Args:
      passes: the passes in order (default: :func:`replicator.passes.defaults.default_passes`).
      disable: names of passes to skip; required passes cannot be skipped.
      verify: run the invariant checks before the first and after every pass
        (default: the ``REPLICATOR_VERIFY`` environment variable; the test
        suite sets it). Off otherwise: the type-check costs about as much as
        tracing and all passes together (:mod:`replicator.pass_manager.verify`).
        Without it, every pass is still checked not to read an undefined
        variable. A broken graph raises
        :class:`~replicator.pass_manager.verify.GraphInvariantError` naming the pass.
      validate: translation validation (:mod:`replicator.tools.validate`):
        execute the graph before and after every pass on random inputs and
        raise :class:`~replicator.errors.MiscompileError` if a result changed
        (default: the ``REPLICATOR_VALIDATE`` environment variable).
      dump_dir: write ``NN-<pass>.before.txt``/``.after.txt`` here (default: the
        ``REPLICATOR_DUMP_DIR`` environment variable, if set).
    """

    def __init__(
        self,
        passes: Sequence[Pass] | None = None,
        *,
        disable: Iterable[str] = (),
        verify: bool | None = None,
        validate: bool | None = None,
        dump_dir: str | os.PathLike | None = None,
    ):
        self.passes = list(HOOKS.get("default_passes")() if passes is None else passes)
        for p in self.passes:
            if not isinstance(p, Pass):
                raise TypeError(f"PassManager: {p!r} is not a replicator.passes.Pass instance.")
        names = [p.name for p in self.passes]
        self.disabled = frozenset(current_pass_name(name) for name in disable)
        unknown = self.disabled - set(names)
        if unknown:
            raise ValueError(f"PassManager(disable=...): no pass named {sorted(unknown)}; the passes are {names}.")
        _check_order(self.passes)
        required = [p.name for p in self.passes if p.required and p.name in self.disabled]
        if required:
            raise ValueError(f"PassManager: pass {required} is required for the step to run and cannot be disabled.")
        self.verify = flag_from_env(VERIFY_ENV) if verify is None else bool(verify)
        self.validate = flag_from_env(VALIDATE_ENV) if validate is None else bool(validate)
        self.dump_dir = dump_dir if dump_dir is not None else os.environ.get(DUMP_ENV) or None

    @classmethod
    @check_options(renamed={"zero_stage": "zero"})
    def default(
        cls,
        *,
        zero: int = 0,
        shard_optimizer: bool = False,
        shard_optimizer_min_bytes: int = 64 * 2**10,
        hierarchical: bool = False,
        compress: bool = False,
        all_reduce_algorithm: str = "native",
        fuse_threshold_bytes: int = 64 * 2**20,
        fuse_max_tensor_bytes: int | None = 64 * 2**10,
        auto: bool = False,
        topology: Any = "cpu-emulated",
        disable: Iterable[str] = (),
        verify: bool | None = None,
        validate: bool | None = None,
        dump_dir: str | os.PathLike | None = None,
    ) -> PassManager:
        """The default passes (:func:`~replicator.passes.defaults.default_passes`) with their options.

        Args:
          zero: the ZeRO level (``shard-optimizer-update``): 0 off; 1/N per device: 1 optimizer state, 2 and
            gradients, 3 and parameters. ``zero_stage=`` is its old name (a ``DeprecationWarning``).
          shard_optimizer: ``True`` is ``zero=1`` (the older spelling).
          shard_optimizer_min_bytes: with ZeRO, smaller gradients and state leaves stay whole (``explain`` counts them).
          hierarchical: ``hierarchical-allreduce``: all-reduces in steps over ``'cores'``, then ``'workers'``.
          compress: ``compress-communication``: float32 all-reduce payloads sent as bfloat16.
          all_reduce_algorithm: ``'native'`` (XLA's), ``'ring'`` or ``'reduce_broadcast'`` (a tree).
          fuse_threshold_bytes: ``fuse-collectives``: the largest bucket of fused all-reduces.
          fuse_max_tensor_bytes: ``fuse-collectives``: larger tensors are not fused (``None``: all are).
          auto: choose ``all_reduce_algorithm``, ``hierarchical``, fusion and ZeRO-1 per step with the cost model.
          topology: with ``auto``: a preset name or a calibrated :class:`~replicator.cost.topology.Topology`.
          disable: names of passes to skip (as for :class:`PassManager`).
          verify: check the graph invariants around every pass (as for :class:`PassManager`).
          validate: translation validation around every pass (as for :class:`PassManager`).
          dump_dir: write the graph before and after every pass here (as for :class:`PassManager`).

        With ``auto=True`` (:class:`~replicator.cost.auto.AutoPassManager`), the options it
        chooses must keep their defaults; the others are fixed as given.

        Raises:
          TypeError: an unknown option; the message names the closest and lists them all.
          TypeError: both ``zero=`` and its old name ``zero_stage=``.
          ValueError: an option out of range (``zero=4``), or one that ``auto`` chooses.
        """
        options = dict(
            zero=zero,
            shard_optimizer=shard_optimizer,
            shard_optimizer_min_bytes=shard_optimizer_min_bytes,
            hierarchical=hierarchical,
            compress=compress,
            all_reduce_algorithm=all_reduce_algorithm,
            fuse_threshold_bytes=fuse_threshold_bytes,
            fuse_max_tensor_bytes=fuse_max_tensor_bytes,
        )
        settings = dict(disable=disable, verify=verify, validate=validate, dump_dir=dump_dir)
        default_passes = HOOKS.get("default_passes")
        if auto:
            defaults = {name: p.default for name, p in inspect.signature(default_passes).parameters.items()}
            fixed = {name: value for name, value in options.items() if value != defaults[name]}
            return HOOKS.get("auto_pass_manager")(topology, options=fixed, **settings)
        return cls(default_passes(**options), **settings)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def key(self) -> tuple:
        """Hashable identity of the configuration (for compile caches)."""
        return (tuple(repr(p) for p in self.passes), self.disabled, self.verify, self.validate)

    def __repr__(self) -> str:
        active = [p.name for p in self.passes if p.name not in self.disabled]
        return f"PassManager({active})"

    def run(self, graph: StepGraph, *, fold: FoldLayout | None = None) -> Lowered:
        """Every pass in order on ``graph``; ``fold``: how replicas sit on devices (for ``validate``)."""
        snapshots = [PassSnapshot("traced", graph, False)]
        notes: list[str] = []
        ran: list[str] = []
        lowered = False  # a pass that lowers the placeholders ran
        # Once a pass has lowered precision on purpose (bf16 on the wire), a later pass that reorders that
        # arithmetic (a ring instead of the native all-reduce) moves results by bf16 rounding too: from then
        # on every comparison allows the reduced-precision difference.
        exact = True
        runner = HOOKS.get("graph_runner")(graph, fold=fold) if self.validate else None
        results = runner.run(graph) if runner else None
        if self.verify:
            try:
                verify_graph(graph, lowered=False)
            except GraphInvariantError as e:
                raise GraphInvariantError(f"the traced step graph (before any pass) is broken: {e}") from e
        for index, p in enumerate(self.passes):
            if p.name in self.disabled:
                continue
            self._dump(index, p.name, "before", graph)
            try:
                result = p.run(graph)
                if result.graph is not graph:  # an unchanged graph was checked already
                    check_defined(result.graph)
                    if self.verify:
                        verify_graph(result.graph, lowered=p.lowers or lowered)
            except GraphInvariantError as e:
                raise GraphInvariantError(
                    f"pass '{p.name}' (after {ran or 'no other pass'}) produced a broken graph: {e}\n"
                    f"This is a bug in the pass. Disable it with PassManager(disable=['{p.name}']) and please "
                    f"report the step with the graphs around the pass (REPLICATOR_DUMP_DIR=dir)."
                ) from e
            except ReplicationError as e:
                e.add_note(f"(raised by pass '{p.name}' after {ran or 'no other pass'})")
                raise
            except Exception as e:
                raise PassError(
                    f"pass '{p.name}' failed after passes {ran or '[]'}: {type(e).__name__}: {e}\n"
                    f"Disable it with Replicator(..., passes=PassManager(disable=['{p.name}'])) and "
                    f"please report the failing step."
                ) from e
            if runner is not None and result.graph is not graph:  # even if it says unchanged
                new_results = runner.run(result.graph)
                exact = exact and p.exact
                HOOKS.get("compare_results")(results, new_results, graph, p.name, exact=exact)
                results = new_results
            graph = result.graph
            notes.extend(result.notes)
            ran.append(p.name)
            lowered = lowered or p.lowers
            snapshots.append(PassSnapshot(p.name, graph, result.changed, by=p))
            self._dump(index, p.name, "after", graph)
        return Lowered(tuple(snapshots), tuple(notes))

    def _dump(self, index: int, name: str, when: str, graph: StepGraph) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        safe = re.sub(r"[^a-z0-9-]", "_", name)
        with open(os.path.join(self.dump_dir, f"{index:02d}-{safe}.{when}.txt"), "w") as f:
            f.write(str(graph.jaxpr))


def _check_order(passes: Sequence[Pass]) -> None:
    """Raise ``ValueError`` naming both passes if the order breaks a declared constraint."""
    lowering: Pass | None = None
    for index, p in enumerate(passes):
        library = [q.name for q in passes[:index] if type(q).__module__.startswith("replicator.passes")]
        if p.first and library:
            raise ValueError(
                f"PassManager: pass '{p.name}' must come before the library's passes (they expect what it produces), "
                f"but comes after '{library[0]}'. Move '{p.name}' to the front."
            )
        if p.needs_placeholders and lowering is not None:
            raise ValueError(
                f"PassManager: pass '{p.name}' works on placeholders but comes after '{lowering.name}', which "
                f"replaces them, so it would do nothing. Put '{p.name}' before '{lowering.name}'."
            )
        later = [q.name for q in passes[index + 1 :] if q.name in p.run_after]
        if later:
            raise ValueError(
                f"PassManager: pass '{p.name}' must run after '{later[0]}' (it rewrites what '{later[0]}' "
                f"produces), but comes before it. Move '{later[0]}' before '{p.name}'."
            )
        if p.lowers:
            lowering = p
    return None


def __getattr__(name: str) -> Any:
    if name == "Stage":  # renamed: a stage is a pipeline stage only
        warn_renamed(
            f"{__name__}.Stage is now {__name__}.PassSnapshot (Lowered.snapshots): a stage is a pipeline stage only."
        )
        return PassSnapshot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
