"""The MNIST tables of ``docs/results/pefll.md``, from the runs in its result file.

    python -m experiments.pefll.report [docs/results/pefll.json]

Accuracies in % are means over clients of each client's accuracy on its own split; spreads are
``mean ± sample std (ddof = 1) (min–max)`` over seeds.

* the tuning (``tune``): each table row's validation figure (seen clients) after the last round at
  each rate of its search, the chosen one in bold (:func:`experiments.pefll.plan.tuned`);
* Table 1 and 2's layout (``table``, and ``clients`` per federation size): per row, the seen and the
  unseen clients' test accuracy after the last round and at the round of best seen-client
  validation accuracy, beside the paper's CIFAR-10 figures with as many training clients; before
  the ``clients`` tables, the ``table`` runs up to the ``clients`` runs' length
  (:func:`at_client_round`), where each client has taken part as often as in those; after them the
  longer runs at n = 500 (``clients_long``);
* PeFLL minus each row, paired by seed, with 95 % confidence intervals, after the last round and at
  the round of best seen-client validation accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments import results
from experiments.pefll.plan import CHOICES, CLIENTS_ROUNDS, GRID, NUM_CLIENTS, RESULTS, rates, tuned
from experiments.seed_stats import best_validation, final, fmt, last_cell, paired

#: table row -> (label, the run's method, the prefix of its logged client figures)
ROWS = {
    "pefll": ("PeFLL", "pefll", "clients"),
    "pefll_nolabels": ("PeFLL, label-free embedding (Table 2)", "pefll_nolabels", "clients"),
    "pfedhn": ("pFedHN (unseen: 20 rounds of embedding fitting)", "pfedhn", "clients"),
    "fedavg": ("FedAvg", "fedavg", "clients"),
    "fedavg_ft": ("FedAvg + 50 finetuning steps", "fedavg", "finetuned"),
    "local": ("Local only (200 epochs)", "local", "clients"),
}
#: the paper's Table 1 (a) / (b) and 2, CIFAR-10: row -> {training clients: (seen, unseen)}
PAPER = {
    "pefll": {90: (89.0, 89.3), 450: (88.9, 88.9), 900: (87.8, 88.5)},
    "pefll_nolabels": {90: (None, 84.5), 450: (None, 83.6), 900: (None, 81.5)},
    "pfedhn": {90: (87.8, 63.3), 450: (77.4, 60.9), 900: (66.0, 57.8)},
    "fedavg": {90: (47.5, 48.6), 450: (50.4, 49.6), 900: (51.9, 51.7)},
    "local": {90: (82.2, 81.6), 450: (70.9, 70.6), 900: (65.5, 65.5)},
}


def keys(prefix: str) -> tuple[str, str, str]:
    """A row's validation, seen-test and unseen-test figures."""
    return f"{prefix}_val/acc_mean", f"{prefix}_test/acc_mean", f"{prefix}_unseen_test/acc_mean"


def chosen_runs(runs: list[results.Run], study: str, row: str, **params: object) -> list[results.Run]:
    """The runs of ``row`` in ``study`` at its chosen rate that ran all their rounds (seed order; a
    run a sweep's time limit stopped goes on from its checkpoint in the next sweep); none before
    the choice."""
    lr = tuned(runs).get("pefll" if row == "pefll_nolabels" else row)
    if lr is None:
        return []
    found = results.select(runs, study=study, method=ROWS[row][1], lr=lr, **params)
    return sorted((r for r in found if "stopped" not in r), key=lambda r: r["params"]["seed"])


