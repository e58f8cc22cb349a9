"""Tables of experiments/pefll/results/*.json (written by mnist_table1.py) as Markdown.

    python experiments/pefll/summarize.py
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = [  # (label, method, result key suffix)
    ("Local only", "local", ""),
    ("FedAvg", "fedavg", ""),
    ("FedAvg + local finetuning (20 steps)", "fedavg", "_finetuned"),
    ("pFedHN (unseen: 20 rounds of embedding fitting)", "pfedhn", ""),
    ("PeFLL", "pefll", ""),
    ("PeFLL + label masking", "pefll", "_masked"),
    ("PeFLL, label-free embedding (unseen: labels hidden)", "pefll_nolabels", ""),
]


def mean_std(values: list[float]) -> str:
    if not values:
        return "not run"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def main() -> None:
    runs = defaultdict(list)
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        runs[result["method"]].append(result)
    print("| method | seeds | seen clients | unseen clients | wall time per run (s) |")
    print("|---|---|---|---|---|")
    for label, method, suffix in ROWS:
        rs = runs.get(method, [])
        if not rs:
            continue
        seeds = ",".join(str(r["seed"]) for r in rs)
        seen = mean_std([r[f"seen{suffix}"] for r in rs])
        unseen = mean_std([r[f"unseen{suffix}"] for r in rs])
        wall = mean_std([r["total_seconds"] for r in rs])
        print(f"| {label} | {seeds} | {seen} | {unseen} | {wall} |")
    print()
    print("Per-client mean test accuracy (%) during training (mean over seeds):")
    print()
    print("| method | round | seen | unseen |")
    print("|---|---|---|---|")
    for method, rs in sorted(runs.items()):
        by_round = defaultdict(lambda: ([], []))
        for r in rs:
            for p in r["curve"]:
                if "clients/acc_mean" in p:
                    by_round[p["round"]][0].append(100 * p["clients/acc_mean"])
                    by_round[p["round"]][1].append(100 * p.get("clients_unseen/acc_mean", float("nan")))
        for rnd, (seen, unseen) in sorted(by_round.items()):
            print(f"| {method} | {rnd} | {statistics.mean(seen):.1f} | {statistics.mean(unseen):.1f} |")
    print()
    print("Per run:")
    print()
    print("| run | seen | unseen | extra | train s | total s |")
    print("|---|---|---|---|---|---|")
    for method, rs in sorted(runs.items()):
        for r in rs:
            extra = ", ".join(f"{k} {r[k]:.1f}" for k in r if k.endswith(("_masked", "_finetuned")))
            print(f"| {method} s{r['seed']} | {r['seen']:.1f} | {r['unseen']:.1f} | {extra} | {r['train_seconds']} | "
                  f"{r['total_seconds']} |")


if __name__ == "__main__":
    main()
