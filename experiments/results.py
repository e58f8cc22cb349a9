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


def commit() -> str:
    """The project commit a run ran on: ``FL_LIGHTNING_COMMIT`` where set (a copy of the tree on another
    machine, whose ``.git``, if any, need not match its files), else ``git rev-parse HEAD`` with ``+``
    marking uncommitted changes to tracked files other than the result documents, ``docs/results/``,
    which runs only read."""
    if os.environ.get("FL_LIGHTNING_COMMIT"):
        return os.environ["FL_LIGHTNING_COMMIT"]
    root = Path(__file__).resolve().parents[1]  # whatever the working directory
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:  # a copy of the tree without its history
        raise RuntimeError(f"{root} is not a git checkout: set FL_LIGHTNING_COMMIT to the commit its files are "
                           "(a clean copy's, as runs record it)") from error
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results"],
                           capture_output=True, text=True, cwd=root).stdout
    return head + ("+" if dirty.strip() else "")


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
