"""Mutation testing of the critical modules: a seeded sample of mutants, each against its own tests.

A mutant is a copy of one module with one small change made by one of cosmic-ray's
operators (``+`` -> ``-``, ``<`` -> ``<=``, ``True`` -> ``False``, a number +-1, an
``except`` clause that no longer matches, a ``for`` loop over nothing, a decorator
removed, ...). The tests *kill* a mutant when they fail on it; a mutant that
*survives* is a change no test notices: a missing test, or an *equivalent* mutant (a
change that cannot alter behaviour), which is then listed, with the reason, in
``scripts/mutation/equivalent.toml``.

Usage::

    python scripts/mutate.py --list                           # the sample, without running it
    nice -n 10 python scripts/mutate.py --sample 300 --seed 0 --jobs 2
    python scripts/mutate.py --sample 12 --modules passes/,analysis/
    python scripts/mutate.py --sample 300 --only replicator/passes/fold.py:120   # a survivor again
    python scripts/mutate.py --sample 300 --baseline-only     # how long each module's tests take

What it does:

1. Lists every mutant cosmic-ray's operators can make in the modules of
   ``GROUPS`` (not in type annotations), and groups them by *site* (file and
   position), so that the eleven replacements of one ``+`` count as one place.
2. Deals ``--sample N`` round-robin over the module groups (evenly; a group
   with fewer sites than its share gives the rest to the others). Per group, its
   sites are shuffled with ``--seed`` (a generator of its own per group, so a
   group's sample does not depend on the others') and one mutation is drawn per
   site; a mutant that does not compile or changes nothing is skipped for the
   next site. Same source, same seed: same sample, and a smaller ``N`` gives a
   prefix of each group's larger sample.
3. Copies the working tree (``git ls-files``: tracked and untracked files that
   are not ignored), or commit ``--rev`` (``git archive``), to one temporary
   directory per job, and runs the tests of
   each module (``TESTS``) there once unmutated (the baseline: they must pass,
   and ``replicator`` must be imported from the copy, which a pytest plugin
   checks), then each mutant: the copy's module is rewritten, ``pytest -x``
   runs the module's tests (``-m 'not slow'``) with ``PYTHONPATH`` set to the
   copy, and the module is restored. The checkout itself is never written to. A
   sampled mutant listed as equivalent is not run.
4. A mutant is *killed* when pytest fails (or cannot import the module), *timeout*
   when the tests run past ``--timeout-factor`` x the baseline (at least
   ``--min-timeout`` seconds): a hang counts as killed. Score per group:
   ``(killed + timeout) / (sampled - equivalent)``; the targets are in
   ``TARGETS``.
5. Prints each mutant's outcome as it comes (with the test that killed it), a
   table per group and per module, then every surviving mutant with
   its ``file:line``, its diff and an entry to paste into the equivalents file
   if it is one. ``--json PATH`` writes every result.

Exit status: 0 when every group meets its target, 1 when one does not, 2 when the
run could not be made (the baseline failed, a module has no tests in ``TESTS``), 130
when stopped by Ctrl-C (after killing the tests under way; the tables count what ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import io
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
import warnings
from collections.abc import Iterator, Sequence

try:
    import parso.python.tree
    import parso.tree
    from cosmic_ray import plugins
    from cosmic_ray.ast import ast_nodes, get_ast
    from cosmic_ray.mutating import mutate_code
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"{e}: install the mutation extra first: pip install -e '.[mutation]' (cosmic-ray)") from e

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EQUIVALENT_FILE = os.path.join("scripts", "mutation", "equivalent.toml")

# The module groups, each with the files it mutates (paths relative to the root).
GROUPS: dict[str, tuple[str, ...]] = {
    "passes/": ("replicator/passes/",),
    "analysis/": ("replicator/analysis/",),
    "pass_manager/verify.py": ("replicator/pass_manager/verify.py",),
    "runtime/": (
        "replicator/runtime/execution.py",
        "replicator/runtime/state.py",
        "replicator/runtime/inputs.py",
        "replicator/runtime/steady.py",
        "replicator/runtime/consistency.py",
    ),
    "training/checkpoint/": ("replicator/training/checkpoint/",),
    "launch/": ("replicator/launch/",),
    "stages/": (
        "replicator/stages/packing.py",
        "replicator/stages/lower.py",
        "replicator/stages/rows.py",
        "replicator/stages/programs.py",
        "replicator/stages/chunks.py",
        "replicator/stages/stack_update.py",
        "replicator/stages/schedule.py",
        "replicator/stages/train.py",
        "replicator/stages/data_replicas.py",
    ),
    "tensor/": ("replicator/tensor/",),
}

# Least score per group (killed and timed out, of the sampled mutants that are not equivalent).
TARGETS: dict[str, float] = {"passes/": 0.95, "analysis/": 0.95}
DEFAULT_TARGET = 0.90

# The tests that cover each module: an exact file, else the longest folder prefix. The module's own
# test file first (with -x, a killed mutant stops at its first failure), then the wider ones that
# exercise it; glob patterns (relative to the root) take in new test files named after the module.
TESTS: dict[str, tuple[str, ...]] = {
    "replicator/passes/__init__.py": ("tests/passes/test_pass_manager.py",),
    "replicator/passes/capture.py": ("tests/passes/test_capture.py", "tests/passes/test_pass_manager.py"),
    "replicator/passes/check_invariance.py": (
        "tests/passes/test_invariance.py",
        "tests/passes/test_capture.py",
        "tests/test_bad_input.py",
        "tests/test_per_replica_state.py",
    ),
    "replicator/passes/compress.py": ("tests/passes/test_compress.py",),
    "replicator/passes/defaults.py": ("tests/passes/test_pass_manager.py", "tests/passes/test_auto.py"),
    "replicator/passes/fold.py": ("tests/passes/test_fold.py",),
    "replicator/passes/fuse_collectives.py": ("tests/passes/test_fuse_collectives.py", "tests/passes/test_buffers.py"),
    "replicator/passes/hierarchical.py": ("tests/passes/test_hierarchical.py",),
    "replicator/passes/lower_collectives.py": (
        "tests/passes/test_lower_collectives.py",
        "tests/passes/test_algorithms.py",
    ),
    "replicator/passes/shard_optimizer.py": (
        "tests/passes/test_shard_optimizer.py",
        "tests/passes/test_zero_stages.py",
        "tests/passes/test_zero_where.py",
    ),
    "replicator/passes/share_slice_kernels.py": ("tests/passes/test_share_slice_kernels.py",),
    "replicator/passes/simplify.py": ("tests/passes/test_simplify.py",),
    "replicator/analysis/": (
        "tests/passes/test_invariance.py",
        "tests/passes/test_soundness.py",
        "tests/test_bad_input.py",
    ),
    "replicator/tensor/": (
        "tests/tensor/test_rules.py",
        "tests/tensor/test_parallelize.py",
        "tests/tensor/test_plan.py",
        "tests/tensor/test_replicator.py",
        "tests/tensor/test_sequence.py",
        "tests/tensor/test_overlap.py",
        "tests/tensor/test_cotangent_sums.py",
    ),
    "replicator/tensor/auto.py": ("tests/tensor/test_auto.py",),  # plan="auto": its own tests
    "replicator/analysis/records.py": (
        "tests/passes/test_records.py",
        "tests/passes/test_buffers.py",
        "tests/test_report.py",
    ),
    # Every test runs the verifier (REPLICATOR_VERIFY=1 in conftest.py): a mutant that makes it
    # raise fails them all; one that lets a broken graph through fails only the tests that build one.
    "replicator/pass_manager/verify.py": (
        "tests/passes/test_verify_graph.py",
        "tests/passes/test_validate.py",
        "tests/passes/test_pass_manager.py",
        "tests/passes/test_soundness.py",
        "tests/test_bad_input.py",
    ),
    "replicator/runtime/execution.py": (
        "tests/test_run.py",
        "tests/test_bad_input.py",
        "tests/passes/test_fold.py",
        "tests/test_per_replica_state.py",
        "tests/test_porting_inputs.py",
        "tests/test_state.py",
        "tests/passes/test_zero_stages.py",
        "tests/test_execution*.py",
        "tests/passes/test_share_slice_kernels.py",
        "tests/test_distributed.py",
    ),
    "replicator/runtime/state.py": (
        "tests/test_state.py",
        "tests/test_state_*.py",
        "tests/test_per_replica_state.py",
        "tests/test_optim.py",
        "tests/test_run.py",
        "tests/test_divergence.py",
    ),
    "replicator/runtime/inputs.py": (
        "tests/test_run.py",
        "tests/test_bad_input.py",
        "tests/test_prefetch.py",
        "tests/test_inputs*.py",
        "tests/test_porting_inputs.py",
        "tests/test_loop.py",
        "tests/test_host_path.py",
    ),
    "replicator/runtime/consistency.py": ("tests/test_consistency.py",),
    "replicator/runtime/steady.py": (
        "tests/test_host_path.py",
        "tests/test_run.py",
        "tests/test_prefetch.py",
        "tests/test_inputs*.py",
    ),
    "replicator/training/checkpoint/": ("tests/test_checkpoint.py", "tests/test_checkpoint_*.py"),
    "replicator/launch/": (
        "tests/test_launch.py",
        "tests/test_launch_*.py",
        "tests/test_watchdog.py",
        "tests/test_restarts.py",
        "tests/test_faults.py",
        "tests/test_rendezvous.py",
        "tests/test_membership.py",
    ),
}
TESTS.update(
    {
        "replicator/stages/packing.py": (
            "tests/stages/test_packing.py",
            "tests/stages/test_tick_costs.py",
            "tests/stages/test_train.py",
            "tests/stages/test_zero.py",  # the slots padded to a multiple of D
        ),
        "replicator/stages/chunks.py": (
            "tests/stages/test_user_step_zero.py",
            "tests/stages/test_fold_stages.py",  # ZeRO with several replicas per device
            "tests/stages/test_stack_update.py",  # the slices of a stack beside the chunks
        ),
        "replicator/stages/stack_update.py": ("tests/stages/test_stack_update.py",),
        "replicator/stages/train.py": (
            "tests/stages/test_train.py",
            "tests/stages/test_zero.py",
            "tests/stages/test_stack_slices.py",
        ),
        "replicator/stages/data_replicas.py": (
            "tests/stages/test_train.py",
            "tests/stages/test_fold_stages.py",
            "tests/stages/test_replicas.py",
            "tests/stages/test_zero.py",
        ),
        "replicator/stages/schedule.py": ("tests/stages/test_schedule.py", "tests/stages/test_lower.py"),
        "replicator/stages/programs.py": (
            "tests/stages/test_lower.py",
            "tests/stages/test_fold_stages.py",  # the user's collectives over the fold axes
            "tests/stages/test_replicas.py",
            "tests/stages/test_user_step.py",
        ),
        "replicator/stages/lower.py": (
            "tests/stages/test_lower.py",
            "tests/stages/test_tick_costs.py",
            "tests/stages/test_train.py",
            "tests/stages/test_replicas.py",
        ),
        "replicator/stages/rows.py": (
            "tests/stages/test_stack_slices.py",
            "tests/stages/test_train.py",
            "tests/stages/test_checkpoints.py",
            "tests/test_distributed.py",  # rows across processes
        ),
    }
)
PYTEST_ARGS = ("-x", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-p", "_mutation_probe")

# Operators that take arguments (which variable to replace) and pick values at random.
SKIPPED_OPERATORS = ("core/VariableReplacer", "core/VariableInserter")

# Loaded by pytest in the copy (-p _mutation_probe): the run fails unless replicator came from the copy.
PROBE = """\
import os
import sys

