"""The MNIST-ST tables and figure of ``docs/results/feddro.md``, from the runs in its result file.

    python -m experiments.feddro.report [docs/results/feddro.json] [--figure docs/results/feddro_mnist_st.png]

Accuracies in %; spreads are ``mean ± sample std (ddof = 1) (min–max)`` over the seeds that did not
diverge (a table names the others and the round each stopped in).

* the tuning (``tune``): each method's balanced validation accuracy after the last epoch at each
  rate, the chosen one in bold (:func:`experiments.feddro.plan.tuned`);
* the comparison (``table``), per method and lambda, after the last epoch: training accuracy (the
  paper's headline), test accuracy, balanced, worst-class and minority-class (0-4) test accuracy,
  the KL-DRO objective on the training data; the test accuracy at the best balanced validation;
  FedDRO minus each baseline at the same lambda, paired by seed, with 95 % confidence intervals
  (training, test and worst-class test accuracy after the last epoch, and the test accuracy at the
  best balanced validation);
* the local-steps study (``local_steps``): FedDRO's figures after the study's rounds, per I;
* the centralized test (``centralized``): FedDRO's balanced validation accuracy per rate on 8 clients
  (batch 16; the tuning's runs) and on one client (batch 128);
* the length test (``length``): each method's figures after ``LONG_EPOCHS`` epochs beside its
  ``EPOCHS``-epoch run of the comparison (seed 0, lambda 2), and the test accuracy at each run's
  best balanced validation;
* the paper's length (``paper_length``): the comparison's two tables for the runs of ``PAPER_EPOCHS``
  epochs, at the last round every run has reached (the runs advance together with
  ``--until-round``; a caption line says which epoch that is);
* the momentum test (``beta``): FedDRO's balanced validation accuracy, training accuracy (overall and
  worst class) and training KL-DRO objective after the last epoch per momentum and rate (beta 0.5:
  the tuning's runs).

``--figure`` draws training and test accuracy per epoch of each method at lambda 2 (mean over seeds).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import numpy as np

from experiments import results
from experiments.feddro.plan import (BETAS, CONFIG_BETA, EPOCHS, LONG_EPOCHS, LRS, METHODS, PAPER_EPOCHS, RESULTS,
                                     STEPS_PER_EPOCH, SWEEP_ROUNDS, TUNE_LAM, tuned)
from experiments.seed_stats import best_validation, final, finished, fmt, last_cell, paired, series

NAMES = {"feddro": "FedDRO", "compfedavg": "MBSGD (Alg. 1 case I)", "fastdro": "FastDRO (CVaR 0.1, centralized)",
         "pdsgd": "PDSGD (centralized)", "fedavg": "FedAvg (ERM)"}
MINORITY = range(5)


def minority(group: list[results.Run]) -> np.ndarray:
    """Per seed, the mean test accuracy of the minority classes after the last epoch."""
    return np.array([np.mean([r["history"][-1][f"test_acc_class{c}"] for c in MINORITY]) for r in group])


def groups(runs: list[results.Run], study: str, **params: Any) -> dict[tuple[str, Optional[float]], list[results.Run]]:
    """(method, lambda) -> the runs of ``study`` (seed order), in :data:`METHODS` order."""
    out = {}
    for method in METHODS:
        found = results.select(runs, study=study, method=method, **params)
        for lam in sorted({r["params"]["lam"] for r in found}, key=lambda v: -1 if v is None else v):
            out[method, lam] = sorted(results.select(found, lam=lam), key=lambda r: r["params"]["seed"])
    return out


def label(method: str, lam: Optional[float]) -> str:
    return NAMES[method] + ("" if lam is None else f", λ {lam:g}")


def tune_table(runs: list[results.Run]) -> str:
    """Balanced validation accuracy (%) after the last epoch per method and rate, the choice in bold."""
    chosen = tuned(runs)
    lines = [f"| method (λ {TUNE_LAM:g} where it has one) | " + " | ".join(f"lr {lr:g}" for lr in LRS) + " |",
             "|---" * (len(LRS) + 1) + "|"]
    for (method, _), group in groups(runs, "tune").items():
        by_lr = {r["params"]["lr"]: r for r in group}
        cells = []
        for lr in LRS:
            text = last_cell(by_lr.get(lr), "val_acc_balanced")
            cells.append(f"**{text}**" if chosen.get(method) == lr else text)
        lines.append(f"| {NAMES[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_table(runs: list[results.Run], study: str = "table") -> str:
    """Per method and lambda, after the last epoch, over the seeds that did not diverge."""
    lines = ["| method | lr | seeds | train acc | test acc | test balanced | test worst class | test minority (0-4) | "
             "train KL-DRO objective | test acc at best val |", "|---" * 10 + "|"]
    for (method, lam), everyone in groups(runs, study).items():
        group, seeds = finished(everyone)
        if not group:
            lines.append(f"| {label(method, lam)} | {everyone[0]['params']['lr']:g} | {seeds} |" + " – |" * 7)
            continue
        lines.append(f"| {label(method, lam)} | {group[0]['params']['lr']:g} | {seeds} | "
                     f"{fmt(final(group, 'train_acc'), 100)} | {fmt(final(group, 'test_acc'), 100)} | "
                     f"{fmt(final(group, 'test_acc_balanced'), 100)} | {fmt(final(group, 'test_acc_worst_class'), 100)} | "
                     f"{fmt(minority(group), 100)} | {fmt(final(group, 'train_kl_dro'), 1, 4, 'g')} | "
                     f"{fmt(at_best_validation(group), 100)} |")
    return "\n".join(lines)


def at_best_validation(group: list[results.Run]) -> np.ndarray:
    """Per seed, the test accuracy at the epoch of the best balanced validation accuracy."""
    return best_validation(group, "val_acc_balanced")[0]


def differences_table(runs: list[results.Run], study: str = "table") -> str:
    """FedDRO minus each baseline at the same lambda (or the lambda-free baselines), paired over the
    seeds where neither diverged: after the last epoch, and the test accuracy at the best validation."""
    table = {key: finished(group)[0] for key, group in groups(runs, study).items()}
    lines = ["| FedDRO minus (points) | train acc: mean ± std [95 % CI] | test acc | test worst class | "
             "test acc at best val |", "|---|---|---|---|---|"]
    for (method, lam), ours in table.items():
        if method != "feddro":
            continue
        for (other, other_lam), theirs in table.items():
            if other == "feddro" or other_lam not in (None, lam) or not ours or not theirs:
                continue
            cells = [paired(ours, theirs, lambda g, k=key: final(g, k)) for key in ("train_acc", "test_acc", "test_acc_worst_class")]
            cells.append(paired(ours, theirs, at_best_validation))
            lines.append(f"| {label(other, other_lam)} (FedDRO λ {lam:g}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def local_steps_table(runs: list[results.Run]) -> str:
    """FedDRO after ``SWEEP_ROUNDS`` model-averaging rounds, per I, over seeds."""
    lines = [f"| I | local steps (epochs) in {SWEEP_ROUNDS} rounds | seeds | train acc | test acc | test worst class |",
             "|---|---|---|---|---|---|"]
    found = results.select(runs, study="local_steps")
    for i in sorted({r["params"]["local_steps"] for r in found}):
        group, seeds = finished(sorted(results.select(found, local_steps=i), key=lambda r: r["params"]["seed"]))
        steps = i * SWEEP_ROUNDS
        if not group:
            lines.append(f"| {i} | {steps} ({steps / STEPS_PER_EPOCH:.2f}) | {seeds} | – | – | – |")
            continue
        lines.append(f"| {i} | {steps} ({steps / STEPS_PER_EPOCH:.2f}) | {seeds} | {fmt(final(group, 'train_acc'), 100)} | "
                     f"{fmt(final(group, 'test_acc'), 100)} | {fmt(final(group, 'test_acc_worst_class'), 100)} |")
    return "\n".join(lines)


def centralized_table(runs: list[results.Run]) -> str:
    """FedDRO's balanced validation accuracy (%) after the last epoch per rate, federated and centralized."""
    lines = [f"| FedDRO, λ {TUNE_LAM:g}, seed 0 | " + " | ".join(f"lr {lr:g}" for lr in LRS) + " |", "|---" * (len(LRS) + 1) + "|"]
    for label, study in (("8 clients, batch 16 (the tuning)", "tune"), ("1 client, batch 128", "centralized")):
        by_lr = {r["params"]["lr"]: r for r in results.select(runs, study=study, method="feddro")}
        cells = [last_cell(by_lr.get(lr), "val_acc_balanced") for lr in LRS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def beta_table(runs: list[results.Run]) -> str:
    """FedDRO (lambda 2, seed 0) after the last epoch per momentum and rate; beta 0.5 is the tuning's."""
    lines = ["| FedDRO, λ 2, seed 0: beta | lr | balanced val acc | train acc | train worst class | train KL-DRO objective |",
             "|---|---|---|---|---|---|"]
    for beta in sorted(BETAS + (CONFIG_BETA,)):
        for lr in LRS[1:]:
            found = (results.select(runs, study="tune", method="feddro", lr=lr) if beta == CONFIG_BETA
                     else results.select(runs, study="beta", beta=beta, lr=lr))
            run = found[0] if found else None
            cells = [last_cell(run, key) for key in ("val_acc_balanced", "train_acc", "train_acc_worst_class")]
            cells.append(last_cell(run, "train_kl_dro", 1, ".4f"))
            lines.append(f"| {beta:g}{' (the config)' if beta == CONFIG_BETA else ''} | {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def length_table(runs: list[results.Run]) -> str:
    """Per method (seed 0, lambda 2 where it has one), after the last epoch of its comparison run and
    of its long run, and each run's test accuracy at its best balanced validation."""
    keys = ("train_acc", "test_acc", "test_acc_worst_class")
    lines = ["| method, seed 0 | epochs | train acc | test acc | test worst class | train KL-DRO objective | "
             "test acc at best val |", "|---|---|---|---|---|---|---|"]
    for long in results.select(runs, study="length"):
        method, lam = long["params"]["method"], long["params"]["lam"]
        short = results.select(runs, study="table", method=method, lam=lam, seed=0)
        for run, epochs in ((short[0] if short else None, EPOCHS), (long, LONG_EPOCHS)):
            cells = [last_cell(run, k) for k in keys] + [last_cell(run, "train_kl_dro", 1, ".4g")]
            cells.append("–" if run is None else f"{100 * at_best_validation([run])[0]:.2f}")
            lines.append(f"| {label(method, lam)} | {epochs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def at_common_round(runs: list[results.Run]) -> tuple[list[results.Run], int]:
    """The runs with their histories cut at the last round that every run which did not diverge has
    reached (long runs advanced together, a session at a time, with ``--until-round``), and that round."""
    going = [r for r in runs if "diverged" not in r and r["history"]]
    last = min(r["history"][-1]["round"] for r in going) if going else 0
    return [r if "diverged" in r else dict(r, history=[h for h in r["history"] if h["round"] <= last])
            for r in runs], last


def paper_length_tables(runs: list[results.Run]) -> list[str]:
    """The comparison's tables for the ``paper_length`` runs at their common round, with a caption
    line naming its epoch of ``PAPER_EPOCHS``."""
    cut, last = at_common_round(results.select(runs, study="paper_length"))
    caption = f"epoch {last / STEPS_PER_EPOCH:g} of {PAPER_EPOCHS} (round {last})"
    return [f"{caption}\n\n{comparison_table(cut, 'paper_length')}", differences_table(cut, "paper_length")]


def tables(runs: list[results.Run]) -> list[str]:
    """Every MNIST-ST table of the document, in order (none before the runs exist)."""
    out = []
    if results.select(runs, study="tune"):
        out.append(tune_table(runs))
    if results.select(runs, study="table"):
        out += [comparison_table(runs), differences_table(runs)]
    if results.select(runs, study="local_steps"):
        out.append(local_steps_table(runs))
    if results.select(runs, study="centralized"):
        out.append(centralized_table(runs))
    if results.select(runs, study="length"):
        out.append(length_table(runs))
    if results.select(runs, study="beta"):
        out.append(beta_table(runs))
    if results.select(runs, study="paper_length"):
        out += paper_length_tables(runs)
    return out


def plot(runs: list[results.Run], path: Path) -> None:
    """Training and test accuracy per epoch of each method at lambda 2 (or without one), mean over seeds."""
    from experiments.plots import plt, save

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for (method, lam), everyone in groups(runs, "table").items():
        group = finished(everyone)[0]
        if lam not in (None, TUNE_LAM) or not group:
            continue
        for ax, key in zip(axes, ("train_acc", "test_acc")):
            rounds, values = series(group, key)
            ax.plot(rounds / (STEPS_PER_EPOCH / group[0]["params"]["local_steps"]), 100 * values.mean(0),
                    label=label(method, lam))
    for ax, name in zip(axes, ("training", "test")):
        ax.set(xlabel="epoch", ylabel=f"{name} accuracy (%)", title=f"MNIST-ST, {name} accuracy, mean over seeds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figure", type=Path, help="write the curves to this PNG")
    opts = parser.parse_args()
    runs = results.load(opts.results)
    print("\n\n".join(tables(runs)))
    if opts.figure and results.select(runs, study="table"):
        plot(runs, opts.figure)


if __name__ == "__main__":
    main()
