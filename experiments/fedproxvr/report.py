"""The tables and figures of ``docs/results/fedproxvr.md``, from the runs in its result file.

    python -m experiments.fedproxvr.report [docs/results/fedproxvr.json] [--figures docs/results]

* the learning-rate searches (``table1_tune``, ``table2_tune``): each method's validation accuracy
  after the last round at every rate of the grid, and the rate chosen
  (``experiments.fedproxvr.plan.tuned_lrs``);
* per study (``table1``, and each setting of ``fig2`` and ``fig3``): a summary per method over seeds
  (final test accuracy; test accuracy at the evaluation with the best validation accuracy; training
  loss), the training loss and the test accuracy at 8 evaluations, for ``table1`` and the settings
  of ``fig2`` and ``fig3`` the differences between methods, paired by seed, with their 95 %
  confidence intervals (Student's t over the seeds), and for the mu studies the stability of the
  training loss;
* ``table1_long``: as ``table1``, at the paper's round count, over the seeds that ran;
* ``table1_same_work``: Table 1's methods and FedAvg at SVRG's local work after the rounds it ran,
  with the differences to it paired by seed;
* ``table2``: as ``table1``, at the last round every run reached (a sweep's time limit stopped them),
  and each row at the last round all of its seeds reached;
* ``table2_sarah_lr``: SARAH at smaller step sizes beside Table 2's rows, at the last round all of
  its runs reached, with the differences to FedAvg paired by seed;
* ``table2_tuned``: as ``table2``, each row at the step size its search chose;
* Fig. 3's diagnosis (``experiments.fedproxvr.estimator_error``): the estimators' error along a round.

A study whose runs stopped at different rounds is reported at the last round all of them reached.

Spreads are ``mean ± sample std (ddof = 1) (min–max)`` over seeds. ``--figures DIR`` draws
``fedproxvr_<study>.png`` (mean over seeds, band: min–max).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

from experiments import results
from experiments.fedproxvr.estimator_error import RESULT as ESTIMATOR_ERROR, aggregate_table, table as estimator_error_table
from experiments.fedproxvr.plan import FIG2, RESULTS, TUNINGS, tuned_lrs
from experiments.seed_stats import Groups, best_validation, curve_table, final, fmt, paired, paired_interval, series

#: the paired differences the document reports: (row, against)
PAIRS = (("FedProxVR (SVRG)", "FedAvg"), ("FedProxVR (SARAH)", "FedAvg"), ("FedProxVR (SARAH)", "FedProxVR (SVRG)"))
#: the studies' order in the report, the document's (a study's settings in the plan's order)
STUDY_ORDER = ("table1", "table1_same_work", "table1_long", "fig2", "mu", "mu_n100_r400", "table2", "table2_sarah_lr",
               "table2_tuned", "fig3")
#: the rows' order in every table (others after them, in the result file's order): the baseline, then the
#: two estimators, whatever order a parallel sweep recorded them in
ROW_ORDER = ("FedAvg", "FedProxVR (SVRG)", "FedProxVR (SARAH)")


def studies(runs: list[results.Run], cut: bool = True) -> dict[str, Groups]:
    """study (``fig2/<setting>``, ``fig3/<setting>`` for the settings of Figs. 2-3; in :data:`STUDY_ORDER`)
    -> row label (in :data:`ROW_ORDER`) -> runs (seeds, in seed order),
    with ``cut`` each study's runs cut to the last round all of them reached (:func:`common_round`)."""
    def row(run: results.Run) -> tuple[int, int]:
        label = run["params"]["label"]
        return ROW_ORDER.index(label) if label in ROW_ORDER else len(ROW_ORDER), run["params"]["seed"]

    def position(study: str) -> tuple[int, int]:
        base, _, setting = study.partition("/")
        return (STUDY_ORDER.index(base) if base in STUDY_ORDER else len(STUDY_ORDER),
                list(FIG2).index(setting) if setting in FIG2 else 0)

    grouped: dict[str, Groups] = defaultdict(lambda: defaultdict(list))
    for run in sorted(runs, key=row):
        p = run["params"]
        if not p["study"].endswith("_tune"):
            grouped[p["study"] + (f"/{p['setting']}" if "setting" in p else "")][p["label"]].append(run)
    out = dict(sorted(grouped.items(), key=lambda item: position(item[0])))
    if cut:
        for groups in out.values():
            end = common_round([r for group in groups.values() for r in group])
            for label, group in groups.items():
                groups[label] = [results.until(r, end) for r in group]
    return out


