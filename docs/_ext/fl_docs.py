"""fl_lightning's own Sphinx extension: short cross-references, the command line's help, the configs.

* A docstring names an object the way its module does (``:class:`FederatedModule```,
  ``:func:`~fl_lightning.algorithms.FedAvg```: the name a package exports). Sphinx resolves a
  name only where it is documented, in the referring module or as written; this extension
  resolves the others to the one documented object they can mean: the object the dotted name
  imports as (a package's export, documented in the module that defines it), or the only
  documented object whose name ends with the reference. A name that means none, or several, is
  left unresolved, so that the nitpicky build reports it.
* A private base class (``_FedAdaptive``) is shown as its public bases: the reference has no page for it.
* An attribute's or property's docstring is prose here: napoleon's reading of a first line
  ``type: description`` (Google style's inline attribute type) would take the words before the
  first colon for a type.
* ``.. fl-cli-help:: fit --help`` is the output of ``fl-lightning fit --help``, made at build time.
* ``.. fl-configs::`` lists every YAML file of ``configs/`` with its header comment.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

import typing

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode

ROOT = Path(__file__).resolve().parents[2]

#: which documented object types a role may name
ROLE_TYPES = {
    "class": ("class", "exception"),
    "exc": ("exception", "class"),
    "func": ("function", "method", "staticmethod", "classmethod"),
    "meth": ("method", "staticmethod", "classmethod", "function", "property"),
    "attr": ("attribute", "property", "data"),
    "data": ("data", "attribute"),
    "mod": ("module",),
    "obj": None,
}


def imported(target: str) -> tuple[object, object] | None:
    """``(owner, object)``: what the dotted name ``target`` imports as and what holds it, or None."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        owner = obj
        try:
            for attribute in parts[split:]:
                owner, obj = obj, getattr(obj, attribute)
        except AttributeError:
            return None
        return owner, obj
    return None


def defined_name(target: str) -> str | None:
    """The name where the object that ``target`` imports as is defined (``fl_lightning.algorithms.FedAvg``
    -> ``fl_lightning.algorithms.fedavg.FedAvg``; a method inherited from a base: the base's), or None."""
    found = imported(target)
    if found is None:
        return None
    owner, obj = found
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and module.startswith("fl_lightning"):
        return f"{module}.{qualname}"
    if isinstance(owner, type):  # an attribute or property of a class: the class in its MRO that defines it
        name = target.rsplit(".", 1)[1]
        definer = next((c for c in owner.__mro__ if name in vars(c)), owner)
        return f"{definer.__module__}.{definer.__qualname__}.{name}"
    return None


def resolve_short_reference(app: Sphinx, env, node, contnode):
    """``missing-reference``: the one documented Python object a short or re-exported name means."""
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = "".join(node["reftarget"].split()).lstrip(".~")  # a role broken over two lines: one name
    types = ROLE_TYPES.get(node["reftype"], None)
    objects = domain.objects

    def fits(name: str) -> bool:
        return types is None or objects[name].objtype in types

    found = imported(target) if target.startswith("fl_lightning.") else None
    if found is not None and isinstance(found[1], typing.TypeVar):
        return contnode  # a type variable of a signature: nothing to link to
    if target.rsplit(".", 1)[-1].startswith("_"):  # a private name has no page: checked that it exists
        scopes = [node.get("py:module"), f"{node.get('py:module')}.{node.get('py:class')}", ""]
        exists = any(imported(f"{scope}.{target}" if scope else target) for scope in scopes if scope is not None)
        return contnode if exists else None
    if "." in target and not target.startswith("fl_lightning."):  # Class.method: the class's full name first
        head, tail = target.rsplit(".", 1)
        heads = [name for name in objects if name.endswith("." + head) and objects[name].objtype == "class"]
        if len(heads) == 1:
            target = f"{heads[0]}.{tail}"
    canonical = defined_name(target) if target.startswith("fl_lightning.") else None
    if target in objects and fits(target):
        candidates = [target]
    elif canonical in objects and fits(canonical):
        candidates = [canonical]
    else:
        suffix = "." + target
        candidates = [name for name in objects if name.endswith(suffix) and fits(name)]
        if len(candidates) > 1:  # prefer those of the referring class, then of its module
            for scope in (node.get("py:class"), None):
                module = node.get("py:module")
                if not module:
                    break
                prefix = f"{module}.{scope}." if scope else f"{module}."
                near = [name for name in candidates if name.startswith(prefix)]
                if near:
                    candidates = near
                    break
    if len(candidates) != 1:
        return None
    entry = objects[candidates[0]]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, candidates[0])


def public_bases(app: Sphinx, name: str, obj: object, options: dict, bases: list) -> None:
    """``autodoc-process-bases``: a private base class (``_FedAdaptive``) replaced by its own bases."""
    i = 0
    while i < len(bases):
        base = bases[i]
        if isinstance(base, type) and base.__name__.startswith("_"):
            bases[i:i + 1] = [b for b in base.__bases__ if b is not object]
        else:
            i += 1


def prose_inline_attribute(self: GoogleDocstring) -> tuple[str, list[str]]:
    """An attribute's docstring as a description with no type (in place of napoleon's ``type: description``)."""
    lines = [self._lines.next(), *self._dedent(self._consume_to_end())]
    return "", self.__class__(lines, self._config).lines()


class CliHelp(SphinxDirective):
    """The output of ``fl-lightning ARGS``, run in this process at build time."""

    required_arguments = 1
    final_argument_whitespace = True

    def run(self):
        from fl_lightning.cli import main

        argv = shlex.split(self.arguments[0])
        output = io.StringIO()
        columns = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "88"  # the width of the page's code blocks
        argv0, sys.argv = sys.argv, ["fl-lightning"]  # not sphinx-build's: LightningCLI warns of both
        try:
            with contextlib.redirect_stdout(output), contextlib.suppress(SystemExit):
                main(argv)
        finally:
            sys.argv = argv0
            if columns is None:
                os.environ.pop("COLUMNS")
            else:
                os.environ["COLUMNS"] = columns
        printed = re.sub(".\x08", "", output.getvalue())  # a backspace erases the character before it
        text = f"$ fl-lightning {shlex.join(argv)}\n{printed.rstrip()}"
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def header_comment(path: Path) -> str:
    """The comment lines a YAML file starts with, without their ``#``."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(lines)


class ConfigsListing(SphinxDirective):
    """Every YAML file of ``configs/``, by folder, with what its header comment says it runs."""

    def run(self):
        configs = ROOT / "configs"
        result = []
        for path in sorted(configs.rglob("*.yaml"), key=lambda p: (len(p.relative_to(configs).parts), str(p))):
            self.env.note_dependency(str(path))
            name = str(path.relative_to(ROOT))
            section = nodes.section(ids=[nodes.make_id(name)])
            section += nodes.title(name, "", nodes.literal(name, name))
            comment = header_comment(path) or "(no header comment)"
            section += nodes.literal_block(comment, comment, language="text")
            result.append(section)
        return result


def setup(app: Sphinx) -> dict:
    GoogleDocstring._consume_inline_attribute = prose_inline_attribute
    app.connect("missing-reference", resolve_short_reference)
    app.connect("autodoc-process-bases", public_bases)
    app.add_directive("fl-cli-help", CliHelp)
    app.add_directive("fl-configs", ConfigsListing)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