import pytest


def pytest_collection_finish(session):
    module = sys.modules.get("replicator")
    copy = os.environ["REPLICATOR_MUTATION_COPY"]
    if module is None or not os.path.realpath(module.__file__).startswith(copy + os.sep):
        where = module and module.__file__
        raise pytest.UsageError(f"replicator was imported from {where}, not from the mutated copy {copy}")
"""
# The process groups of the pytest runs under way (killed on Ctrl-C), and the flag that stops the workers.
_RUNNING: set[int] = set()
_STOP = threading.Event()

EXCEPTION_NAME = "CosmicRayTestingException"
# ExceptionReplacer writes ``except CosmicRayTestingException:``; defined at the end of the module (the
# line numbers do not move), the clause is one that never matches instead of a NameError when evaluated.
EXCEPTION_CLASS = f"\n\nclass {EXCEPTION_NAME}(Exception):\n    pass\n"


class SetupError(RuntimeError):
    """The run cannot be made as asked: a module without tests, tests failing unmutated, a bad copy."""


@dataclasses.dataclass(frozen=True)
class Site:
    """A place a mutation can be made: a file and a node's start (line, column)."""

    path: str
    line: int
    column: int


@dataclasses.dataclass
class Mutant:
    """One sampled mutant and, once run, its outcome."""

    group: str
    path: str
    operator: str
    occurrence: int  # which of the operator's positions in the file, in cosmic-ray's walk order
    line: int
    before: str  # the changed source lines, stripped (with ``after``: how equivalents are matched)
    after: str
    diff: str
    outcome: str = "pending"  # killed, timeout, survived, equivalent
    seconds: float = 0.0
    detail: str = ""  # the failing test, or the equivalent's reason
    tests: tuple[str, ...] = ()  # the test files it runs against

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.path, self.operator, self.before, self.after)


