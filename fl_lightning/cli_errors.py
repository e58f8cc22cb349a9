"""The command line's errors in a line or two: the option, what is wrong with it, a "did you mean".

jsonargparse reports a wrong value as the whole tree of what it tried: every alternative of a
union (``Optional[int]``: an int, then None), every class it tried, the given value's ``repr``
(``Namespace(...)`` of the whole model) and, before it all, the usage of every option. The
functions here read that tree and keep its one informative branch::

    error: --model.init_args.client_backend: 'batchd' is not one of 'sequential', 'batched'; did you mean 'batched'?
    tip: fl-lightning fit --help lists the options

A misspelt option, argument or class name gets the closest valid one (:mod:`difflib`); a class
path that names no class, the classes of its kind that there are (for ``--model`` the
algorithms, the ``FederatedModule`` subclasses; for ``--data`` the ``FederatedDataModule``
subclasses). A message of another form is kept as it is, less the given value's ``repr``.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, NoReturn, Optional, Sequence

from jsonargparse import ArgumentParser

from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.lightning_package import PACKAGE, VARIABLE, package_of
from fl_lightning.module import FederatedModule

#: the kinds of class whose every subclass a class-path error lists: (base, what the list is called)
LISTED = ((FederatedModule, "algorithms"), (FederatedDataModule, "datamodules"))

_PARSER_KEY = re.compile(r'Parser key "([^"]+)":(.*)')
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '([^']+)':")
_UNION = "Does not validate against any of the Union subtypes"
_EXPECTED = re.compile(r"Expected a (.+?)(?:\. Got value: (.*))?")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_NOT_A_CLASS = re.compile(r"Expected a dot import path string: .*|module '[\w.]+' has no attribute '\w+'"
                          r"|No module named '[\w.]+'")
_CLASS = re.compile(r"<class '([\w.]+)'>")
_NAMESPACE_CLASS = re.compile(r"Namespace\(class_path='([\w.]+)'")
_INVALID_CHOICE = re.compile(r"(.*invalid choice: '([^']*)' \(choose from (.*)\))")
_UNRECOGNIZED = "unrecognized arguments: "
_NOT_SUBCLASS = re.compile(r"Import path ([\w.]+) does not correspond to a subclass of \w+")


@dataclass
class _Node:
    """A line of jsonargparse's message, and the lines indented below it."""

    text: str
    children: list["_Node"] = field(default_factory=list)


@dataclass
class _Problem:
    """What is wrong: the option's key (its dotted path), the description, and a line to add (a list)."""

    key: list[str]
    detail: str
    listing: str = ""


def short_error(message: str, options: Iterable[str] = ()) -> str:
    """jsonargparse's error ``message`` as the option, what is wrong with it and a "did you mean",
    on one line (and a second listing the classes a bad class path could name).

    Args:
        message: the message jsonargparse's parser gives its ``error`` method.
        options: the parser's option strings (``--trainer.max_epochs``...), to correct a misspelt one.
    """
    message = message.strip()
    if message.startswith(_UNRECOGNIZED):
        return _unrecognized(message[len(_UNRECOGNIZED):].split(), list(options))
    choice = _INVALID_CHOICE.fullmatch(message)
    if choice:
        choices = [c.strip().strip("'") for c in choice[3].split(",")]
        return choice[1] + _did_you_mean(choice[2], choices, quote=True)
    problem = _explain(_outline(message), [], [])
    if problem is None:
        return "\n".join(line for line in message.splitlines() if not line.lstrip().startswith("Given value"))
    option = f"--{'.'.join(problem.key)}: " if problem.key else ""
    return option + problem.detail + _package_advice(message) + (f"\n{problem.listing}" if problem.listing else "")


