"""Every use of JAX internals and every JAX version difference stays in ``replicator/_jax_compat.py``."""

import ast
import pathlib

import pytest

from replicator import _jax_compat

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "replicator"
COMPAT = PACKAGE / "_jax_compat.py"


def _offences(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Attribute) and node.attr in ("__version__", "_src"):
            names = [ast.unparse(node)]
        else:
            continue
        for name in names:
            if name.startswith("jax._src") or name.startswith("jaxlib") or name.endswith(("._src", "__version__")):
                found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_only_the_compat_module_touches_jax_internals_or_versions():
    offences = [o for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT for o in _offences(path)]
    assert offences == [], "move these into replicator/_jax_compat.py:\n" + "\n".join(offences)


def test_the_checker_sees_internal_imports_and_version_checks(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import jax\nfrom jax._src import core\nimport jax._src.lax\nif jax.__version__ > '0.11': pass\n")
    assert [o.split(": ")[1] for o in _offences(bad)] == ["jax._src", "jax._src.lax", "jax.__version__"]


@pytest.mark.parametrize("name", _jax_compat.__all__)
def test_compat_exports_exist(name):
    assert hasattr(_jax_compat, name)


def test_fast_compile_flags_are_known_to_this_xla():
    # An unknown flag aborts XLA; this process already started with them (tests/conftest.py).
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("REPLICATOR_TEST_XLA_DEFAULTS") != "1":
        for flag in _jax_compat.fast_compile_xla_flags():
            assert flag.split("=")[0] in flags
