"""Every module of replicator/launch/ ends its docstring with its promises, each citing tests that exist.

A test moved or renamed without its citation fails here, naming the module and the citation.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_MODULES = [
    *("blame", "cli", "environment", "hosts", "membership", "processes"),
    *("relay", "rendezvous", "restarts", "supervise", "watchdog"),
]


def _promises(doc: str) -> list[str]:
    assert "\nPromises:\n" in doc, "no Promises: section"
    items = re.split(r"\n(?=\d+\. )", doc.split("\nPromises:\n", 1)[1].strip())
    assert [int(item.split(".", 1)[0]) for item in items] == list(range(1, len(items) + 1)), "not numbered 1, 2, ..."
    return items


def test_every_launch_module_is_listed():
    here = {p.stem for p in (ROOT / "replicator" / "launch").glob("*.py")} - {"__init__", "__main__", "options"}
    assert here <= set(_MODULES), sorted(here - set(_MODULES))


@pytest.mark.parametrize("name", _MODULES)
def test_every_promise_of_a_launch_module_cites_tests_that_exist(name: str) -> None:
    doc = importlib.import_module(f"replicator.launch.{name}").__doc__
    for item in _promises(doc):
        assert ">>>" not in item, f"{name}: the promises come last, after the examples"
        cited = re.findall(r"(tests/[\w/]+\.py)::([\w:]+)", item)
        assert cited, f"{name}: promise {item[:60]!r} cites no test"
        for file, test in cited:
            assert (ROOT / file).is_file(), f"{name}: {file} does not exist"
            scope = ast.parse((ROOT / file).read_text()).body
            for part in test.split("::"):
                found = [
                    n
                    for n in scope
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
                ]
                assert found, f"{name}: {file}::{test} does not exist"
                scope = found[0].body
