"""Where a batched round's time goes: the wall time of each part of the engine's round, per round.

One workload of ``benchmarks/frameworks.py`` (FedAvg, the batched backend) runs for ``--rounds``
rounds after warm-up; the engine's parts are timed as they run:

  index tables   drawing the block's batches (``fixed_groups``)
  batches        gathering the steps' batches from the pool by those tables (``steps_of``, as the steps
                 draw them: many steps' batches at once from a tensor pool)
  start runs     each client's run and ``client_init`` (``_start_runs``)
  stack          the block's carries stacked (``stack_carries``)
  steps          the vectorized local steps (``_advance``), compiled with ``--compile-step``
  vectorized finals  ``client_final`` for the whole block, where the algorithm allows it (``_vectorized_finals``)
  unstack        the runs' values and step means given back (``Block.unstack``)
  finish runs    the uploads, checked and handed to the round (``_finish_runs``)
  round end      NaN/Inf checks, aggregation, the server update, logs (``finish_round``)

and the rest of the round (Lightning's loop, callbacks) is the difference to the round's wall time.
On a GPU the device is synchronized at each part's end (``--sync``, the default there), so that
each part is charged with its own device work; that adds a sync per part.

    python benchmarks/round_parts.py --workload a1000 --block 1000 [--accelerator gpu] [--compile-step] [--out parts.json]

``--config`` times a round of any config through the CLI instead (its algorithm, aggregation and
callbacks; ``fl-lightning fit``'s arguments after ``--``, the config's accelerator unless given)::

    python benchmarks/round_parts.py --config configs/raga/mnist_mlp.yaml --count-ops -- --model.init_args.client_backend batched

``--count-ops`` counts each part's tensor operations instead (each a kernel launch or more on a GPU):
on a CPU, what the parts will cost a GPU in launches.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional

import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frameworks  # noqa: E402  (the workloads and their fl_lightning path)

from fl_lightning.backends.batched import backend as batched  # noqa: E402
from fl_lightning.module import FederatedModule  # noqa: E402

#: part name -> (owner, attribute) of the function it times
PARTS: dict[str, tuple[Any, str]] = {
    "index tables": (batched, "fixed_groups"),
    "batches": (batched, "steps_of"),
    "start runs": (batched.BatchedBackend, "_start_runs"),
    "stack": (batched, "stack_carries"),
    "steps": (batched.BatchedBackend, "_advance"),
    "vectorized finals": (batched.BatchedBackend, "_vectorized_finals"),
    "unstack": (batched.Block, "unstack"),
    "finish runs": (batched.BatchedBackend, "_finish_runs"),
    "round end": (FederatedModule, "finish_round"),
}


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched while it is active (on a GPU, each is a kernel
    launch or more): what a part costs the device in launches, measurable on any machine."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def timed(totals: collections.Counter, counting: dict[str, bool], name: str, function: Callable[..., Any],
          sync: bool, ops: Optional[collections.Counter] = None) -> Callable[..., Any]:
    """``function``, adding its wall time (after a device sync, with ``sync``) to ``totals[name]``
    while ``counting["on"]``; with ``ops``, the number of tensor operations it dispatched to
    ``ops[name]`` instead (:class:`OpCounter`; its wall time then includes the counting). A
    generator function is charged with the drawing of each of its items, where it does its work."""

    def charged(call: Callable[[], Any]) -> Any:
        if ops is not None:
            with OpCounter() as counter:
                try:
                    return call()
                finally:
                    ops[name] += counter.count
        start = time.perf_counter()
        try:
            return call()
        finally:
            if sync:
                frameworks.synchronize()
            totals[name] += time.perf_counter() - start

    if inspect.isgeneratorfunction(function):
        @functools.wraps(function)
        def generator(*args: Any, **kwargs: Any) -> Iterator[Any]:
            items = function(*args, **kwargs)
            while True:
                try:
                    item = charged(functools.partial(next, items)) if counting["on"] else next(items)
                except StopIteration:
                    return
                yield item

        return generator

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not counting["on"]:
            return function(*args, **kwargs)
        return charged(functools.partial(function, *args, **kwargs))

    return wrapper


def config_rounds(config: str, overrides: list[str], rounds: int, callbacks: list[pl.Callback]) -> float:
    """Seconds per round of ``config`` (with ``overrides``) through the CLI, after one warm-up round,
    with ``callbacks`` added: what ``fl-lightning fit`` runs (its round checkpoint included, written
    to a temporary folder), without a logger and a progress bar."""
    import tempfile

    from fl_lightning.cli import FederatedCLI

    with tempfile.TemporaryDirectory(prefix="round_parts_") as root:
        cli = FederatedCLI(args=["--config", config, *overrides, "--trainer.max_epochs", str(rounds + 1),
                                 "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                                 "--trainer.default_root_dir", root], run=False)
        timer = frameworks._Timer(1)
        cli.trainer.callbacks += [timer, *callbacks]
        cli.trainer.fit(cli.model, cli.datamodule)
    return timer.seconds / rounds


class Counting(pl.Callback):
    """Counting on from the first round the benchmark's timer counts (after its warm-up rounds)."""

    def __init__(self, counting: dict[str, bool]) -> None:
        self.counting = counting

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timer = next(cb for cb in trainer.callbacks if isinstance(cb, frameworks._Timer))
        self.counting["on"] = trainer.current_epoch >= timer.warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="a1000", choices=list(frameworks.WORKLOADS))
    parser.add_argument("--block", type=int, default=None, help="clients per block (default: the workload's largest)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after the warm-up ones)")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--compile-step", action="store_true", help="the batched backend's compiled step")
    parser.add_argument("--sync", choices=["auto", "yes", "no"], default="auto",
                        help="synchronize the device at each part's end (auto: on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root (random data of its shape if absent)")
    parser.add_argument("--count-ops", action="store_true",
                        help="count each part's tensor operations (a GPU's kernel launches) instead of timing it")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--config", default=None, help="a config to time through the CLI instead of --workload")
    parser.add_argument("overrides", nargs="*", help="with --config: fl-lightning fit arguments (after --)")
    args = parser.parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        sys.exit("round_parts.py: --accelerator gpu needs a CUDA device, and torch.cuda.is_available() is False here")
    os.environ[frameworks.MNIST_ENV] = os.path.abspath(args.mnist)
    torch.set_num_threads(args.threads)
    sync = args.sync == "yes" or (args.sync == "auto" and args.accelerator == "gpu")
    if args.config is not None and (args.block is not None or args.compile_step):
        parser.error("with --config, give the block and the compiled step as overrides: -- "
                     "--model.init_args.clients_per_block N --model.init_args.compile_step true")
    w = frameworks.WORKLOADS[args.workload]
    block = args.block or max(w.blocks)

    totals: collections.Counter = collections.Counter()
    ops: Optional[collections.Counter] = collections.Counter() if args.count_ops else None
    counting = {"on": False}
    for name, (owner, attribute) in PARTS.items():
        original = owner.__dict__[attribute]
        wrapped = timed(totals, counting, name, getattr(original, "__func__", original), sync, ops)
        setattr(owner, attribute, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
    if args.config is not None:
        overrides = list(args.overrides)
        if args.accelerator == "gpu" and "--trainer.accelerator" not in overrides:
            overrides += ["--trainer.accelerator", "gpu"]
        seconds = config_rounds(args.config, overrides, args.rounds, [Counting(counting)])
        name, block = f"{args.config} {' '.join(args.overrides)}".strip(), "the config's"
    else:
        seconds = frameworks.fl_lightning(w, w.datamodule(), args.rounds, "batched", block,
                                          "gpu" if args.accelerator == "gpu" else "cpu",
                                          compile_step=args.compile_step, callbacks=[Counting(counting)])
        name = args.workload
    if ops is not None:
        print(f"{name}, block {block}, {'compiled' if args.compile_step else 'eager'} step: tensor operations a round")
        for part in PARTS:
            print(f"  {part:<36} {ops[part] / args.rounds:9.0f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"workload": name, "block": block, "compile_step": args.compile_step,
                           "rounds": args.rounds, "operations_per_round": {n: ops[n] / args.rounds for n in PARTS},
                           "torch": torch.__version__}, f, indent=1)
        return
    per_round = {name: totals[name] / args.rounds for name in PARTS}
    per_round["rest (Lightning's loop, callbacks)"] = seconds - sum(per_round.values())
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
    print(f"{name}, block {block}, {'compiled' if args.compile_step else 'eager'} step, {device}, "
          f"{'device synced at each part' if sync else 'no sync'}: {seconds * 1e3:.1f} ms a round")
    for part, value in per_round.items():
        print(f"  {part:<36} {value * 1e3:9.2f} ms  {100 * value / seconds:5.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"workload": name, "block": block, "compile_step": args.compile_step, "device": device,
                       "sync": sync, "rounds": args.rounds, "seconds_per_round": seconds,
                       "parts_seconds_per_round": per_round, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
