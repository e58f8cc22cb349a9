"""Tables and plots of the FedDeper Table I runs, from the CSV logs the configs write.

    python experiments/feddeper/report.py mnist_mlp_n10_m5 [mnist_mlp_n10_m10 ...]

For each setting: a markdown table (global test accuracy at the last evaluation, the best and
the mean of the last 5 evaluations, rounds run, mean / worst local-test accuracy of the
global and the personal models) on stdout, and ``experiments/feddeper/<setting>.png`` with
the global model's test accuracy per evaluated round for each method.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
METHODS = {"feddeper": "FedDeper", "feddeper_star": "FedDeper*", "scaffold": "SCAFFOLD", "fedavg": "FedAvg",
           "fedprox": "FedProx (mu=1)"}
PREFIXES = ("local", "local+1", "local+3")
COLUMNS = ["val_acc"] + [f"{p}/{m}_acc_{s}" for p in PREFIXES for m in ("global", "personal") for s in ("mean", "worst")]


def evaluations(metrics_csv: Path) -> list[dict[str, float]]:
    """The validation rows of a CSVLogger ``metrics.csv``: ``round`` (1-based) and the logged metrics."""
    rows: dict[int, dict[str, float]] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            values = {k: float(row[k]) for k in COLUMNS if row.get(k)}
            if values:
                rows.setdefault(int(row["epoch"]) + 1, {}).update(values)
    return [{"round": r, **v} for r, v in sorted(rows.items())]


def pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.2f}"


def mean_worst(row: dict[str, float], prefix: str, model: str) -> str:
    """``mean / worst`` client accuracy of ``model`` (global or personal) on the ``prefix`` local test sets."""
    if f"{prefix}/{model}_acc_mean" not in row:
        return "-"
    return f"{pct(row[f'{prefix}/{model}_acc_mean'])} / {pct(row[f'{prefix}/{model}_acc_worst'])}"


def summarize(setting: str) -> str:
    lines = [f"### {setting}", "",
             "| method (run) | rounds | final acc | best acc | mean last 5 evals | local GM mean / worst "
             "| local PM mean / worst | PM +1 class | PM +3 classes |",
             "|---|---|---|---|---|---|---|---|---|"]
    plt.figure(figsize=(7, 4.5))
    for method, label in METHODS.items():
        runs = [(p, evaluations(p)) for p in sorted((HERE / "runs" / setting).glob(f"{method}*/metrics.csv"))
                if p.parent.name in (method, f"{method}_500")]
        runs = [(p, [e for e in evals if "val_acc" in e]) for p, evals in runs]
        runs = [(p, evals) for p, evals in runs if evals]
        for path, evals in runs:
            accs = [e["val_acc"] for e in evals]
            last = evals[-1]
            lines.append(
                f"| {label} ({path.parent.name}) | {last['round']} | {pct(accs[-1])} | {pct(max(accs))} | "
                f"{pct(sum(accs[-5:]) / len(accs[-5:]))} | {mean_worst(last, 'local', 'global')} | "
                f"{mean_worst(last, 'local', 'personal')} | {mean_worst(last, 'local+1', 'personal')} | "
                f"{mean_worst(last, 'local+3', 'personal')} |"
            )
        if runs:
            evals = max((e for _, e in runs), key=len)  # the longest run of the method
            plt.plot([e["round"] for e in evals], [100 * e["val_acc"] for e in evals], label=label)
    plt.xlabel("round")
    plt.ylabel("global test accuracy (%)")
    plt.title(setting)
    plt.grid(alpha=0.3)
    plt.legend()
    plt.ylim(bottom=0)
    plt.tight_layout()
    plt.savefig(HERE / f"{setting}.png", dpi=120)
    plt.close()
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(summarize(name) + "\n")