def common_round(runs: list[results.Run]) -> int:
    """The last evaluated round that every one of ``runs`` reached (a sweep's time limit stops runs
    at different rounds)."""
    return min(r["history"][-1]["round"] for r in runs)


def reached_table(groups: Groups) -> str:
    """Runs that a time limit stopped: per row, the rounds its seeds reached, and its figures at the
    last round all of its seeds reached."""
    lines = ["| algorithm | step size | seeds | rounds reached (of planned) | common round | test acc (%) there | "
             "test acc at best val (%), up to there | train loss there | wall s / run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, runs in groups.items():
        reached = [r["history"][-1]["round"] for r in runs]
        end = common_round(runs)
        cut = [results.until(r, end) for r in runs]
        at_best, _ = best_validation(cut)
        lines.append(
            f"| {label} | {runs[0]['params']['lr']} | {len(runs)} | {min(reached)}–{max(reached)} "
            f"(of {runs[0]['params']['rounds']}) | {end} | {fmt(final(cut), 100)} | {fmt(at_best, 100)} | "
            f"{fmt(final(cut, 'train_loss'), digits=4)} | {np.mean([r['wall_s'] for r in runs]):.0f} |")
    return "\n".join(lines)


def sarah_lr_table(runs: list[results.Run]) -> str:
    """Table 2's setting at the last round every ``table2_sarah_lr`` run reached: SARAH at the smaller
    step sizes, beside Table 2's rows (their step sizes from beta) on the same seeds; test-accuracy
    differences to FedAvg paired by seed."""
    extra = results.select(runs, study="table2_sarah_lr")
    end = common_round(extra)
    seeds = sorted({r["params"]["seed"] for r in extra})
    rows = {label: [r for r in group if r["params"]["seed"] in seeds]
            for label, group in studies(runs, cut=False)["table2"].items()}
    rows |= studies(extra, cut=False)["table2_sarah_lr"]
    lines = [f"| after round {end}, seeds {', '.join(map(str, seeds))} | step size | test acc (%) | train loss | "
             "largest rise of the train loss between evaluations | test acc − FedAvg (points): mean ± std [95 % CI] |",
             "|---|---|---|---|---|---|"]

    def accuracy(group: list[results.Run]) -> np.ndarray:
        return np.array([results.at_round(r, "test_acc", end) for r in group])

    for label, group in rows.items():
        loss = np.array([results.at_round(r, "train_loss", end) for r in group])
        rise = np.array([np.diff([p["train_loss"] for p in results.until(r, end)["history"]]).max() for r in group])
        cell = "-" if label == "FedAvg" else paired(group, rows["FedAvg"], accuracy)
        acc = accuracy(group)
        lines.append(f"| {label} | {group[0]['params']['lr']} | {fmt(acc, 100)} | {fmt(loss, digits=4, style='g')} | "
                     f"{fmt(rise, digits=3, style='g')} | {cell} |")
    return "\n".join(lines)


def tune_table(runs: list[results.Run], table: str = "table1") -> str:
    """``table``'s step-size search (:data:`~experiments.fedproxvr.plan.TUNINGS`): validation accuracy
    (%) after the last round, per rate and method (``-``: not run, or stopped); the chosen rate in bold."""
    study, methods, grid = TUNINGS[table]
    tune = {(r["params"]["method"], r["params"]["lr"]): r for r in results.select(runs, study=study)
            if "stopped" not in r}
    chosen = tuned_lrs(runs, table)
    rounds = results.select(runs, study=study)[0]["params"]["rounds"]
    lines = ["| step size | " + " | ".join(f"{spec[0]}: val acc (%) after round {rounds}" for spec in methods.values()) + " |",
             "|---" * (len(methods) + 1) + "|"]
    for lr in grid:
        cells = []
        for method in methods:
            acc = f"{100 * results.last(tune[method, lr], 'val_acc'):.2f}" if (method, lr) in tune else "-"
            cells.append(f"**{acc}**" if chosen.get(method) == lr else acc)
        lines.append(f"| {lr} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(groups: Groups) -> str:
    first = next(iter(groups.values()))[0]
    lines = [
        f"rounds={first['history'][-1]['round']} clients={first['summary']['train_sizes']['clients']} "
        f"train samples={first['summary']['train_sizes']['total']} test samples={first['summary']['test_samples']}",
        "",
        "| algorithm | step size | seeds | final test acc (%) | test acc at best val (%) | round of best val | "
        "final train loss | wall s / run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in groups.items():
        _, acc = series(runs, "test_acc")
        _, loss = series(runs, "train_loss")
        at_best, best_round = best_validation(runs)
        lines.append(
            f"| {label} | {runs[0]['params']['lr']} | {len(runs)} | {fmt(acc[:, -1], 100)} | {fmt(at_best, 100)} | "
            f"{best_round.mean():.0f} | {fmt(loss[:, -1], digits=4)} | {np.mean([r['wall_s'] for r in runs]):.0f} |"
        )
    return "\n".join(lines)


def differences_table(groups: Groups) -> Optional[str]:
    """Paired (same seed) differences of test accuracy, in points, with 95 % confidence intervals, over
    the seeds both rows ran (a pair with fewer than two is left out; None without a pair)."""
    header = ["| difference (points) | seeds | final test acc: mean ± std | 95 % CI | at best val: mean ± std | 95 % CI |",
              "|---|---|---|---|---|---|"]
    lines = []
    for row, against in PAIRS:
        if row not in groups or against not in groups:
            continue
        seeds = {r["params"]["seed"] for r in groups[row]} & {r["params"]["seed"] for r in groups[against]}
        if len(seeds) < 2:
            continue
        a, b = ([r for r in groups[name] if r["params"]["seed"] in seeds] for name in (row, against))
        cells = []
        for measure in (final, lambda runs: best_validation(runs)[0]):
            diff = 100 * (measure(a) - measure(b))
            low, high = paired_interval(diff)
            cells += [f"{diff.mean():+.2f} ± {diff.std(ddof=1):.2f}", f"[{low:+.2f}, {high:+.2f}]"]
        lines.append(f"| {row} − {against} | {len(a)} | " + " | ".join(cells) + " |")
    return "\n".join(header + lines) if lines else None


def fluctuation(losses: np.ndarray, start: int) -> np.ndarray:
    """Per seed: std of the changes of the training loss between evaluations, from point ``start`` on."""
    return np.diff(losses[:, start:], axis=1).std(axis=1)


def stability_table(groups: Groups, start: int = 5, early: int = 5) -> str:
    """The mu study's question, whether the training loss diverges or settles: the loss at round 0,
    at the first evaluation from round ``early`` on, at the end, its maximum, and its fluctuation
    from the first evaluation at or after round ``start`` (the header names the rounds used)."""
    rounds, _ = series(next(iter(groups.values())), "train_loss")
    e, s = int(np.searchsorted(rounds, early)), int(np.searchsorted(rounds, start))
    lines = [
        f"| algorithm | train loss round 0 | train loss round {rounds[e]} | final train loss | max train loss after round 0 | "
        f"fluctuation (std of the change between evaluations, rounds {rounds[s]}+) |",
        "|---|---|---|---|---|---|",
    ]
    for label, runs in groups.items():
        _, loss = series(runs, "train_loss")
        lines.append(
            f"| {label} | {loss[:, 0].mean():.3f} | {fmt(loss[:, e], digits=3)} | {fmt(loss[:, -1], digits=3)} | "
            f"{fmt(loss[:, 1:].max(axis=1), digits=3)} | {fmt(fluctuation(loss, s), digits=4)} |"
        )
    return "\n".join(lines)


def same_work_table(runs: list[results.Run]) -> str:
    """Table 1's methods and FedAvg at SVRG's local work (``table1_same_work``), all at the round the
    latter ran to: test accuracy and training loss, and the test-accuracy differences paired by seed."""
    extra = results.select(runs, study="table1_same_work")
    rounds = extra[0]["params"]["rounds"]
    rows = studies([r for r in runs if r["params"]["study"] in ("table1", "table1_same_work")])
    groups = {label: group for study in ("table1", "table1_same_work") for label, group in rows[study].items()}
    seeds = [r["params"]["seed"] for r in extra]
    lines = [f"| after round {rounds} | seeds | test acc (%) | train loss | test acc − FedAvg at tau 20, B 32 (points): "
             "mean ± std [95 % CI] |", "|---|---|---|---|---|"]
    reference = sorted(extra, key=lambda r: r["params"]["seed"])

    def accuracy(group: list[results.Run]) -> np.ndarray:
        return np.array([results.at_round(r, "test_acc", rounds) for r in group])

    for label, group in groups.items():
        group = [r for r in group if r["params"]["seed"] in seeds]
        acc = accuracy(group)
        loss = np.array([results.at_round(r, "train_loss", rounds) for r in group])
        cell = "-" if label == extra[0]["params"]["label"] else paired(group, reference, accuracy)
        lines.append(f"| {label} (step size {group[0]['params']['lr']}) | {len(group)} | {fmt(acc, 100)} | "
                     f"{fmt(loss, digits=4)} | {cell} |")
    return "\n".join(lines)


def sections(runs: list[results.Run], estimator_error: Optional[Path] = ESTIMATOR_ERROR) -> dict[str, list[str]]:
    """Every table of the document, per study (a search under its own study's name), in its order; last,
    Fig. 3's diagnosis from its result file ``estimator_error`` where there is one."""
    out = {study: [tune_table(runs, table)] for table, (study, _, _) in TUNINGS.items()
           if results.select(runs, study=study)}
    whole = studies(runs, cut=False)
    for study, groups in studies(runs).items():
        if study == "table1_same_work":
            out[study] = [same_work_table(runs)]
            continue
        if study == "table2_sarah_lr":
            out[study] = [sarah_lr_table(runs)]
            continue
        out[study] = [summary_table(groups)]
        if any("stopped" in r for group in whole[study].values() for r in group):
            out[study] += [reached_table(whole[study])]
        paired_study = study in ("table1", "table1_long", "table2", "table2_tuned") or study.startswith(("fig2/", "fig3/"))
        differences = differences_table(groups) if paired_study else None
        if differences:
            out[study] += [differences]
        if study.startswith("mu"):
            out[study] += [stability_table(groups)]
        out[study] += [curve_table(groups, "train_loss", 1.0), curve_table(groups, "test_acc", 100.0)]
    if estimator_error is not None and estimator_error.exists():
        diagnosis = json.loads(estimator_error.read_text())
        out["estimator_error"] = [estimator_error_table(diagnosis)]
        if diagnosis.get("aggregates"):
            out["estimator_error"] += [aggregate_table(diagnosis)]
    return out


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in its order."""
    return [table for parts in sections(runs).values() for table in parts]


def plot(groups: Groups, title: str, path: Path) -> None:
    """Training loss (log scale) and test accuracy per round, mean over seeds, band min–max."""
    from experiments.plots import plt, save

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, runs in groups.items():
        for ax, key, scale in ((axes[0], "train_loss", 1.0), (axes[1], "test_acc", 100.0)):
            rounds, v = series(runs, key)
            v = v * scale
            line, = ax.plot(rounds, v.mean(0), label=f"{label} (lr {runs[0]['params']['lr']})")
            ax.fill_between(rounds, v.min(0), v.max(0), color=line.get_color(), alpha=0.2)
    axes[0].set(xlabel="round", ylabel="training loss (global model, log scale)", title=title, yscale="log")
    axes[1].set(xlabel="round", ylabel="test accuracy (%)", title="mean over seeds, band = min–max")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, help="folder for fedproxvr_<study>.png")
    opts = parser.parse_args(argv)
    runs = results.load(opts.results)
    print("\n\n".join(f"<!-- {study} -->\n\n" + "\n\n".join(parts) for study, parts in sections(runs).items()))
    if opts.figures:
        for study, groups in studies(runs).items():
            if study in ("table1_same_work", "table2_sarah_lr"):
                continue
            plot(groups, study, opts.figures / f"fedproxvr_{study.replace('/', '_')}.png")


if __name__ == "__main__":
    main()
