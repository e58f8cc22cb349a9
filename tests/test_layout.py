"""The package's layering: the engine does not depend on the callbacks it calls, the
mathematics in ``fl_lightning.functional`` depends on nothing but torch, and each layer
imports first in a fresh interpreter (no import cycle)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import fl_lightning
from tests.fresh_python import run_python

PACKAGE = Path(fl_lightning.__file__).resolve().parent
ROOT = PACKAGE.parent


def source_of(module: str) -> Path:
    """The file of ``module`` (a dotted name inside ``fl_lightning``)."""
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def is_module(name: str) -> bool:
    return name.startswith("fl_lightning.") and source_of(name).exists()


def runtime_imports(module: str) -> set[str]:
    """The ``fl_lightning`` modules that importing ``module`` runs, by its own import statements
    (anywhere in the file, a function body included; not those under ``if TYPE_CHECKING:``), with
    the packages on their way except ``fl_lightning`` itself (whose ``__init__`` gathers the public API)."""
    tree = ast.parse(source_of(module).read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    modules = set()
    for name in found:
        parts = name.split(".")
        modules.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return {m for m in modules if is_module(m)}


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(runtime_imports(current))
    return seen


def third_party_imports(module: str) -> set[str]:
    """The top-level names of the packages ``module`` imports other than ``fl_lightning``."""
    tree = ast.parse(source_of(module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - {"fl_lightning"}


@pytest.mark.parametrize("engine", ["fl_lightning.module", "fl_lightning.hooks"])
def test_the_engine_does_not_import_callbacks_or_algorithms(engine):
    reached = closure(engine)
    assert "fl_lightning.backends" in reached or engine != "fl_lightning.module"
    above = sorted(m for m in reached if m.startswith(("fl_lightning.callbacks", "fl_lightning.algorithms")))
    assert above == [], f"{engine} imports {above}"


def test_functional_depends_on_torch_and_the_standard_library_only():
    modules = sorted("fl_lightning.functional." + p.stem for p in (PACKAGE / "functional").glob("*.py")
                     if p.stem != "__init__")
    assert {"fl_lightning.functional.prox", "fl_lightning.functional.robust"} <= set(modules)
    # fl_lightning.validation (argument checks) is allowed: it depends on the standard library only.
    assert not runtime_imports("fl_lightning.validation")
    assert third_party_imports("fl_lightning.validation") <= set(sys.stdlib_module_names)
    for module in ["fl_lightning.functional", *modules]:
        assert all(m.startswith("fl_lightning.functional") or m == "fl_lightning.validation"
                   for m in runtime_imports(module)), module
        assert third_party_imports(module) <= {"torch", "numpy"} | set(sys.stdlib_module_names), module


@pytest.mark.parametrize("module", ["fl_lightning.module", "fl_lightning.callbacks", "fl_lightning.functional"])
def test_imports_first_in_a_fresh_interpreter(module):
    """Importing it first (no module of the package imported before) works: no import cycle."""
    done = run_python(["-c", f"import {module}"], cwd=ROOT)
    assert done.returncode == 0, done.stderr