def debugging() -> bool:
    """Whether ``JSONARGPARSE_DEBUG=true`` asks for jsonargparse's own errors instead (exceptions, with
    their whole message and traceback)."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"


def exit_with_error(message: str, command: str) -> NoReturn:
    """Print ``message`` (reduced by :func:`short_error` already) and a pointer to ``command --help``
    on stderr, and exit with status 2 (argparse's for a usage error)."""
    sys.stderr.write(f"error: {message}\ntip: {command} --help lists the options\n")
    sys.exit(2)


# ---------------------------------------------------------------- reading the message
def _outline(message: str) -> list[_Node]:
    """The message's lines as a tree by their indentation (a list item's text is indented past its ``- ``)."""
    root: list[_Node] = []
    stack: list[tuple[int, list[_Node]]] = [(-1, root)]
    for line in message.splitlines():
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(line.lstrip())
        if text.startswith("- "):
            text, indent = text[2:], indent + 2
        while stack[-1][0] >= indent:
            stack.pop()
        node = _Node(text)
        stack[-1][1].append(node)
        stack.append((indent, node.children))
    return root


def _explain(block: list[_Node], key: list[str], bases: list[type]) -> Optional[_Problem]:
    """The problem a block of sibling lines describes, below the option ``key`` whose value may be a
    subclass of one of ``bases`` (None: a form this module does not know)."""
    texts = [node.text for node in block]
    if _UNION in texts:
        return _explain_union(block, key)
    for node in block:
        parser_key = _PARSER_KEY.fullmatch(node.text)
        if parser_key:
            inner = key + parser_key[1].split(".")
            if parser_key[2].strip():
                return _Problem(inner, parser_key[2].strip())
            return _explain(node.children, inner, [])
        class_problem = _CLASS_PROBLEM.fullmatch(node.text)
        if class_problem:
            return _explain_class(node.children, key, class_problem[1], bases)
    if len(block) == 1:
        return _leaf(block[0], key)
    return None


def _explain_union(block: list[_Node], key: list[str]) -> Optional[_Problem]:
    """A value that none of a union's types took: the informative alternative (a class tried, a
    class path that names none, a constructor's refusal), else what the types expect."""
    subtypes = next((n.text for n in block if n.text.startswith("Subtypes: ")), "")
    bases = [cls for cls in map(_import, _CLASS.findall(subtypes)) if isinstance(cls, type)]
    errors = next((n.children for n in block if n.text == "Errors:"), [])
    given = next((n.text[len("Given value: "):] for n in block if n.text.startswith("Given value: ")), "")
    for node in errors:
        if _CLASS_PROBLEM.fullmatch(node.text):
            return _explain([node], key, bases)
    for node in errors:
        if _NOT_A_CLASS.fullmatch(node.text):
            return _class_not_found(key + ["class_path"], _given_class(node.text, given), bases)
    refusals = [n for n in errors if not _EXPECTED.fullmatch(n.text) and not n.text.startswith("Not a valid subclass")]
    if refusals:  # a constructor refused its arguments (at instantiation)
        named = _NAMESPACE_CLASS.match(given)
        where = f"{named[1]}: " if named else ""
        return _Problem(key, where + _text(refusals[0]))
    expected = [m[1] for m in map(_EXPECTED.fullmatch, (n.text for n in errors)) if m]
    if expected and not given.startswith(("NestedArg(", "Namespace(")):
        return _Problem(key, _expectation(expected, given))
    return None


def _explain_class(block: list[_Node], key: list[str], class_path: str, bases: list[type]) -> Optional[_Problem]:
    """What is wrong with the value of ``key``, a ``class_path`` that was tried: an argument it
    does not take, one of its arguments, or the class path itself."""
    for node in block:
        not_accepted = _NOT_ACCEPTED.fullmatch(node.text)
        if not_accepted:
            name = not_accepted[1]
            detail = f"{class_path.rsplit('.', 1)[-1]} takes no argument {name!r}"
            return _Problem(key + ["init_args", name], detail + _did_you_mean(name, _arguments(class_path), True))
        if _NOT_A_CLASS.fullmatch(node.text):
            return _class_not_found(key + ["class_path"], class_path, bases)
    return _explain(block, key + ["init_args"], [])


def _leaf(node: _Node, key: list[str]) -> _Problem:
    """A line that says what is wrong (``Expected a <class 'int'>. Got value: x``), with what is indented below it."""
    expected = _EXPECTED.fullmatch(node.text)
    if expected and expected[2] is not None:
        return _Problem(key, _expectation([expected[1]], expected[2]))
    return _Problem(key, _text(node))


def _text(node: _Node) -> str:
    """A node's line and those below it, on one line (without the given value's ``repr``)."""
    return " ".join([node.text, *(_text(child) for child in node.children if not child.text.startswith("Given value"))])


# ---------------------------------------------------------------- what to say
def _expectation(types: Sequence[str], given: str) -> str:
    """What the types of a value expect, for the string ``given``: the choices of ``Literal`` types (and
    the closest one), else the types' names."""
    choices: list[str] = []
    names: list[str] = []
    for hint in types:
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", hint)
        if literal:
            choices += [c.strip() for c in literal[1].split(",")]
        else:
            names.append(_type_name(hint))
    if choices:
        others = "".join(f", or {name}" for name in names)
        values = [c.strip("'") for c in choices]
        return f"{given!r} is not one of {', '.join(choices)}{others}" + _did_you_mean(given, values, quote=True)
    return f"expected {' or '.join(names)}, got {given!r}"


def _type_name(hint: str) -> str:
    """``<class 'int'>`` -> ``int``; None's type -> ``null`` (as YAML writes it)."""
    named = _CLASS.fullmatch(hint)
    name = named[1].rsplit(".", 1)[-1] if named else hint
    return "null" if name == "NoneType" else name


def _class_not_found(key: list[str], class_path: str, bases: list[type]) -> _Problem:
    """A class path that names no class: the closest class of its kind (a subclass of one of
    ``bases``, or a class of the module it names), and for algorithms and datamodules all of them."""
    module, _, name = class_path.rpartition(".")
    known = {cls.__name__: cls for base in bases for cls in _subclasses(base)}
    found = _import(module) if module else None
    if found is not None:
        known.update({n: v for n, v in vars(found).items() if isinstance(v, type) and not n.startswith("_")})
    kind = next((word for base, word in LISTED if any(issubclass(b, base) for b in bases)), None)
    detail = f"no class {class_path!r}" + _did_you_mean(name, sorted(known))
    listing = f"{kind}: {', '.join(sorted({c.__name__ for b in bases for c in _subclasses(b)}))}" if kind else ""
    return _Problem(key, detail, listing)


def _given_class(text: str, given: str) -> str:
    """The class path in a union's error (``Expected a dot import path string: FedAVG``) or its given value."""
    if text.startswith("Expected a dot import path string: "):
        return text.split(": ", 1)[1]
    nested = re.search(r"val='([^']*)'", given)
    return nested[1] if nested else given


def _unrecognized(words: list[str], options: list[str]) -> str:
    """Options the parser does not know, each with the closest one it does (the longest dotted
    prefix that is close to an option, then the rest as given: ``--modle.init_args.seed`` ->
    ``--model.init_args.seed``)."""
    unknown = [word.split("=", 1)[0].rstrip("+") for word in words if word.startswith("-")]
    if not unknown:
        return _UNRECOGNIZED + " ".join(words)
    said = []
    for option in unknown:
        parts = option.split(".")
        suggestion = ""
        for n in range(len(parts), 0, -1):
            close = difflib.get_close_matches(".".join(parts[:n]), options, n=1, cutoff=0.75)
            if close:
                suggestion = ".".join([close[0], *parts[n:]])
                break
        said.append(f"{option}" + (f" (did you mean {suggestion}?)" if suggestion and suggestion != option else ""))
    return f"unknown option{'s' if len(said) > 1 else ''} {', '.join(said)}"


def _package_advice(message: str) -> str:
    """Where ``message`` refuses a class of the other Lightning package than the one fl_lightning is built
    on (a client written with ``lightning.pytorch`` in a ``pytorch_lightning`` process), how to run on
    that package; else ""."""
    refused = _NOT_SUBCLASS.search(message)
    cls = _import(refused[1]) if refused else None
    package = package_of(cls) if isinstance(cls, type) else None
    if package is None or package == PACKAGE:
        return ""
    return (f"; {refused[1]} is written for the {package} package and fl_lightning runs on {PACKAGE}: "
            f"set {VARIABLE}={package}")


def _did_you_mean(word: str, candidates: Sequence[str], quote: bool = False) -> str:
    """``"; did you mean X?"`` with the candidate closest to ``word`` (case aside), or ""."""
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    if not close:
        return ""
    best = by_lower[close[0]]
    return f"; did you mean {best!r}?" if quote else f"; did you mean {best}?"


# ---------------------------------------------------------------- classes
def _import(path: str) -> object:
    """The module, or the attribute of one, at the dotted ``path`` (None if there is none)."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        if not module:
            return None
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None


def _subclasses(base: type) -> list[type]:
    """Every subclass of ``base`` imported so far (of public name), the subclasses' own included."""
    found: list[type] = []
    for cls in base.__subclasses__():
        if not cls.__name__.startswith("_"):
            found.append(cls)
        found += _subclasses(cls)
    return found


def _arguments(class_path: str) -> list[str]:
    """The arguments jsonargparse accepts for the class at ``class_path`` (its own and its bases',
    through ``**kwargs``), or none if it cannot be read."""
    cls = _import(class_path)
    if not isinstance(cls, type):
        return []
    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, "init_args")
    except (ValueError, TypeError):
        return []
    return sorted(vars(parser.get_defaults()["init_args"]))
