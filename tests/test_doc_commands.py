"""Every command in the README and the docs works as written.

The ```bash and ```python blocks of ``README.md`` and ``docs/**/*.md`` are run in document order,
one temporary working folder per page (holding links to the checkout's ``configs/``,
``benchmarks/`` and ``experiments/``; the python blocks of ``engine.md`` and ``partitioners.md``
run in ``tests/test_docs.py``, which also checks what they do):

* ``fl-lightning`` commands on the quickstart's configuration run for real (it is small and
  generated), and so do ``plot`` and ``checkpoint`` (on the files earlier commands wrote); on any
  other configuration (real datasets, long runs) they are parsed and checked with ``--print_config``;
* ``python benchmarks/...`` scripts and ``python -m experiments...`` modules answer ``--help``
  (an experiment's ``--list``, which only prints its runs, runs as written);
* a command a page repeats (the README's quickstart, in its set-up and again in its tour) runs
  once: the repeat would run the same thing in the same folder;
* a command's leading environment assignments (``NAME=value``) are dropped: the command runs in
  this process;
* the set-up lines (``python3 -m venv``, ``pip install``, ``pytest``) are what CI runs
  (``.ci/run``: the README's test command), so they are not repeated here.

A block preceded by ``<!-- doc-test: skip (reason) -->`` is not run (it needs GPUs, say).
A command of any other kind fails the test: give it a handler here.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path

import pytest

from fl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(<!-- doc-test: skip[^>]*-->\s*)?```(bash|python)\n(.*?)```", re.S)
SETUP = ("python3 -m venv", "pip install", "pytest", ". .venv/bin/activate", "source .venv/bin/activate")
FAST_CONFIGS = ("configs/quickstart.yaml",)
#: pages whose python blocks tests/test_docs.py runs, with checks of what they do
PYTHON_TESTED_ELSEWHERE = ("engine.md", "partitioners.md")


def blocks(page: Path) -> list[tuple[str, str]]:
    """The page's (language, code) blocks to run, in order."""
    return [(lang, code) for skip, lang, code in BLOCK.findall(page.read_text()) if not skip]


def commands(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped, ``&&`` split."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split("&&")]
    return out


def run_fl_lightning(argv: list[str]) -> None:
    real = any(c in argv for c in FAST_CONFIGS) and argv[0] != "pefll-predict"
    if argv[0] in ("plot", "checkpoint") or real or "--print_config" in argv:
        with pytest.raises(SystemExit) if "--print_config" in argv else contextlib.nullcontext():
            main(argv)
        return
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as done:
        main([*argv, "--print_config"])
    assert done.value.code == 0, f"fl-lightning {shlex.join(argv)} --print_config exited with {done.value.code}"


def script(argv: list[str]) -> list[str] | None:
    """The interpreter arguments of a documented Python script or experiment module, or None."""
    if argv[0] != "python" or len(argv) < 2:
        return None
    if argv[1].startswith("benchmarks/"):
        return argv[1:]
    if argv[1] == "-m" and argv[2].startswith("experiments."):
        return argv[1:]
    return None


def arguments(command: str) -> list[str]:
    """The command's words after its leading environment assignments (``NAME=value``: malloc's, say;
    the command runs in this process, without them)."""
    argv = shlex.split(command)
    while argv and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]
    return argv


def run_command(command: str) -> None:
    if command.startswith(SETUP):
        return  # CI runs the set-up (.ci/run)
    argv = arguments(command)
    if argv[0] == "fl-lightning":
        run_fl_lightning(argv[1:])
        return
    args = script(argv)
    if args is None:
        raise AssertionError(f"no handler for the documented command {command!r}: add one to {__file__}")
    name = args[:2] if args[0] == "-m" else args[:1]
    run_script([*args] if "--list" in args else [*name, "--help"])


def run_script(args: list[str]) -> None:
    """``python ARGS`` in this process (its modules are imported already: a fresh interpreter per
    command cost about 5 s), as ``__main__``, with ``sys.argv`` set; it must finish or exit 0."""
    argv, path = sys.argv, sys.path
    sys.argv = [args[1], *args[2:]] if args[0] == "-m" else [str(ROOT / args[0]), *args[1:]]
    sys.path = [str(ROOT), str(ROOT / "benchmarks"), *path]  # as PYTHONPATH=. and the script's folder
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
            if args[0] == "-m":
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / args[0]), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"python {shlex.join(args)} exited with {done.code}:\n{output.getvalue()[-2000:]}"
    finally:
        sys.argv, sys.path = argv, path


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_commands_of_a_page_work_as_written(page, tmp_path, monkeypatch):
    for name in ("configs", "benchmarks", "experiments"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    done: set[str] = set()
    for lang, code in blocks(page):
        if lang == "bash":
            for command in commands(code):
                if command not in done:
                    run_command(command)
                    done.add(command)
        elif page.name not in PYTHON_TESTED_ELSEWHERE:
            exec(compile(code, str(page), "exec"), namespace)


def test_every_page_is_collected_and_every_command_has_a_handler():
    assert {"README.md", "federate_your_module.md", "your_dataset.md", "engine.md"} <= {p.name for p in PAGES}
    for page in PAGES:
        for lang, code in blocks(page):
            for command in commands(code) if lang == "bash" else []:
                argv = arguments(command)
                assert command.startswith(SETUP) or argv[0] == "fl-lightning" or script(argv) is not None, (
                    f"{page.name}: no handler for {command!r}")
