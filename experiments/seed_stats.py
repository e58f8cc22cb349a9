"""Figures over seeds for the result documents' tables: a metric's series per seed, its spread,
the test accuracy at the best validation, and confidence intervals of paired differences.

A group is a list of runs of one setting, one per seed, in seed order, all evaluated at the same
rounds (:mod:`experiments.results`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from experiments import results

Groups = dict[str, list[results.Run]]
"""Row label -> its runs (one per seed, in seed order)."""


def series(runs: list[results.Run], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Rounds and a [seeds, points] array of ``key``."""
    rounds = np.array([h["round"] for h in runs[0]["history"]])
    return rounds, np.array([[h[key] for h in r["history"]] for r in runs])


def fmt(values: np.ndarray, scale: float = 1.0, digits: int = 2, style: str = "f") -> str:
    """``mean ± std (min–max)`` over seeds, each with ``digits`` after the point (``style`` "f") or
    significant (``style`` "g": for figures that can span orders of magnitude); ``value (1 seed)``
    for one seed, which has no spread."""
    v = np.asarray(values) * scale
    spec = f".{digits}{style}"
    if len(v) == 1:
        return f"{v[0]:{spec}} (1 seed)"
    return f"{v.mean():{spec}} ± {v.std(ddof=1):{spec}} ({v.min():{spec}}–{v.max():{spec}})"


def last_cell(run: Optional[results.Run], key: str, scale: float = 100.0, spec: str = ".2f") -> str:
    """A table cell: ``key`` (times ``scale``: %, by default) at the last evaluation of ``run`` in
    format ``spec``, ``diverged (round r)`` for a run that diverged, ``–`` for a run not there yet."""
    if run is None:
        return "–"
    if "diverged" in run:
        return f"diverged ({run['diverged'].split(':')[0]})"
    return f"{scale * results.last(run, key):{spec}}"


def finished(group: list[results.Run]) -> tuple[list[results.Run], str]:
    """The runs of ``group`` that did not diverge, and a table cell for the seeds: their count, and
    each diverged seed with the round it stopped in."""
    done = [r for r in group if "diverged" not in r]
    gone = [f"seed {r['params']['seed']} diverged ({r['diverged'].split(':')[0]})" for r in group if "diverged" in r]
    return done, str(len(done)) + (f" ({'; '.join(gone)})" if gone else "")


def best_validation(runs: list[results.Run], val_key: str = "val_acc",
                    test_key: str = "test_acc") -> tuple[np.ndarray, np.ndarray]:
    """Per seed: the test figure ``test_key`` at the evaluation with the highest validation figure
    ``val_key`` (the first such), and that round."""
    rounds, val = series(runs, val_key)
    _, test = series(runs, test_key)
    pick = val.argmax(axis=1)
    return test[np.arange(len(runs)), pick], rounds[pick]


#: what the reports need beyond fl-lightning's own dependencies, and how to install it
EXTRA = 'the "experiments" extra (pip install -e ".[experiments]")'


def scipy_stats() -> Any:
    """:mod:`scipy.stats`, which the confidence intervals need.

    Raises:
        ModuleNotFoundError: scipy is not installed; the message names the extra that brings it.
    """
    try:
        from scipy import stats
    except ModuleNotFoundError as missing:
        raise ModuleNotFoundError(f"the experiments' reports compute confidence intervals with scipy, "
                                  f"which fl-lightning does not install: install {EXTRA}") from missing
    return stats


def paired_interval(diff: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` confidence interval of the mean of paired differences (Student's t, n - 1 dof).

    Raises:
        ModuleNotFoundError: scipy is not installed (:func:`scipy_stats`).
    """
    half = scipy_stats().t.ppf(0.5 + level / 2, len(diff) - 1) * diff.std(ddof=1) / np.sqrt(len(diff))
    return diff.mean() - half, diff.mean() + half


def paired(a: list[results.Run], b: list[results.Run], measure: Callable[[list[results.Run]], np.ndarray],
           measure_b: Optional[Callable[[list[results.Run]], np.ndarray]] = None) -> str:
    """``measure(a) - measure_b(b)`` (default ``measure``) over the seeds both groups ran, each seed's
    run of ``a`` against the same seed's of ``b`` whatever the groups' order, in points:
    ``mean ± std [95 % CI]`` (the interval needs two seeds)."""
    seeds = sorted({r["params"]["seed"] for r in a} & {r["params"]["seed"] for r in b})
    a, b = (sorted((r for r in g if r["params"]["seed"] in seeds), key=lambda r: r["params"]["seed"]) for g in (a, b))
    diff = 100 * (measure(a) - (measure_b or measure)(b))
    if len(diff) < 2:
        return f"{diff.mean():+.2f} (1 seed)"
    low, high = paired_interval(diff)
    return f"{diff.mean():+.2f} ± {diff.std(ddof=1):.2f} [{low:+.2f}, {high:+.2f}]"


def final(group: list[results.Run], key: str = "test_acc") -> np.ndarray:
    """Per seed, ``key`` at the last evaluation."""
    return series(group, key)[1][:, -1]


def curve_table(groups: Groups, key: str, scale: float, points: int = 8, rounds: Optional[Sequence[int]] = None,
                digits: int = 3) -> str:
    """``key`` (mean ± sample std over seeds) at ``points`` evaluations spread over the run, or at the
    evaluated ``rounds`` given, one row per round and a column per group."""
    labels = list(groups)
    evaluated, _ = series(groups[labels[0]], key)
    picks = (np.unique(np.linspace(0, len(evaluated) - 1, points).round().astype(int)) if rounds is None
             else [list(evaluated).index(r) for r in rounds])
    lines = ["| round | " + " | ".join(f"{label}: {key}" for label in labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for i in picks:
        cells = []
        for label in labels:
            _, v = series(groups[label], key)
            std = v[:, i].std(ddof=1) * scale if len(v) > 1 else 0
            cells.append(f"{v[:, i].mean() * scale:.{digits}f} ± {std:.{digits}f}")
        lines.append(f"| {evaluated[i]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