def module_files(root: str, prefixes: Sequence[str]) -> list[str]:
    """The ``.py`` files under the given files or folders, sorted, relative to ``root``."""
    files = []
    for prefix in prefixes:
        full = os.path.join(root, prefix)
        if os.path.isfile(full):
            files.append(prefix)
            continue
        for dirpath, _, names in os.walk(full):
            files += [os.path.relpath(os.path.join(dirpath, n), root) for n in names if n.endswith(".py")]
    return sorted(set(files))


def tests_for(root: str, path: str) -> tuple[str, ...]:
    """The test files under ``root`` that cover ``path``: its ``TESTS`` entry (the file's, else its longest
    folder prefix's), glob patterns expanded, in order."""
    folders = [k for k in TESTS if k.endswith("/") and path.startswith(k)]
    if path not in TESTS and not folders:
        raise SetupError(f"no tests mapped to {path}; add it (or its folder) to TESTS in {__file__}")
    patterns = TESTS[path] if path in TESTS else TESTS[max(folders, key=len)]
    found = [os.path.relpath(f, root) for pattern in patterns for f in sorted(glob.glob(os.path.join(root, pattern)))]
    if not found:
        raise SetupError(f"none of the tests mapped to {path} exists: {', '.join(patterns)} (TESTS in {__file__})")
    return tuple(dict.fromkeys(found))


