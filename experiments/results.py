"""The compact result files of the paper experiments (``docs/results/<paper>.json``).

One file per paper holds every run its document reports::

    {"runs": [
    {"name": "...", "params": {...}, "wall_s": 123.4, "history": [{"round": 10, "test_acc": 0.91, ...}, ...]},
    ...
    ]}

* ``name``: unique in the file;
* ``commit`` (runs made since it was recorded): the project commit the run ran on; ``commits``, the
  commits in order, where a run was stopped and resumed on another;
* ``params``: the settings the tables group runs by (method, seed, attack...);
* ``wall_s``: the run's training wall time in seconds, where it was measured;
* ``history``: the evaluations in round order, each the round (1-based; 0 is before training) and
  the metrics measured then;
* ``summary`` (optional): figures measured once per run (data sizes, final evaluations...).
* ``device`` (runs made since it was recorded): what the run trained on, ``cpu`` or ``cuda: <the
  card>``; ``backend`` (only where the sweep chose it, ``--backend``): the clients' backend.
* ``env`` (runs made since it was recorded): what the process that recorded the run ran with
  (:func:`environment`): Python, torch, Lightning and numpy versions, torch's threads, CUDA's version
  and the tree the code came from.
* ``diverged`` (only where the run diverged): the round it stopped in and the error; its history
  holds the evaluations before.
* ``stopped`` (only where a sweep's time limit stopped the run): the round it stopped after, of how
  many; its history ends there.

Files are written one run per line, so that a changed run is a one-line diff.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

Run = dict[str, Any]


#: the folders of the tree a run's results depend on: a run refuses to start while they hold changes
#: that are not committed, since its record could not be reproduced from the commit it names
CODE_FOLDERS = ("fl_lightning", "experiments", "configs")
#: the project's root (whatever the working directory)
ROOT = Path(__file__).resolve().parents[1]


class UncommittedChangesError(RuntimeError):
    """The code a run would record holds changes that no commit has."""


def commit() -> str:
    """The project commit a run runs on: ``FL_LIGHTNING_COMMIT`` where set (a copy of the tree on another
    machine, whose ``.git``, if any, need not match its files), else ``git rev-parse HEAD``.

    Raises:
        UncommittedChangesError: files under :data:`CODE_FOLDERS` are changed, added or deleted and not
            committed (files git ignores, such as run output, aside), naming them.
        RuntimeError: the tree is no git checkout and ``FL_LIGHTNING_COMMIT`` is not set.
    """
    if os.environ.get("FL_LIGHTNING_COMMIT"):
        return os.environ["FL_LIGHTNING_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:  # a copy of the tree without its history
        raise RuntimeError(f"{ROOT} is not a git checkout: set FL_LIGHTNING_COMMIT to the commit its files are "
                           "(a clean copy's, as runs record it)") from error
    changed = subprocess.run(["git", "status", "--porcelain", "--", *CODE_FOLDERS], capture_output=True, text=True,
                             cwd=ROOT, check=True).stdout.splitlines()
    if changed:
        files = [line[3:] for line in changed]
        raise UncommittedChangesError(
            f"{len(files)} file(s) under {', '.join(f + '/' for f in CODE_FOLDERS)} are not committed "
            f"({', '.join(files[:5])}{', ...' if len(files) > 5 else ''}): a run records the commit it runs on, and "
            "these changes are in none. Commit them, or run from a clean checkout (git worktree add ../clean HEAD)")
    return head


def environment() -> dict[str, Any]:
    """What this process runs with, as a run records it: the versions of Python, torch, Lightning and
    numpy, torch's intra-op threads, CUDA's version (None on a CPU build), the machine, and the tree
    (``"clean"``: :func:`commit` found no uncommitted code; ``"FL_LIGHTNING_COMMIT"``: a copy of the tree
    named by that variable, which :func:`commit` cannot check)."""
    import platform

    import numpy
    import pytorch_lightning
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "lightning": pytorch_lightning.__version__,
            "numpy": numpy.__version__, "threads": torch.get_num_threads(), "cuda": torch.version.cuda,
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "tree": "FL_LIGHTNING_COMMIT" if os.environ.get("FL_LIGHTNING_COMMIT") else "clean"}


def record(name: str, commit: str, params: dict[str, Any], wall_s: float, history: list[dict[str, Any]],
           device: str) -> Run:
    """A run as a result file holds it: its name, the commit it ran on (:func:`commit`), the settings its
    tables group by, its wall time (rounded to 0.1 s), its evaluations, the device it trained on (``cpu``
    or ``cuda: <the card>``) and this process's :func:`environment`."""
    return {"name": name, "commit": commit, "params": params, "wall_s": round(wall_s, 1), "history": history,
            "device": device, "env": environment()}


def load(path: str | Path) -> list[Run]:
    """The runs of a result file, in file order (an absent file has none)."""
    path = Path(path)
    return json.loads(path.read_text())["runs"] if path.exists() else []


def save(path: str | Path, runs: Iterable[Run]) -> None:
    """Write ``runs`` to ``path``, one run per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(run, ensure_ascii=False) for run in runs)
    path.write_text('{"runs": [\n' + lines + "\n]}\n")


def add(path: str | Path, run: Run) -> None:
    """Add ``run`` to the file at ``path`` (replacing a run of the same name)."""
    runs = [r for r in load(path) if r["name"] != run["name"]]
    save(path, [*runs, run])


def select(runs: Iterable[Run], **params: Any) -> list[Run]:
    """The runs whose ``params`` have every given value."""
    return [r for r in runs if all(r["params"].get(k) == v for k, v in params.items())]


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """The rounds at which ``key`` was measured in ``run`` and its values."""
    points = [(h["round"], h[key]) for h in run["history"] if key in h]
    return [r for r, _ in points], [v for _, v in points]


def at_round(run: Run, key: str, round_number: int) -> float:
    """``key`` at evaluation ``round_number`` of ``run``."""
    for h in run["history"]:
        if h["round"] == round_number and key in h:
            return h[key]
    raise KeyError(f"{run['name']}: no {key} at round {round_number}")


def until(run: Run, end: int) -> Run:
    """``run`` with its evaluations up to round ``end``."""
    return {**run, "history": [p for p in run["history"] if p["round"] <= end]}


def last(run: Run, key: str) -> float:
    """The last measured value of ``key`` in ``run``."""
    return series(run, key)[1][-1]


def best_named(runs: Iterable[Run], names: Sequence[str], score: Callable[[Run], float]) -> Optional[int]:
    """The index in ``names`` of the run with the highest ``score`` (the first on ties; a run that
    diverged scores below any other), or None while one of the named runs is missing from ``runs``
    (a tuning's choice among complete candidates)."""
    by_name = {r["name"]: r for r in runs}
    if any(name not in by_name for name in names):
        return None
    scores = [float("-inf") if "diverged" in by_name[name] else score(by_name[name]) for name in names]
    return scores.index(max(scores))


def mean_of_last(run: Run, key: str, count: int) -> float:
    """The mean of the last ``count`` measured values of ``key`` in ``run``."""
    values = series(run, key)[1][-count:]
    if len(values) < count:
        raise ValueError(f"{run['name']}: {key} was measured {len(values)} times, fewer than {count}")
    return sum(values) / count
