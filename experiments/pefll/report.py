"""The tables of ``docs/results/pefll.md``, from the runs in its result file.

    python -m experiments.pefll.report [docs/results/pefll.json]

A run (``experiments/pefll/mnist_table1.py``) is a method and a seed; its summary holds the final
pooled test accuracies (%) over the seen and the unseen clients (and with label masking or local
finetuning), its history the per-client mean accuracies at the evaluations during training.
Figures over seeds: mean ± sample std.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments import results

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "pefll.json"
ROWS = [  # (label, method, summary key suffix)
    ("Local only", "local", ""),
    ("FedAvg", "fedavg", ""),
    ("FedAvg + local finetuning (20 steps)", "fedavg", "_finetuned"),
    ("pFedHN (unseen: 20 rounds of embedding fitting)", "pfedhn", ""),
    ("PeFLL", "pefll", ""),
    ("PeFLL + label masking", "pefll", "_masked"),
    ("PeFLL, label-free embedding (unseen: labels hidden)", "pefll_nolabels", ""),
]


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def by_method(runs: list[results.Run]) -> dict[str, list[results.Run]]:
    """method -> its runs, in seed order."""
    out: dict[str, list[results.Run]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: (r["params"]["method"], r["params"]["seed"])):
        out[run["params"]["method"]].append(run)
    return dict(out)


def main_table(runs: list[results.Run]) -> str:
    methods = by_method(runs)
    lines = ["| method | seeds | seen clients | unseen clients | wall time per run (s) |", "|---|---|---|---|---|"]
    for label, method, suffix in ROWS:
        rs = methods.get(method, [])
        if rs:
            seen = mean_std([r["summary"][f"seen{suffix}"] for r in rs])
            unseen = mean_std([r["summary"][f"unseen{suffix}"] for r in rs])
            wall = mean_std([r["summary"]["total_seconds"] for r in rs])
            lines.append(f"| {label} | {','.join(str(r['params']['seed']) for r in rs)} | {seen} | {unseen} | {wall} |")
    return "\n".join(lines)


def curve_table(runs: list[results.Run]) -> str:
    """Per-client mean test accuracy of the seen and unseen clients at each evaluation, mean over seeds."""
    lines = ["| method | round | seen | unseen |", "|---|---|---|---|"]
    for method, rs in by_method(runs).items():
        seen, unseen = defaultdict(list), defaultdict(list)
        for r in rs:
            for h in r["history"]:
                if "clients/acc_mean" in h:
                    seen[h["round"]].append(100 * h["clients/acc_mean"])
                    unseen[h["round"]].append(100 * h.get("clients_unseen/acc_mean", float("nan")))
        for rnd in sorted(seen):
            lines.append(f"| {method} | {rnd} | {statistics.mean(seen[rnd]):.1f} | {statistics.mean(unseen[rnd]):.1f} |")
    return "\n".join(lines)


def run_table(runs: list[results.Run]) -> str:
    lines = ["| run | seen | unseen | extra | train s | total s |", "|---|---|---|---|---|---|"]
    for method, rs in by_method(runs).items():
        for r in rs:
            s = r["summary"]
            extra = ", ".join(f"{k} {v:.1f}" for k, v in s.items() if k.endswith(("_masked", "_finetuned")))
            lines.append(f"| {method} s{r['params']['seed']} | {s['seen']:.1f} | {s['unseen']:.1f} | {extra} | "
                         f"{r['wall_s']} | {s['total_seconds']} |")
    return "\n".join(lines)


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in order."""
    return [main_table(runs), curve_table(runs), run_table(runs)]


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    print("\n\n".join(tables(results.load(opts.results))))


if __name__ == "__main__":
    main()