def _in_annotation(node: parso.tree.NodeOrLeaf) -> bool:
    """Whether ``node`` is part of a type annotation (a parameter's, a return's or a variable's)."""
    child, parent = node, node.parent
    while parent is not None:
        if isinstance(parent, parso.python.tree.Function) and parent.annotation is child:  # -> ...
            return True
        if parent.type == "tfpdef" and parent.children[2:3] == [child]:  # name: ...
            return True
        if parent.type == "annassign" and parent.children[1:2] == [child]:  # x: ... = value
            return True
        child, parent = parent, parent.parent
    return False


def operators() -> list[tuple[str, object]]:
    """cosmic-ray's operators (name, instance), without those that need arguments."""
    return [(n, plugins.get_operator(n)()) for n in sorted(plugins.operator_names()) if n not in SKIPPED_OPERATORS]


def sites_of(root: str, path: str, ops: list[tuple[str, object]]) -> dict[Site, list[tuple[str, int]]]:
    """Every mutation of ``path`` by ``ops``, by site: (operator name, occurrence) in walk order.

    Occurrences are counted over the whole file in the order of cosmic-ray's
    ``MutationVisitor`` (pre-order, one count per position), so that
    ``mutate_code(source, operator, occurrence)`` makes exactly that mutation.
    Positions inside type annotations are counted but not listed.
    """
    with open(os.path.join(root, path), encoding="utf-8") as f:
        nodes = list(ast_nodes(get_ast(f.read())))
    sites: dict[Site, list[tuple[str, int]]] = {}
    for name, op in ops:
        occurrence = 0
        for node in nodes:
            for _ in op.mutation_positions(node):
                if not _in_annotation(node):
                    line, column = node.start_pos
                    sites.setdefault(Site(path, line, column), []).append((name, occurrence))
                occurrence += 1
    return sites


