"""Overhead of fl_lightning against a minimal hand-written PyTorch FedAvg loop.

The same work both ways: an MNIST-sized MLP (784-200-200-10), 100 clients (iid), 10 per round,
10 local SGD steps of batch 64 per client, sample-weighted averaging of the deltas. Both train
the same client module (its forward is the user's, not the framework's). Runs are
interleaved in one process (each repeat runs every row, starting one row later than the last) and the best of each is
compared (the median ratio is printed too), so the ratio is robust to the machine's background load.
Each run is timed by the wall clock and by the main thread's CPU time (``--clock``), which a
busy machine disturbs less: another process taking the core does not count.

    python benchmarks/overhead.py [--rounds 20] [--repeats 3] [--mnist ../shared/data] [--clock cpu]
    python benchmarks/overhead.py --decompose --clock cpu
    python benchmarks/overhead.py --one-work-item --clock cpu

Prints both times per round and the ratio framework / hand-written (target <= 1.05 on CPU), and
Lightning's own loop around as many Trainer batches as a round has clients, with a training step
that does nothing: the part of the overhead that comes with one Trainer batch per client, whatever
the engine does (the ratio's floor, printed beside it).

``--decompose`` splits the difference into what each local step adds and what a round adds
whatever its steps (its 10 clients' start and end, Lightning's loop around each client, the round's
end): the same comparison with a model too small to cost anything (784-8-10, batches of 4), at 1,
10 and 40 local steps; the difference's slope over the round's steps and its intercept.

``--one-work-item`` adds a row of the same federation with the round's 10 clients run as one work
item (``clients_per_block=10``: one Trainer batch a round, the clients one after another inside it)
where the sequential backend's default makes each client a work item of its own: what Lightning's
loop around a work item costs the engine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import QuietMLP, mnist_or_random

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.models import MLP
from fl_lightning.seeding import generator, sample_clients

CLIENTS, PER_ROUND, STEPS, BATCH, LR = 100, 10, 10, 64, 0.05
HIDDEN = (200, 200)
#: ``--decompose``: a model whose arithmetic is negligible, its batch size, and the local steps compared
TINY_HIDDEN, TINY_BATCH, TINY_STEPS = (8,), 4, (1, 10, 40)
#: the clock runs are timed with: ``time.perf_counter`` (wall) or ``time.thread_time`` (CPU)
CLOCK: Callable[[], float] = time.perf_counter


def hand_written(dm: FederatedDataModule, rounds: int, steps: int = STEPS, hidden: tuple[int, ...] = HIDDEN) -> float:
    """Plain PyTorch FedAvg over the same client splits; returns seconds per round."""
    torch.manual_seed(0)
    model = QuietMLP(hidden=hidden, lr=LR)
    x_all, y_all = dm.pool.tensors
    splits = [torch.from_numpy(s) for s in dm.splits["train"]]
    start = CLOCK()
    for r in range(rounds):
        global_state = [p.detach().clone() for p in model.parameters()]
        acc = [torch.zeros_like(p) for p in global_state]
        total = 0
        for cid in sample_clients(0, r, list(range(CLIENTS)), PER_ROUND):
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_state):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            idx, gen = splits[cid], generator(0, "batches", r, cid)
            perm, pos = torch.randperm(len(idx), generator=gen), 0
            for _ in range(steps):
                if pos + dm.batch_size > len(idx):
                    perm, pos = torch.randperm(len(idx), generator=gen), 0
                batch = idx[perm[pos : pos + dm.batch_size]]
                pos += dm.batch_size
                opt.zero_grad()
                F.cross_entropy(model(x_all[batch]), y_all[batch]).backward()
                opt.step()
            with torch.no_grad():
                for a, p, g in zip(acc, model.parameters(), global_state):
                    a.add_(p - g, alpha=len(idx))
            total += len(idx)
        with torch.no_grad():
            for p, g, a in zip(model.parameters(), global_state, acc):
                p.copy_(g + a / total)
    return (CLOCK() - start) / rounds


class Timer(pl.Callback):
    """Wall time of the training epochs (rounds) only, without Trainer setup and teardown."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.start = CLOCK()

    def on_train_end(self, trainer, pl_module):
        self.seconds = CLOCK() - self.start


def timed_fit(module: pl.LightningModule, dm: Optional[FederatedDataModule], rounds: int) -> float:
    """Fit ``module`` for ``rounds`` rounds on the CPU, no validation or logging; seconds per round."""
    timer = Timer()
    trainer = pl.Trainer(max_epochs=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[timer], accelerator="cpu")
    trainer.fit(module, dm)
    return timer.seconds / rounds


