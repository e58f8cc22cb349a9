"""The documentation site builds, with every cross-reference resolved, and documents the whole API.

The build is the one the docs describe, ``python -m sphinx -W -n -b html docs OUT``: warnings are
errors and the references are checked (nitpicky), so a stale ``:class:`...``` in a docstring, a
broken table or a link to a missing page fails here. It needs the ``[docs]`` extra (which ``[test]``
holds); without it the build is skipped, saying so. The user pages carry no commit hash: provenance
belongs to ``docs/results/`` and ``docs/dev/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fl_lightning

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOCS_PACKAGES = ("sphinx", "myst_parser", "furo")
#: pages where commit hashes belong: the paper reproductions' provenance and the developers' notes
PROVENANCE = (DOCS / "results", DOCS / "dev")
#: a commit hash as the docs write one: 7 to 40 hexadecimal digits, with a digit and a letter (not the value of
#: a named checksum, ``crc32:8b9a0a0d``)
COMMIT = re.compile(r"(?<![\w.:-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


def user_pages() -> list[Path]:
    """The README and every Markdown page of docs/ outside docs/results/ and docs/dev/."""
    pages = [p for p in DOCS.rglob("*.md") if not any(p.is_relative_to(folder) for folder in PROVENANCE)]
    return [ROOT / "README.md", *sorted(pages)]


def commit_hashes(text: str) -> list[str]:
    return COMMIT.findall(text)


def test_the_commit_pattern_finds_hashes_and_nothing_else():
    assert commit_hashes("fixed in `d891250`; since 20a8acb, (commit 646989b)") == ["d891250", "20a8acb", "646989b"]
    assert commit_hashes("1234567 rounds, deadbeef, 1e-5, 0x1f2e3d4c, sha256 ab12, crc-32, a3185ad-dirty, "
                          "crc32:8b9a0a0d") == []


def test_no_user_page_names_a_commit():
    found = {str(page.relative_to(ROOT)): commit_hashes(page.read_text()) for page in user_pages()}
    assert {"README.md", "index.md"} <= {Path(name).name for name in found}
    assert {page: hashes for page, hashes in found.items() if hashes} == {}, (
        "commit hashes in user pages: move the provenance to docs/dev/ or docs/results/")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as the docs say, in a fresh interpreter (autodoc imports every module)."""
    missing = [name for name in DOCS_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the docs site needs the [docs] extra (pip install -e '.[docs]'); missing: {', '.join(missing)}")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "-q", "-b", "html", "-d", str(out / ".doctrees"),
                           str(DOCS), str(out / "html")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"the docs site does not build:\n{done.stderr[-6000:]}"
    return out / "html"


def documented(site: Path) -> set[str]:
    """The Python objects the built site documents, by full name."""
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    names = set()
    for kind, entries in inventory.items():
        if kind.startswith("py:"):
            names.update(entries)
    return names


def defined_at(obj: object) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@pytest.mark.slow
def test_the_site_documents_every_module_and_every_exported_name(site):
    names = documented(site)
    modules = [m.name for m in pkgutil.walk_packages(fl_lightning.__path__, "fl_lightning.")]
    assert [m for m in ["fl_lightning", *modules] if m not in names] == []
    missing = []
    for module in ["fl_lightning", *modules]:
        imported = importlib.import_module(module)
        for name in getattr(imported, "__all__", ()):
            obj = getattr(imported, name)
            full = defined_at(obj) if hasattr(obj, "__qualname__") else f"{module}.{name}"
            if full not in names:
                missing.append(f"{module}.{name} ({full})")
    assert missing == []


@pytest.mark.slow
def test_the_reference_documents_federated_module_and_its_hooks(site):
    names = documented(site)
    hooks = ["client_init", "client_step", "client_final", "server_update", "add_update", "add_client_state"]
    assert [h for h in hooks if f"fl_lightning.module.FederatedModule.{h}" not in names] == []
    page = (site / "reference" / "api" / "federation.html").read_text()
    assert 'id="fl_lightning.module.FederatedModule"' in page and "client_step" in page
    # a short name in a docstring links to its one documented object
    assert 'href="#fl_lightning.module.FederatedModule"' in page or "federation.html#fl_lightning.module" in page


@pytest.mark.slow
def test_the_cli_reference_is_the_commands_own_help(site):
    page = (site / "reference" / "cli.html").read_text()
    assert "fl-lightning plot" in page and "--add-checksum" in page