def tune_table(runs: list[results.Run]) -> str:
    """Seen clients' validation accuracy (%) after the last round, per row and rate, the choice in bold."""
    chosen = tuned(runs)
    lines = ["| row (figure chosen on) | " + " | ".join(f"{g:g} x reference" for g in GRID) + " |",
             "|---" * (len(GRID) + 1) + "|"]
    for row, (method, key) in CHOICES.items():
        by_lr = {r["params"]["lr"]: r for r in results.select(runs, study="tune", method=method)}
        cells = []
        for lr in rates(method):
            cell = f"lr {lr:g}: {last_cell(by_lr.get(lr), key)}"
            cells.append(f"**{cell}**" if chosen.get(row) == lr else cell)
        lines.append(f"| {ROWS[row][0]} (`{key}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_cell(row: str, training_clients: int) -> str:
    seen, unseen = PAPER.get(row, {}).get(training_clients, (None, None))
    return " / ".join("–" if v is None else f"{v:.1f}" for v in (seen, unseen))


def comparison_table(runs: list[results.Run], study: str, num_clients: int) -> str:
    """Table 1's layout for one federation size: per row, over seeds."""
    lines = ["| method | lr | seeds | rounds | seen, final | unseen, final | seen, best val | unseen, best val | "
             "best-val round | paper (CIFAR-10) seen / unseen |", "|---" * 10 + "|"]
    for row, (label, _, prefix) in ROWS.items():
        group = chosen_runs(runs, study, row, num_clients=num_clients)
        if not group:
            continue
        val, seen, unseen = keys(prefix)
        best_seen, best_round = best_validation(group, val, seen)
        best_unseen, _ = best_validation(group, val, unseen)
        params = group[0]["params"]
        seen_clients = group[0]["summary"]["seen_clients"]
        rounds = group[0]["history"][-1]["round"]
        lines.append(f"| {label} | {params['lr']:g} | {len(group)} | {rounds} | {fmt(final(group, seen), 100)} | "
                     f"{fmt(final(group, unseen), 100)} | {fmt(best_seen, 100)} | {fmt(best_unseen, 100)} | "
                     f"{', '.join(str(r) for r in best_round)} | {paper_cell(row, seen_clients)} |")
    return "\n".join(lines)


def differences_table(runs: list[results.Run], study: str, num_clients: int) -> str:
    """PeFLL minus each other row, paired by seed (points), on the seen and the unseen clients, after
    the last round and at each run's round of best seen-client validation accuracy (as
    :func:`comparison_table`'s columns); empty before another row has runs."""
    ours = chosen_runs(runs, study, "pefll", num_clients=num_clients)
    lines = ["| PeFLL minus | seen, final: mean ± std [95 % CI] | unseen, final | seen, best val | unseen, best val |",
             "|---|---|---|---|---|"]
    for row, (label, _, prefix) in ROWS.items():
        theirs = chosen_runs(runs, study, row, num_clients=num_clients)
        if row == "pefll" or not ours or not theirs:
            continue
        (our_val, *our_tests), (their_val, *their_tests) = keys("clients"), keys(prefix)
        cells = [paired(ours, theirs, lambda g, k=a: final(g, k), lambda g, k=b: final(g, k))
                 for a, b in zip(our_tests, their_tests)]
        cells += [paired(ours, theirs, lambda g, k=a: best_validation(g, our_val, k)[0],
                         lambda g, k=b: best_validation(g, their_val, k)[0]) for a, b in zip(our_tests, their_tests)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def sizes(runs: list[results.Run], study: str) -> list[int]:
    return sorted({r["params"]["num_clients"] for r in results.select(runs, study=study)})


def at_client_round(run: results.Run, end: int) -> results.Run:
    """``run`` up to the round at which it has trained as many clients as ``end`` rounds of
    :func:`~experiments.pefll.plan.per_round` clients (pFedHN's server steps take one each; Local
    only's one round is all of it)."""
    params = run["params"]
    return run if params["method"] == "local" else results.until(run, end * params["rounds"] // params["client_rounds"])


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in order (none before the runs exist)."""
    out = []
    if results.select(runs, study="tune"):
        out.append(tune_table(runs))
    for n in sizes(runs, "table"):
        out += [comparison_table(runs, "table", n), differences_table(runs, "table", n)]
    if sizes(runs, "clients"):
        short = [at_client_round(r, CLIENTS_ROUNDS) if r["params"]["study"] == "table" else r for r in runs]
        out += [comparison_table(short, "table", NUM_CLIENTS), differences_table(short, "table", NUM_CLIENTS)]
    studies = {study: sizes(runs, study) for study in ("clients", "clients_long")}
    for n in sorted(set().union(*studies.values())):  # as the page: by size, the longer runs after the others
        out += [table(runs, study, n) for study, ns in studies.items() if n in ns
                for table in (comparison_table, differences_table)]
    return [table for table in out if table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    opts = parser.parse_args()
    print("\n\n".join(tables(results.load(opts.results))))


if __name__ == "__main__":
    main()