class NoOpBatches(pl.LightningModule):
    """Lightning's loop alone: ``batches_per_epoch`` Trainer batches an epoch, each a manual-optimization
    ``training_step`` that does nothing (the loop the engine's work items run in)."""

    def __init__(self, batches_per_epoch: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batches_per_epoch = batches_per_epoch
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: int, batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(range(self.batches_per_epoch), batch_size=None)


def lightning_loop(rounds: int) -> float:
    """Seconds per round of Lightning's loop alone around :data:`PER_ROUND` batches a round (:class:`NoOpBatches`)."""
    return timed_fit(NoOpBatches(PER_ROUND), None, rounds)


def framework(dm: FederatedDataModule, rounds: int, client_cls: type = QuietMLP, steps: int = STEPS,
              hidden: tuple[int, ...] = HIDDEN, one_work_item: bool = False) -> float:
    """The same FedAvg through fl_lightning (``one_work_item``: the round's clients in one work item,
    ``clients_per_block=PER_ROUND``); seconds per round."""
    torch.manual_seed(0)
    module = FedAvg(client_cls(hidden=hidden, lr=LR), clients_per_round=PER_ROUND, local_steps=steps, seed=0,
                    clients_per_block=PER_ROUND if one_work_item else None)
    return timed_fit(module, dm, rounds)


def decompose(root: str, rounds: int, repeats: int) -> None:
    """Print the framework's overhead per local step and per round (:data:`TINY_STEPS`' fit)."""
    dm, data = mnist_or_random(root, num_clients=CLIENTS, partition="iid", batch_size=TINY_BATCH)
    print(f"data: {data}; {CLIENTS} clients, {PER_ROUND}/round, MLP 784-{'-'.join(map(str, TINY_HIDDEN))}-10, "
          f"batch {TINY_BATCH}; {rounds} rounds x {repeats} repeats, best of each")
    excess = []
    for steps in TINY_STEPS:
        hand = min(hand_written(dm, rounds, steps, TINY_HIDDEN) for _ in range(repeats))
        ours = min(framework(dm, rounds, QuietMLP, steps, TINY_HIDDEN) for _ in range(repeats))
        excess.append(ours - hand)
        print(f"{steps:3d} local steps: hand-written {hand * 1e3:7.2f} ms/round, fl_lightning {ours * 1e3:7.2f}, "
              f"difference {(ours - hand) * 1e3:6.2f}")
    fit = statistics.linear_regression([PER_ROUND * s for s in TINY_STEPS], excess)
    print(f"overhead: {fit.slope * 1e6:.1f} us per local step, {fit.intercept * 1e3:.2f} ms per round of {PER_ROUND} "
          f"clients besides ({fit.intercept / PER_ROUND * 1e3:.3f} ms a client)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root; random data if not found")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock, or the main thread's CPU time (less disturbed by other processes)")
    parser.add_argument("--decompose", action="store_true",
                        help="the overhead per local step and per round, with a model too small to cost anything")
    parser.add_argument("--one-work-item", action="store_true",
                        help="also time the round's clients as one work item: the cost of Lightning's loop per client")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.decompose:
        decompose(args.mnist, args.rounds, args.repeats)
        return
    dm, data = mnist_or_random(args.mnist, num_clients=CLIENTS, partition="iid", batch_size=BATCH)
    runs: dict[str, Callable[[], float]] = {
        "hand-written PyTorch": lambda: hand_written(dm, args.rounds),
        "fl_lightning": lambda: framework(dm, args.rounds),
        "fl_lightning, client logs": lambda: framework(dm, args.rounds, MLP),
        "Lightning's loop alone": lambda: lightning_loop(args.rounds),
    }
    if args.one_work_item:
        runs["fl_lightning, one work item"] = lambda: framework(dm, args.rounds, one_work_item=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(args.repeats):  # each repeat starts one later: no row always runs first or last
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            times[name].append(runs[name]())
    best = {name: min(ts) for name, ts in times.items()}
    print(f"data: {data}; {CLIENTS} clients, {PER_ROUND}/round, {STEPS} steps of batch {BATCH}; "
          f"{args.rounds} rounds x {args.repeats} repeats, {args.threads} thread(s), {args.clock} clock")
    for name, ts in times.items():
        print(f"{name:<28}: {best[name] * 1e3:8.1f} ms/round (runs: {', '.join(f'{t * 1e3:.1f}' for t in ts)})")
    hand = best["hand-written PyTorch"]
    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"ratio fl_lightning / hand-written: {best['fl_lightning'] / hand:.3f} best of runs (target <= 1.05), "
          f"{median['fl_lightning'] / median['hand-written PyTorch']:.3f} median")
    loop = best["Lightning's loop alone"]
    print(f"Lightning's loop around {PER_ROUND} batches a round, a no-op training step: {loop * 1e3:.2f} ms "
          f"({loop / PER_ROUND * 1e3:.3f} ms a batch); the ratio's floor with a Trainer batch per client: "
          f"{(hand + loop) / hand:.3f}, the engine's own share: {(best['fl_lightning'] - hand - loop) / hand:.3f}")
    print(f"ratio with the client's self.log('train_loss') at every local step: "
          f"{best['fl_lightning, client logs'] / hand:.3f} (Lightning's logging cost, paid per local step)")
    if args.one_work_item:
        print(f"ratio with the round's clients in one work item: {best['fl_lightning, one work item'] / hand:.3f} "
              f"(Lightning's loop around a work item: {(best['fl_lightning'] - best['fl_lightning, one work item']) / PER_ROUND * 1e3:.3f} ms a client)")


if __name__ == "__main__":
    main()
