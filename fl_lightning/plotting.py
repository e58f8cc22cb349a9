"""Plots of finished (or running) runs: metrics per round, and the partition's label distribution.

Reads the files ``RoundHistory`` writes into a run's log folder (``history.json`` and the rounds
only ``history.csv`` holds yet, ``partition.json``) and draws, with matplotlib (the ``[plot]`` extra):

* ``metrics.png``: one panel per metric, the round on the x-axis, one line per run, so several
  runs (algorithms, seeds) compare on one figure: each run has its own colour, dash and markers
  (placed at other rounds than the other runs'), so runs that logged the same values stay apart;
* ``partition.png``: a heatmap of every client's label counts (clients x classes, as
  flwr-datasets' ``plot_label_distributions`` draws), unseen clients marked with ``*``; only for
  class labels (a regression's ``partition.json`` holds no label counts).

From the shell::

    fl-lightning plot runs/quickstart                       # newest run under the folder
    fl-lightning plot runs/fedavg runs/scaffold --labels FedAvg SCAFFOLD --metrics val_acc val_loss

From Python: :func:`load_run`, :func:`plot_metrics`, :func:`plot_label_distribution`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from fl_lightning.callbacks.history import read_history
from fl_lightning.datamodules.targets import targets_in_words

#: metrics drawn by default, after the global validation metrics and the client's training ones (:func:`metric_names`)
DEFAULT_METRICS = ("round/client_loss",)
#: how the names of global validation metrics start (the client module names them: ``val_acc``, ``val/acc``)
VALIDATION_PREFIXES = ("val_", "val/", "valid_", "valid/", "validation_", "validation/")
#: how the names of the client module's own training metrics start (``train_loss``, ``train/mse``)
TRAINING_PREFIXES = ("train_", "train/")
#: the markers of the runs' lines, one per run (in turn), drawn hollow
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
#: about how many markers a run's line has (at most one a round)
MARKS_PER_LINE = 12
#: annotate the heatmap's cells with counts up to this many cells
ANNOTATE_CELLS = 400


@dataclass
class Run:
    """A run's history as written by ``RoundHistory``."""

    label: str
    folder: Path
    rows: list[dict[str, Any]]
    partition: Optional[dict[str, Any]]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'fl-lightning[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def find_history(path: str | Path) -> Path:
    """The folder holding ``history.json``: ``path`` itself, else the most recently written one
    below it (``runs/x`` finds ``runs/x/lightning_logs/version_3``)."""
    path = Path(path)
    if (path / "history.json").is_file():
        return path
    found = sorted(path.rglob("history.json"), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no history.json in or below {str(path)!r}: is it the folder of a run that used "
                                "RoundHistory (on by default in `fl-lightning fit`)?")
    return found[-1].parent


def load_run(path: str | Path, label: Optional[str] = None) -> Run:
    """Read the history (and the partition, when written) of the run in or below ``path``."""
    folder = find_history(path)
    rows = read_history(folder)
    partition_file = folder / "partition.json"
    partition = json.loads(partition_file.read_text()) if partition_file.is_file() else None
    return Run(label or str(path), folder, rows, partition)


def metric_names(runs: Sequence[Run]) -> list[str]:
    """The metrics drawn by default, from what the runs logged: the global validation metrics (names
    starting with one of :data:`VALIDATION_PREFIXES`: accuracies, then losses, then the others), the
    client module's own training metrics (:data:`TRAINING_PREFIXES`), the default metrics, then every
    mean over clients (``clients_val/acc_mean``, ``clients_val/mse_mean``...)."""
    logged = {name for run in runs for row in run.rows for name, value in row.items() if isinstance(value, float)}
    validation = sorted(name for name in logged if name.startswith(VALIDATION_PREFIXES))
    accuracies = [name for name in validation if "acc" in name.split("/")[-1]]
    losses = [name for name in validation if "loss" in name.split("/")[-1]]
    others = [name for name in validation if name not in accuracies and name not in losses]
    training = sorted(name for name in logged if name.startswith(TRAINING_PREFIXES))
    client_means = sorted(name for name in logged if "/" in name and name.endswith("_mean"))
    return (accuracies + losses + others + training + [name for name in DEFAULT_METRICS if name in logged]
            + client_means)


def plot_metrics(runs: Sequence[Run], path: str | Path, metrics: Optional[Sequence[str]] = None) -> Path:
    """One panel per metric, the value per round of each run; written to ``path`` (PNG)."""
    return _save(metrics_figure(runs, metrics), path)


def run_style(i: int, points: int) -> dict[str, Any]:
    """The line of run ``i`` (of a line of ``points`` points): its colour, dash and hollow marker,
    each in turn over the runs, the markers every ``points / MARKS_PER_LINE`` rounds from the
    ``i``-th: runs that logged the same values are drawn on top of each other and stay apart."""
    colors = _pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    every = max(1, math.ceil(points / MARKS_PER_LINE))
    return {"color": colors[i % len(colors)], "linestyle": ["-", "--", ":", "-."][i % 4],
            "marker": MARKERS[i % len(MARKERS)], "fillstyle": "none", "markevery": (i % every, every)}


