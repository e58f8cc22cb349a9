"""Every shipped config parses, alone or composed as documented.

``configs/`` holds standalone configs (``configs/*.yaml`` and one base per paper experiment,
``configs/<paper>/*.yaml``) and small overrides (``configs/<paper>/<folder>/*.yaml``: one per method,
composed on a base with a repeated ``--config``). Checked here, by parsing only (nothing is
instantiated or trained):

* every standalone config parses alone;
* every ``fl-lightning fit`` command written in the README, in ``docs/`` and in the configs' own
  header comments parses, and every override is used by at least one of them;
* every run of the experiment plans (``experiments/<paper>/plan.py``) parses: one run of each
  shape (:func:`run_shape`: the same configs and flags, values of the same kinds), which parses
  exactly when the others of its shape do;
* through the real command line, ``fl-lightning fit --print_config`` of a base and an override
  prints the override's algorithm with the base's client (the lists and nested arguments merge).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from fl_lightning.cli import FederatedCLI, main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def is_override(path: Path) -> bool:
    """An override is composed after a base: it sits in a paper's sub-folder, or gives no data."""
    return len(path.relative_to(CONFIGS).parts) > 2 or "data" not in (yaml.safe_load(path.read_text()) or {})


STANDALONE = sorted(p for p in CONFIGS.rglob("*.yaml") if not is_override(p))
OVERRIDES = sorted(p for p in CONFIGS.rglob("*.yaml") if is_override(p))
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *STANDALONE, *OVERRIDES]
PLANS = sorted((ROOT / "experiments").glob("*/plan.py"))


def code_text(path: Path) -> str:
    """The parts of a file where commands are written: code blocks and inline code of Markdown,
    comment lines of YAML; shell line continuations joined."""
    text = path.read_text()
    if path.suffix == ".md":
        parts = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        parts += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    else:
        parts = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return "\n".join(parts).replace("\\\n", " ")


def configs_of(args: list[str]) -> list[str]:
    """The config files of a command, as written."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments after ``fl-lightning fit``) of every fit command with a ``--config`` in the
    documents (``--ckpt_path``, which only ``fit`` itself takes, dropped); commands with
    placeholders (``<...>``, ``$VAR``, ``...``), a config outside ``configs/`` (a reader's own
    file, written from a page's blocks) or a class path of the reader's own module (the tutorial's
    ``my_models.MyClassifier``) are left out."""
    commands = []
    for path in DOCUMENTS:
        for match in re.finditer(r"fl-lightning fit( [^\n]*)?", code_text(path)):
            line = (match.group(1) or "").split(";")[0].split("#")[0]
            if "--config" not in line or "<" in line or "$" in line or "..." in line:
                continue
            args = [a for a in shlex.split(line) if a != "--print_config"]
            if any(not config.startswith("configs/") for config in configs_of(args)):
                continue  # the reader's own config (the tutorial's regression.yaml: tests/test_docs.py runs it)
            if any(a.endswith(".class_path") and not args[i + 1].startswith(("fl_lightning.", "torch."))
                   for i, a in enumerate(args[:-1])):
                continue  # a class of the reader's own module, which this checkout does not hold
            if "--ckpt_path" in args:
                del args[args.index("--ckpt_path"):args.index("--ckpt_path") + 2]
            commands.append((f"{path.relative_to(ROOT)}: fl-lightning fit{line.rstrip()}", args))
    return commands


def planned_runs() -> list[tuple[str, list[str]]]:
    """(plan and run name, fit arguments) of every run of the experiment plans."""
    runs = []
    for path in PLANS:
        spec = importlib.util.spec_from_file_location(f"plan_{path.parent.name}", path)
        plan = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plan)
        runs += [(f"{path.parent.name}: {run.name}", run.args) for run in plan.runs()]
    return runs


def run_shape(args: list[str]) -> tuple[str, ...]:
    """What parsing a run's arguments depends on: its flags and config files, its string values
    (choices, class paths, names) as written, and of every other value only its YAML kind
    (``<int>``, ``<float>``, ``<bool>``, ``<NoneType>``). Parsing checks a number's kind against its
    parameter's type, never its value (no parameter is typed with a range), so two runs of one
    shape (a grid's learning rates, its seeds) parse or fail together."""
    shape = []
    for arg in args:
        try:
            value = arg if arg.startswith("-") else yaml.safe_load(arg)
        except yaml.YAMLError:
            value = arg  # not YAML: kept as written
        shape.append(f"<{type(value).__name__}>" if isinstance(value, (bool, int, float, type(None))) else arg)
    return tuple(shape)


