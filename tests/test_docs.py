"""The examples in the docs run: the code blocks of the markdown pages, and docstring doctests.

Markdown (README.md, CONTRIBUTING.md, BENCHMARKS.md and every docs/**/*.md): the
```python blocks of a file run in order, as one script, in a fresh process with 8
emulated CPU devices (as a reader would paste them); a block sees the names defined by
the blocks before it in the same file, not those of another file. An HTML
comment steers a block without showing up on the rendered page:

* ``<!-- doctest: skip -->`` before a block: the next python block is not run (a fragment
  that shows a signature, or needs a cluster);
* ``<!-- doctest: assert EXPR -->`` after a block: ``EXPR`` must be true there;
* ``<!-- doctest: requires MODULE -->`` before a block: the rest of the file runs only
  where ``MODULE`` imports (an optional extra, e.g. ``orbax.checkpoint``); elsewhere
  the script ends there and passes.

Docstrings: every ``>>>`` example in the package runs with :mod:`doctest`
(``rp``, ``jax``, ``jnp``, ``np`` and ``optax`` already imported).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKDOWN = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "BENCHMARKS.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
DIRECTIVE = re.compile(r"^<!-- doctest: (?P<what>skip|assert|requires) ?(?P<arg>.*?) ?-->$")


@dataclasses.dataclass
class Block:
    line: int  # of the first code line, 1-based
    code: str
    skip: bool = False
    requires: str = ""  # a module the rest of the file needs
    asserts: list[tuple[int, str]] = dataclasses.field(default_factory=list)


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text, with their doctest directives."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    pending_skip, pending_requires = False, ""
    while i < len(lines):
        line = lines[i].strip()
        m = DIRECTIVE.match(line)
        if m and m["what"] == "skip":
            pending_skip = True
        elif m and m["what"] == "requires":
            pending_requires = m["arg"]
        elif m and m["what"] == "assert":
            if not blocks:
                raise ValueError(f"line {i + 1}: 'doctest: assert' before any python block")
            blocks[-1].asserts.append((i + 1, m["arg"]))
        elif line == "```python":
            start = i + 1
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            blocks.append(Block(start + 1, "\n".join(lines[start:i]), skip=pending_skip, requires=pending_requires))
            pending_skip, pending_requires = False, ""
        i += 1
    return blocks


def _relative(path: pathlib.Path) -> str:
    """The path from the repository root, e.g. ``docs/guide/passes.md``."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def script_for(path: pathlib.Path) -> str:
    """One script running the file's blocks in order; comments name the source lines."""
    name = _relative(path)
    parts = []
    for block in python_blocks(path.read_text()):
        if block.skip:
            continue
        if block.requires:  # the rest of the file needs an optional module: end the script where it is missing
            note = f"{name}:{block.line}: {block.requires} is not installed; the rest of the file is not run"
            parts.append(
                f"try:\n    import {block.requires}\nexcept ImportError:\n    print({note!r})\n    raise SystemExit(0)\n"
            )
        parts.append(f"# {name}:{block.line}\n{block.code}\n")
        for line, expr in block.asserts:
            parts.append(f"assert {expr}, {f'{name}:{line}: {expr}'!r}\n")
    return "\n".join(parts)


@pytest.mark.parametrize("path", MARKDOWN, ids=[_relative(p) for p in MARKDOWN])
def test_markdown_code_blocks_run(path, tmp_path):
    script = script_for(path)
    if not script:
        pytest.skip(f"{_relative(path)} has no python blocks")
    (tmp_path / "doc_blocks.py").write_text(script)
    flags = "--xla_force_host_platform_device_count=8"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "doc_blocks.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{_relative(path)}'s code blocks failed:\n{proc.stderr[-4000:]}"


LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown text (outside code blocks)."""
    anchors, fenced = set(), False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _links(text: str) -> list[str]:
    """The link targets of a markdown text, outside code blocks and inline code."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return [m["target"] for m in LINK.finditer(prose)]


LINKED_PAGES = sorted({*MARKDOWN, *(ROOT / "benchmarks" / "results").glob("*.md")})


@pytest.mark.parametrize("path", LINKED_PAGES, ids=[_relative(p) for p in LINKED_PAGES])
def test_markdown_links_resolve(path):
    # Every relative link of a page names a file of the repository, and a heading there.
    broken = []
    for target in _links(path.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {_relative(dest)}")
    assert not broken, f"{_relative(path)}: broken links: {broken}"


def test_directives_are_parsed():
    text = "\n".join(
        [
            "<!-- doctest: skip -->",
            "```python",
            "fragment(...)",
            "```",
            "text",
            "```python",
            "x = 1",
            "```",
            "<!-- doctest: assert x == 1 -->",
            "```bash",
            "echo not python",
            "```",
        ]
    )
    skipped, ran = python_blocks(text)
    assert skipped.skip and skipped.code == "fragment(...)"
    assert not ran.skip and ran.line == 7 and ran.asserts == [(9, "x == 1")]


def test_requires_ends_the_script_where_the_module_is_missing(tmp_path):
    page = tmp_path / "page.md"
    for module, rc in (("no_such_module_x", 0), ("json", 1)):  # json imports: the block runs and fails
        page.write_text(f"<!-- doctest: requires {module} -->\n```python\nraise AssertionError\n```\n")
        (needs,) = python_blocks(page.read_text())
        assert needs.requires == module
        proc = subprocess.run([sys.executable, "-c", script_for(page)], capture_output=True, text=True)
        assert proc.returncode == rc, proc.stderr


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(rp.__path__, "replicator.") if not m.name.endswith("__main__"))


def _doctests(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    globs = {**vars(module), "rp": rp, "jax": jax, "jnp": jnp, "np": np, "optax": optax}
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, globs=globs) if t.examples]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
    if jax.device_count() != 8:
        pytest.skip("the docstring examples are written for 8 devices")
    tests = _doctests(name)
    if not tests:
        pytest.skip(f"{name} has no >>> examples")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (above)"


def test_the_package_has_docstring_examples():
    # The collector above finds something to run (a test that cannot fail otherwise).
    assert sum(len(t.examples) for name in _modules() for t in _doctests(name)) >= 10