def _changed_lines(path: str, source: str, mutated: str) -> tuple[int, str, str, str]:
    """(first changed line, removed lines, added lines, unified diff) between two sources."""
    a, b = source.splitlines(), mutated.splitlines()
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    first, removed, added = 0, [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            # the first changed line that is not blank (a removed decorator takes the blank lines above it)
            first = first or next((i + 1 for i in range(i1, i2) if a[i].strip()), i1 + 1)
            removed += [s.strip() for s in a[i1:i2] if s.strip()]
            added += [s.strip() for s in b[j1:j2] if s.strip()]
    diff = "\n".join(difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", lineterm="", n=1))
    return first, " / ".join(removed), " / ".join(added), diff


def make_mutant(group: str, path: str, source: str, operator: str, occurrence: int) -> tuple[Mutant, str] | None:
    """The mutant and its mutated source, or None when it changes nothing or does not compile."""
    mutated = mutate_code(source, plugins.get_operator(operator)(), occurrence)
    if mutated is None or mutated == source:
        return None
    try:
        with warnings.catch_warnings():  # e.g. "is" with a literal: still a mutant
            warnings.simplefilter("ignore")
            compile(mutated, path, "exec")
    except (SyntaxError, ValueError):
        return None
    line, before, after, diff = _changed_lines(path, source, mutated)
    if EXCEPTION_NAME in mutated and EXCEPTION_NAME not in source:
        mutated += EXCEPTION_CLASS
    return Mutant(group, path, operator, occurrence, line, before, after, diff), mutated


def _group_mutants(
    root: str, group: str, files: list[str], seed: int, sites: dict[Site, list[tuple[str, int]]]
) -> Iterator[tuple[Mutant, str]]:
    """The group's mutants in its sample order: sites shuffled by ``seed``, one mutation drawn per site."""
    rng = random.Random(f"{seed}:{group}")  # the group's own generator: its sample ignores the other groups
    order = sorted(sites, key=lambda s: (s.path, s.line, s.column))
    rng.shuffle(order)
    texts = {}
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            texts[path] = f.read()
    for site in order:
        operator, occurrence = rng.choice(sorted(sites[site]))
        made = make_mutant(group, site.path, texts[site.path], operator, occurrence)
        if made is not None:  # else it changes nothing or does not compile: the next site instead
            yield made


def sample(
    root: str, groups: dict[str, list[str]], n: int, seed: int, equivalents: dict[tuple[str, str, str, str], str]
) -> tuple[list[Mutant], dict[tuple[str, str, int], str], dict[str, tuple[int, int]]]:
    """``n`` mutants dealt round-robin over ``groups`` (evenly, the first groups taking the remainder;
    a group with fewer sites gives its share to the others), reproducibly.

    Returns the mutants, their mutated sources by (path, operator, occurrence), and
    per group (sites, mutants) in all, for the report.
    """
    ops = operators()
    sizes: dict[str, tuple[int, int]] = {}
    streams = {}
    for group, files in groups.items():
        sites: dict[Site, list[tuple[str, int]]] = {}
        for path in files:
            sites.update(sites_of(root, path, ops))
        sizes[group] = (len(sites), sum(len(v) for v in sites.values()))
        streams[group] = _group_mutants(root, group, files, seed, sites)
    taken: dict[str, list[tuple[Mutant, str]]] = {g: [] for g in groups}
    while streams and sum(map(len, taken.values())) < n:
        for group in list(streams):
            if sum(map(len, taken.values())) == n:
                break
            made = next(streams[group], None)
            if made is None:
                del streams[group]
            else:
                taken[group].append(made)
    chosen: list[Mutant] = []
    sources: dict[tuple[str, str, int], str] = {}
    for group in groups:
        for mutant, mutated in taken[group]:
            if mutant.key in equivalents:
                mutant.outcome, mutant.detail = "equivalent", equivalents[mutant.key]
            chosen.append(mutant)
            sources[(mutant.path, mutant.operator, mutant.occurrence)] = mutated
    return chosen, sources, sizes


def load_equivalents(path: str) -> dict[tuple[str, str, str, str], str]:
    """The listed equivalent mutants: (file, operator, before, after) -> reason."""
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    out = {}
    for i, e in enumerate(entries):
        missing = {"file", "operator", "before", "after", "reason"} - set(e)
        if missing or not e["reason"].strip():
            raise SetupError(f"{path}: entry {i + 1} lacks {sorted(missing) or ['a reason']}")
        out[(e["file"], e["operator"], e["before"], e["after"])] = e["reason"].strip()
    return out


def working_tree_files() -> list[str]:
    """Tracked files and untracked files that git does not ignore (the tree the tests see)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]


def make_copy(rev: str | None) -> str:
    """A copy of the working tree (``rev`` None) or of commit ``rev`` in a temporary directory, with the
    pytest probe; returns its real path."""
    copy = os.path.realpath(tempfile.mkdtemp(prefix="replicator-mutation-"))
    if rev:
        tar = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
        if tar.returncode:
            shutil.rmtree(copy)
            raise SetupError(f"git archive {rev}: {tar.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
            archive.extractall(copy, filter="data")
    else:
        for p in working_tree_files():
            os.makedirs(os.path.join(copy, os.path.dirname(p)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, p), os.path.join(copy, p))
    with open(os.path.join(copy, "_mutation_probe.py"), "w") as f:
        f.write(PROBE)
    return copy


def clone(copy: str) -> str:
    """Another temporary copy of ``copy``."""
    return shutil.copytree(copy, os.path.realpath(tempfile.mkdtemp(prefix="replicator-mutation-")), dirs_exist_ok=True)


def run_tests(copy: str, tests: Sequence[str], timeout: float | None) -> tuple[str, float, str]:
    """Run ``tests`` in ``copy``: ("passed" | "failed" | "timeout", seconds, the failure's first line).

    Without a ``timeout`` (a baseline) a failure comes with the end of pytest's output instead.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([copy, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc of a mutant can outlive it
    env["REPLICATOR_MUTATION_COPY"] = copy
    basetemp = os.path.join(copy, ".pytest-tmp")
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, f"--basetemp={basetemp}", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
    )
    _RUNNING.add(proc.pid)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the tests' own worker processes too
        proc.communicate()
        return "timeout", time.monotonic() - start, ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _RUNNING.discard(proc.pid)
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "passed", seconds, ""
    # A usage error from the probe (replicator not imported from the copy), or no tests collected, or any
    # exit 4/5 of an unmutated baseline: the set-up is wrong. A mutant that breaks the import of replicator
    # itself (conftest then fails: exit 4) is killed, as any other failure.
    probe_failed = "not from the mutated copy" in output
    if probe_failed or proc.returncode == 5 or (proc.returncode == 4 and timeout is None):
        raise SetupError(f"pytest exited {proc.returncode} in {copy}:\n{output[-3000:]}")
    lines = [s for s in output.splitlines() if s.startswith(("FAILED", "ERROR"))]
    if proc.returncode and timeout is None:  # a baseline: the whole story
        return "failed", seconds, output[-4000:]
    return "failed", seconds, lines[0] if lines else f"pytest exit status {proc.returncode}"


def run_all(
    mutants: list[Mutant], sources: dict[tuple[str, str, int], str], copies: list[str], args: argparse.Namespace
) -> dict[tuple[str, ...], float]:
    """The baselines, then every pending mutant, on one thread per copy; returns the baseline seconds."""
    lock = threading.Lock()
    test_sets = sorted({m.tests for m in mutants if m.outcome == "pending"})
    baselines: dict[tuple[str, ...], float] = {}
    failures: list[str] = []
    errors: list[Exception] = []

    def work(copy: str, tasks: queue.Queue) -> None:
        try:
            work_on(copy, tasks)
        except Exception as e:  # handed to the main thread, which raises it
            errors.append(e)
            _STOP.set()

    def work_on(copy: str, tasks: queue.Queue) -> None:
        while not _STOP.is_set():
            try:
                item = tasks.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):  # a baseline
                status, seconds, detail = run_tests(copy, item, None)
                if _STOP.is_set():
                    return
                with lock:
                    baselines[item] = seconds
                    print(f"baseline {status:8s} {seconds:6.1f} s  {' '.join(item)}", flush=True)
                    if status != "passed":
                        failures.append(f"{' '.join(item)}: {detail}")
                continue
            m: Mutant = item
            target = os.path.join(copy, m.path)
            with open(target, encoding="utf-8") as f:
                original = f.read()
            timeout = args.timeout or max(args.min_timeout, args.timeout_factor * baselines[m.tests])
            try:
                with open(target, "w", encoding="utf-8") as f:
                    f.write(sources[(m.path, m.operator, m.occurrence)])
                status, m.seconds, m.detail = run_tests(copy, m.tests, timeout)
            finally:
                with open(target, "w", encoding="utf-8") as f:
                    f.write(original)
            if _STOP.is_set():  # interrupted: its run was killed, not by the tests
                return
            m.outcome = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[status]
            with lock:
                done = sum(x.outcome != "pending" for x in mutants)
                print(
                    f"[{done}/{len(mutants)}] {m.outcome:8s} {m.seconds:6.1f} s  {m.path}:{m.line} {m.operator}"
                    + (f"  ({m.detail.removeprefix('FAILED ').removeprefix('ERROR ')})" if m.detail else ""),
                    flush=True,
                )

    def drain(items: list) -> None:
        tasks: queue.Queue = queue.Queue()
        for item in items:
            tasks.put(item)
        threads = [threading.Thread(target=work, args=(c, tasks), daemon=True) for c in copies]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except KeyboardInterrupt:
            _STOP.set()
            for pid in list(_RUNNING):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for t in threads:
                t.join()
            raise
        if errors:
            raise errors[0]

    if not args.timeout or args.baseline_only:
        drain(test_sets)
        if failures:
            raise SetupError(
                "the tests fail without any mutant (fix the tree or the TESTS mapping first):\n  "
                + "\n  ".join(failures)
            )
    if not args.baseline_only:
        drain([m for m in mutants if m.outcome == "pending"])
    return baselines


def score(ms: list[Mutant]) -> tuple[dict[str, int], float | None]:
    """Counts by outcome and the score (killed + timeout) / (sampled - equivalent)."""
    counts = {k: sum(m.outcome == k for m in ms) for k in ("killed", "timeout", "survived", "equivalent")}
    counted = len(ms) - counts["equivalent"]
    return counts, (counts["killed"] + counts["timeout"]) / counted if counted else None


def report(mutants: list[Mutant], groups: dict[str, list[str]], sizes: dict[str, tuple[int, int]]) -> bool:
    """Print the tables and the survivors; returns whether every group meets its target."""
    met = True
    header = f"{'group':22s} {'sites':>6s} {'mutants':>7s} {'sampled':>7s} {'killed':>6s} {'timeout':>7s} "
    print("\n" + header + f"{'survived':>8s} {'equiv.':>6s} {'score':>7s} {'target':>6s}")
    for group in groups:
        ms = [m for m in mutants if m.group == group]
        counts, s = score(ms)
        target = TARGETS.get(group, DEFAULT_TARGET)
        ok = s is not None and s >= target
        met &= ok or not ms
        shown = f"{100 * s:6.1f}%" if s is not None else "     -"
        print(
            f"{group:22s} {sizes[group][0]:6d} {sizes[group][1]:7d} {len(ms):7d} {counts['killed']:6d} "
            f"{counts['timeout']:7d} {counts['survived']:8d} {counts['equivalent']:6d} {shown} "
            f"{100 * target:5.0f}%{'' if ok or not ms else '  BELOW'}"
        )
    print(
        f"\n{'module':48s} {'sampled':>7s} {'killed':>6s} {'timeout':>7s} {'survived':>8s} {'equiv.':>6s} {'score':>7s}"
    )
    for path in sorted({m.path for m in mutants}):
        ms = [m for m in mutants if m.path == path]
        counts, s = score(ms)
        shown = f"{100 * s:6.1f}%" if s is not None else "     -"
        print(
            f"{path:48s} {len(ms):7d} {counts['killed']:6d} {counts['timeout']:7d} {counts['survived']:8d} "
            f"{counts['equivalent']:6d} {shown}"
        )
    survivors = [m for m in mutants if m.outcome == "survived"]
    if survivors:
        print(f"\n{len(survivors)} surviving mutants (a missing test, or an equivalent mutant to list in")
        print(f"{EQUIVALENT_FILE} with the reason):")
    for m in survivors:
        print(f"\n--- {m.path}:{m.line}  {m.operator}  (tests: {' '.join(m.tests)})")
        print(m.diff)
        print("# if equivalent, add to the equivalents file:")
        print(
            f"[[mutant]]\nfile = {json.dumps(m.path)}\noperator = {json.dumps(m.operator)}\nline = {m.line}\n"
            f'before = {json.dumps(m.before)}\nafter = {json.dumps(m.after)}\nreason = ""'
        )
    return met


def select_groups(root: str, modules: str | None) -> dict[str, list[str]]:
    """The groups to mutate and their files; ``modules``: comma-separated group names or path prefixes."""
    groups = {g: module_files(root, prefixes) for g, prefixes in GROUPS.items()}
    if not modules:
        return groups
    wanted = [w.strip() for w in modules.split(",") if w.strip()]
    out: dict[str, list[str]] = {}
    for w in wanted:
        path = w if w.startswith("replicator/") else "replicator/" + w
        hits = {g: fs for g, fs in groups.items() if w == g} or {
            g: [f for f in fs if f.startswith(path)] for g, fs in groups.items()
        }
        hits = {g: fs for g, fs in hits.items() if fs}
        if not hits:
            raise SetupError(f"--modules {w!r} matches no group ({', '.join(GROUPS)}) and no file in them")
        for g, fs in hits.items():
            out[g] = sorted(set(out.get(g, [])) | set(fs))
    return {g: out[g] for g in groups if g in out}


def _commit(rev: str | None) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", rev or "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _dirty(files: list[str]) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True)
    return [line[3:] for line in out.stdout.splitlines()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", type=int, default=300, help="mutants in all, dealt evenly over the groups (300)")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed (0)")
    p.add_argument("--modules", help=f"comma-separated groups ({', '.join(GROUPS)}) or path prefixes (passes/fold.py)")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy of the tree (1)")
    p.add_argument("--rev", help="mutate and test this commit (git archive) instead of the working tree")
    p.add_argument("--list", action="store_true", help="print the sample and stop")
    p.add_argument("--only", help="run only the sampled mutants at these comma-separated FILE:LINE (a survivor again)")
    p.add_argument("--baseline-only", action="store_true", help="time the sample's tests unmutated, and stop")
    p.add_argument("--timeout", type=float, help="seconds per mutant (default: from the baseline; skips it)")
    p.add_argument("--timeout-factor", type=float, default=3.0, help="a mutant's limit, in baseline runs (3)")
    p.add_argument("--min-timeout", type=float, default=60.0, help="the least limit per mutant, seconds (60)")
    p.add_argument("--equivalents", default=os.path.join(ROOT, EQUIVALENT_FILE), help="the equivalents file")
    p.add_argument("--json", help="write every mutant and its outcome to this file")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths are printed)")
    args = p.parse_args(argv)
    if args.sample < 1 or args.jobs < 1:
        p.error("--sample and --jobs must be at least 1")

    try:
        return _run(args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    """List the sample, or copy the tree, run the sample there and report; the exit status."""
    copies: list[str] = []
    if args.rev or not args.list:  # the sample is drawn from the first copy: what runs is what was listed
        copies.append(make_copy(args.rev))
    root = copies[0] if copies else ROOT
    try:
        groups = select_groups(root, args.modules)
        tests = {path: tests_for(root, path) for paths in groups.values() for path in paths}  # or stop now
        equivalents = load_equivalents(args.equivalents)
        start = time.monotonic()
        mutants, sources, sizes = sample(root, groups, args.sample, args.seed, equivalents)
        for m in mutants:
            m.tests = tests[m.path]
        dirty = [] if args.rev else _dirty([f for fs in groups.values() for f in fs])
        if args.only:
            wanted = {w.strip() for w in args.only.split(",")}
            mutants = [m for m in mutants if f"{m.path}:{m.line}" in wanted]
            if not mutants:
                raise SetupError(f"--only {args.only}: no sampled mutant there (see --list)")
        print(
            f"commit {_commit(args.rev)}{' + uncommitted changes to ' + ', '.join(dirty) if dirty else ''}; "
            f"seed {args.seed}; {len(mutants)} mutants over {', '.join(groups)} "
            f"(listed in {time.monotonic() - start:.1f} s)"
        )
        if args.list:
            for group, (n_sites, n_mutants) in sizes.items():
                n = sum(m.group == group for m in mutants)
                print(f"{group:20s} {n_sites:5d} sites, {n_mutants:5d} mutants in all, {n:3d} sampled")
            for m in mutants:
                mark = "  [equivalent]" if m.outcome == "equivalent" else ""
                print(f"{m.group:20s} {m.path}:{m.line} {m.operator}  {m.before!r} -> {m.after!r}{mark}")
            return 0
        copies += [clone(copies[0]) for _ in range(min(args.jobs, len(mutants)) - 1)]
        print(f"{len(copies)} copies of {args.rev or 'the working tree'}: {', '.join(copies)}", flush=True)
        start = time.monotonic()
        interrupted = False
        try:
            baselines = run_all(mutants, sources, copies, args)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: the table counts the mutants that ran", flush=True)
            mutants = [m for m in mutants if m.outcome != "pending"]
            baselines = {}
        if args.baseline_only:
            print(f"baselines: {sum(baselines.values()):.1f} s in all, {time.monotonic() - start:.1f} s of wall time")
            return 0
    finally:
        if not args.keep:
            for c in copies:
                shutil.rmtree(c, ignore_errors=True)
    elapsed = time.monotonic() - start
    ran = [m for m in mutants if m.outcome in ("killed", "timeout", "survived")]
    met = report(mutants, groups, sizes)
    print(f"\n{len(ran)} mutants run in {elapsed / 60:.1f} min with {len(copies)} job(s), baselines included", end="")
    if ran:
        per = sum(m.seconds for m in ran) / len(ran)
        print(f": {elapsed / len(ran):.1f} s of wall time per mutant; each mutant's tests took {per:.1f} s on average")
    else:
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "commit": _commit(args.rev),
                    "dirty": dirty,
                    "seed": args.seed,
                    "sample": args.sample,
                    "jobs": len(copies),
                    "wall_seconds": elapsed,
                    "baselines": {" ".join(k): v for k, v in baselines.items()},
                    "mutants": [dataclasses.asdict(m) for m in mutants],
                },
                f,
                indent=1,
            )
    return 130 if interrupted else 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