def one_run_per_shape(runs: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The first run of each :func:`run_shape`, named with how many runs share its shape."""
    shapes: dict[tuple[str, ...], list[tuple[str, list[str]]]] = {}
    for name, args in runs:
        shapes.setdefault(run_shape(args), []).append((name, args))
    return [(f"{alike[0][0]} (+{len(alike) - 1} of its shape)", alike[0][1]) for alike in shapes.values()]


COMMANDS = documented_commands()
RUNS = planned_runs()
PARSED_RUNS = one_run_per_shape(RUNS)


@pytest.fixture(scope="module")
def parser():
    """The CLI's parser, built once."""
    argv, sys.argv = sys.argv, ["fl-lightning"]
    try:
        return FederatedCLI(args=["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.logger", "false"],
                            run=False).parser
    finally:
        sys.argv = argv


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    """Documented paths are relative to the repository root."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["fl-lightning"])


@pytest.mark.parametrize("config", STANDALONE, ids=[str(p.relative_to(CONFIGS)) for p in STANDALONE])
def test_every_standalone_config_parses(config, parser):
    cfg = parser.parse_args(["--config", str(config)])
    assert cfg.model.class_path and cfg.data.class_path


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_every_documented_command_parses(args, parser):
    cfg = parser.parse_args(args)
    assert cfg.model.class_path and cfg.data.class_path


@pytest.mark.parametrize("args", [args for _, args in PARSED_RUNS], ids=[name for name, _ in PARSED_RUNS])
def test_every_planned_run_parses(args, parser):
    cfg = parser.parse_args(args)
    assert cfg.model.class_path and cfg.data.class_path


def uses(args: list[str]) -> list[Path]:
    """The config files of a command, resolved."""
    return [(ROOT / path).resolve() for path in configs_of(args)]


def test_every_override_is_documented():
    used = {path for _, args in COMMANDS + RUNS for path in uses(args)}
    assert not [str(p.relative_to(ROOT)) for p in OVERRIDES if p.resolve() not in used]


@pytest.mark.parametrize("override", OVERRIDES, ids=[str(p.relative_to(CONFIGS)) for p in OVERRIDES])
def test_print_config_composes_base_and_override(override, capsys):
    """``fl-lightning fit --print_config --config BASE --config OVERRIDE`` (BASE: the first config of
    a documented command that uses the override) keeps the base's client and takes the override's
    algorithm and values."""
    base = next(uses(args)[0] for _, args in COMMANDS if override.resolve() in uses(args))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(base), "--config", str(override), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    written, given = yaml.safe_load(base.read_text()), yaml.safe_load(override.read_text())
    assert printed["model"]["init_args"]["client"]["class_path"] == written["model"]["init_args"]["client"]["class_path"]
    assert printed["model"]["class_path"] == given.get("model", {}).get("class_path", written["model"]["class_path"])
    for key, value in given.get("model", {}).get("init_args", {}).items():
        if key != "client":
            assert printed["model"]["init_args"][key] == value, key
    added = given.get("trainer", {}).get("callbacks+", [])
    callbacks = [c["class_path"] for c in printed["trainer"].get("callbacks") or []]
    assert callbacks[len(callbacks) - len(added):] == [c["class_path"] for c in added]


def test_runs_of_one_shape_differ_in_their_numbers_only():
    """:func:`run_shape` keeps what parsing checks: a number's kind, every string as written; and
    the package types no parameter with a range (``jsonargparse.typing``), which parsing would
    check value by value."""
    assert run_shape(["--lr", "0.1", "--seed", "0"]) == run_shape(["--lr", "0.003", "--seed", "7"])
    assert run_shape(["--steps", "10"]) != run_shape(["--steps", "0.5"])
    assert run_shape(["--schedule", "constant"]) != run_shape(["--schedule", "cosine"])
    assert run_shape(["--flag", "true"]) != run_shape(["--flag", "1"])
    assert run_shape(["--trainer.callbacks.fraction=0.4"]) != run_shape(["--trainer.callbacks.fraction=0.2"])
    assert not [p for p in (ROOT / "fl_lightning").rglob("*.py") if "jsonargparse.typing" in p.read_text()]
    assert {run_shape(args) for _, args in PARSED_RUNS} == {run_shape(args) for _, args in RUNS}  # every shape parsed