def metrics_figure(runs: Sequence[Run], metrics: Optional[Sequence[str]] = None) -> Any:
    """The figure of :func:`plot_metrics` (matplotlib's), one panel per metric (default :func:`metric_names`)."""
    plt = _pyplot()
    metrics = list(metrics) if metrics else metric_names(runs)
    if not metrics:
        raise ValueError("the runs logged no metric to plot")
    unknown = [m for m in metrics if not any(m in row for run in runs for row in run.rows)]
    if unknown:
        available = sorted({k for run in runs for row in run.rows for k, v in row.items() if isinstance(v, float)})
        raise ValueError(f"metrics {unknown} were not logged by these runs; logged: {available}")
    cols = min(2, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows + 0.4), squeeze=False)
    lines = {}  # a run's colour and style are the same in every panel (also where another run has no points)
    for ax, name in zip(axes.flat, metrics):
        for i, run in enumerate(runs):
            points = [(row["round"], row[name]) for row in run.rows if isinstance(row.get(name), float)]
            if points:
                x, y = zip(*points)
                lines[i] = ax.plot(x, y, label=run.label, **run_style(i, len(points)))[0]
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    handles = [lines[i] for i in sorted(lines)]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=min(len(handles), 4),
               fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.3 * math.ceil(len(handles) / 4) / (3.6 * rows + 0.4), 1, 1))  # 0.3 in a legend row
    return fig


def plot_label_distribution(partition: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Heatmap of the label counts of every client's training split (``partition.json``)."""
    return _save(label_distribution_figure(partition, title), path)


def label_distribution_figure(partition: dict[str, Any], title: str = "") -> Any:
    """The figure of :func:`plot_label_distribution` (matplotlib's).

    Raises:
        ValueError: the partition holds no label counts (its targets are not class labels).
    """
    if "clients" not in partition:
        raise ValueError(f"the partition holds no label counts to draw: its targets are {targets_of(partition)}")
    plt = _pyplot()
    import numpy as np

    counts = np.asarray(partition["clients"], dtype=float)
    num_clients, num_classes = counts.shape
    unseen = set(partition.get("unseen_clients", []))
    fig, ax = plt.subplots(figsize=(min(2 + 0.5 * num_classes, 16), min(1.5 + 0.25 * num_clients, 16)))
    image = ax.imshow(counts, aspect="auto", cmap="Greens", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client (* unseen)" if unseen else "client")
    ax.set_title(title or f"{partition.get('datamodule', '')}: label counts per client")
    if num_clients <= 60:
        ax.set_yticks(range(num_clients), [f"{c}{'*' if c in unseen else ''}" for c in range(num_clients)],
                      fontsize="small")
    if num_classes <= 40:
        ax.set_xticks(range(num_classes))
    if num_clients * num_classes <= ANNOTATE_CELLS:
        top = counts.max() or 1.0
        for (c, k), n in np.ndenumerate(counts):
            if n:
                ax.text(k, c, int(n), ha="center", va="center", fontsize=6,
                        color="white" if n > 0.6 * top else "black")
    fig.tight_layout()
    return fig


def targets_of(partition: dict[str, Any]) -> str:
    """What a partition's targets are, in words (``partition.json``'s ``targets``)."""
    return targets_in_words(partition["targets"]) if "targets" in partition else "not class labels"


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    """``fl-lightning plot``: draw ``metrics.png`` and ``partition.png`` for one or more runs."""
    parser = argparse.ArgumentParser(
        prog="fl-lightning plot",
        description="Draw metrics per round (all runs on one figure) and the first run's partition.",
    )
    parser.add_argument("runs", nargs="+", help="run folders (a folder holding history.json, or one above it)")
    parser.add_argument("--labels", nargs="+", help="a legend label per run (default: the folders)")
    parser.add_argument("--metrics", nargs="+", help="metrics to draw (default: the global validation metrics as "
                        "logged (val_acc, val/loss, val/mse...), the client's training metrics (train_loss, "
                        "train/mse...), "
                        f"{', '.join(DEFAULT_METRICS)} and every mean over clients (clients_val/acc_mean...))")
    parser.add_argument("--out", help="output folder (default: <first run's folder>/plots)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels needs one label per run: {len(args.runs)} runs, {len(args.labels)} labels")
    labels = args.labels or [None] * len(args.runs)
    runs = [load_run(path, label) for path, label in zip(args.runs, labels)]
    out = Path(args.out) if args.out else runs[0].folder / "plots"
    written = [plot_metrics(runs, out / "metrics.png", args.metrics)]
    partition = runs[0].partition
    if partition is not None and "clients" in partition:
        written.append(plot_label_distribution(partition, out / "partition.png"))
    elif partition is not None:
        print(f"no partition.png: the targets are {targets_of(partition)}, without label counts")
    for path in written:
        print(f"wrote {path}")
    return written
