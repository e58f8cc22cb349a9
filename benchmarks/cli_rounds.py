"""What a run of ``fl-lightning fit`` costs, as a user starts it: the whole command's wall time at
two round counts, in fresh processes, and from them the fixed cost (start-up, data, compilation) and
the cost of one more round, everything a round does included (the round checkpoint the CLI writes
every round, validation at the config's interval, the history and the logger).

Each variant is a list of overrides of the config; each (variant, rounds) pair runs ``--repeats``
times, interleaved, and the fastest counts. The time of ``--target`` rounds is extrapolated as
``fixed + target x per-round`` (the config's schedule does not depend on ``--trainer.max_epochs``,
so the short runs are the first rounds of the full one)::

    python benchmarks/cli_rounds.py --config configs/raga/mnist_mlp.yaml --rounds 10 110 --target 1000 \\
        --variant "batched=--model.init_args.client_backend batched" \\
        --variant "batched, compiled=--model.init_args.client_backend batched --model.init_args.compile_step true" \\
        --out cli_rounds.json

Prints seconds per round, the fixed cost and the extrapolated target run; writes them, with every
run's wall time and last history row, to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


def run_once(config: str, overrides: list[str], rounds: int, extra: list[str]) -> tuple[float, Optional[dict]]:
    """Wall seconds of one ``fl-lightning fit`` of ``rounds`` rounds in a fresh process, and the last
    row of its history (None if it wrote none). Raises with the command's output if it fails."""
    with tempfile.TemporaryDirectory(prefix="cli_rounds_") as root:
        command = [sys.executable, "-m", "fl_lightning.cli", "fit", "--config", config, *overrides, *extra,
                   "--trainer.max_epochs", str(rounds), "--trainer.default_root_dir", root]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                               f"\n{done.stderr[-3000:]}")
        histories = sorted(Path(root).rglob("history.json"))
        last = json.loads(histories[-1].read_text())[-1] if histories else None
        return seconds, last and {key: value for key, value in last.items() if key != "clients"}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"name=--a 1 --b 2"`` -> ``("name", ["--a", "1", "--b", "2"])``."""
    name, sep, args = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--variant must be NAME=OVERRIDES, got {text!r}")
    return name.strip(), shlex.split(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's config file")
    parser.add_argument("--rounds", type=int, nargs=2, default=(10, 110), metavar=("SHORT", "LONG"),
                        help="the two round counts timed (default 10 110)")
    parser.add_argument("--target", type=int, default=1000, help="rounds of the extrapolated run (default 1000)")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=OVERRIDES, the overrides of one variant (repeatable)")
    parser.add_argument("--extra", default="", help="overrides every variant gets (a data root, say)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (variant, rounds), the fastest counts")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    short, long = args.rounds
    if not 0 < short < long:
        parser.error(f"--rounds must be two counts 0 < SHORT < LONG, got {short} {long}")
    extra = shlex.split(args.extra)
    results: dict[str, Any] = {"config": args.config, "rounds": [short, long], "target": args.target,
                               "extra": extra, "variants": {}}
    for name, overrides in args.variant:
        results["variants"][name] = {"overrides": overrides, "runs": {short: [], long: []}}
    for _ in range(args.repeats):
        for name, overrides in args.variant:
            entry = results["variants"][name]
            for rounds in (short, long):
                try:
                    seconds, last = run_once(args.config, overrides, rounds, extra)
                except RuntimeError as error:
                    entry["error"] = str(error)
                    print(f"{name}, {rounds} rounds: FAILED\n{error}", flush=True)
                    break
                entry["runs"][rounds].append(seconds)
                entry[f"last_history_row_{rounds}"] = last
                print(f"{name}, {rounds} rounds: {seconds:.2f} s", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{args.config}, {args.target} rounds extrapolated from runs of {short} and {long}:")
    for name, entry in results["variants"].items():
        if not entry["runs"][short] or not entry["runs"][long]:
            print(f"  {name:<28} failed")
            continue
        t_short, t_long = min(entry["runs"][short]), min(entry["runs"][long])
        per_round = (t_long - t_short) / (long - short)
        fixed = t_short - short * per_round
        entry.update(seconds_per_round=per_round, fixed_seconds=fixed, target_seconds=fixed + args.target * per_round)
        print(f"  {name:<28} {per_round * 1e3:8.1f} ms/round  fixed {fixed:6.1f} s  "
              f"{args.target} rounds: {entry['target_seconds']:7.1f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
