"""Sphinx configuration of fl_lightning's documentation site.

Build it (``pip install -e ".[docs]"``; ``tests/test_docs_site.py`` runs the same, warnings as errors
and every cross-reference checked)::

    python -m sphinx -W -n -b html docs docs/_build/html

The pages are Markdown (MyST), the API reference is generated from the docstrings (autodoc with
napoleon: Google style), and the build needs no network: no intersphinx unless ``FL_DOCS_INTERSPHINX=1``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext")]

import fl_lightning  # noqa: E402  (after the path: the checkout's package)

project = "fl_lightning"
author = "fl_lightning's authors"
copyright = "fl_lightning's authors, Apache-2.0"
release = version = fl_lightning.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "fl_docs",
]
if os.environ.get("FL_DOCS_INTERSPHINX") == "1":  # links into Python's, torch's and Lightning's docs (network)
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
        "lightning": ("https://lightning.ai/docs/pytorch/stable", None),
    }

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: anchors for the headings, so that links such as page.md#a-section resolve
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# the docstrings: Google style, documented where they are defined, shown without their module path
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_inherit_docstrings = False
add_module_names = False
python_use_unqualified_type_names = True

# every cross-reference must resolve (-n); the only ones left out are the standard library's and the
# third-party packages' (their inventories need the network), and torch's Tensor as the signatures write it
nitpicky = True
THIRD_PARTY = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities", "torchmetrics",
               "torchvision", "numpy", "jsonargparse", "datasets", "flwr", "flwr_datasets", "matplotlib", "scipy",
               "opacus")
STANDARD_LIBRARY = ("abc", "argparse", "collections", "concurrent", "contextlib", "dataclasses", "datetime",
                    "difflib", "enum", "io", "os", "pathlib", "threading", "types", "typing")
nitpick_ignore_regex = [
    (r"py:.*", rf"({'|'.join(THIRD_PARTY + STANDARD_LIBRARY)})(\..*)?"),
    (r"py:class", r"Tensor"),
]

# a docstring's literal blocks are formulas and diagrams more often than Python (examples are >>> blocks)
highlight_language = "none"
# the page's table of contents names a class's members without the class
toc_object_entries_show_parents = "hide"

html_theme = "furo"
html_title = f"fl_lightning {release}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
