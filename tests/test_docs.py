"""The examples in the docs run: README.md and docs/*.md code blocks, and docstring doctests.

Markdown: the ```python blocks of a file run in order, as one script, in a fresh
process with 8 emulated CPU devices (as a reader would paste them). An HTML
comment steers a block without showing up on the rendered page:

* ``<!-- doctest: skip -->`` before a block: the next python block is not run (a fragment
  that shows a signature, or needs a cluster);
* ``<!-- doctest: assert EXPR -->`` after a block: ``EXPR`` must be true there.

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
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DIRECTIVE = re.compile(r"^<!-- doctest: (?P<what>skip|assert) ?(?P<arg>.*?) ?-->$")


@dataclasses.dataclass
class Block:
    line: int  # of the first code line, 1-based
    code: str
    skip: bool = False
    asserts: list[tuple[int, str]] = dataclasses.field(default_factory=list)


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text, with their doctest directives."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    pending_skip = False
    while i < len(lines):
        line = lines[i].strip()
        m = DIRECTIVE.match(line)
        if m and m["what"] == "skip":
            pending_skip = True
        elif m and m["what"] == "assert":
            if not blocks:
                raise ValueError(f"line {i + 1}: 'doctest: assert' before any python block")
            blocks[-1].asserts.append((i + 1, m["arg"]))
        elif line == "```python":
            start = i + 1
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            blocks.append(Block(start + 1, "\n".join(lines[start:i]), skip=pending_skip))
            pending_skip = False
        i += 1
    return blocks


def script_for(path: pathlib.Path) -> str:
    """One script running the file's blocks in order; comments name the source lines."""
    parts = []
    for block in python_blocks(path.read_text()):
        if block.skip:
            continue
        parts.append(f"# {path.name}:{block.line}\n{block.code}\n")
        for line, expr in block.asserts:
            parts.append(f"assert {expr}, {f'{path.name}:{line}: {expr}'!r}\n")
    return "\n".join(parts)


@pytest.mark.parametrize("path", MARKDOWN, ids=[p.name for p in MARKDOWN])
def test_markdown_code_blocks_run(path, tmp_path):
    script = script_for(path)
    if not script:
        pytest.skip(f"{path.name} has no python blocks")
    (tmp_path / "doc_blocks.py").write_text(script)
    flags = "--xla_force_host_platform_device_count=8"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "doc_blocks.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{path.name}'s code blocks failed:\n{proc.stderr[-4000:]}"


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
