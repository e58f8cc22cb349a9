"""The same FedAvg work through every path installed here, in one run: ms per round, the speed-up
over a hand-written PyTorch loop, client-steps per second and achieved FLOP/s.

Paths: a hand-written PyTorch FedAvg loop; fl_lightning's sequential backend; its batched
backend (blocks of 10, 50, 100 clients); a new Lightning ``Trainer`` per client per round (the
pattern of Flower's Lightning example); Flower's simulation engine (Ray) with a plain-torch
client and with a Lightning client, when ``flwr[simulation]`` is installed
(``pip install -e ".[bench]"``; skipped with a message otherwise). Every path trains the same
client module with plain SGD on the same clients' data (the same mini-batch size and number of
local steps), with the same number of intra-op threads (``--threads``; Flower runs one client per
core, each with ``threads / cores`` threads).

Workloads:
  a  the quickstart's logistic regression (60 -> 10) on Synthetic(1, 1): 30 clients, all 30 per
     round, 20 local steps of batch 10
  b  MNIST MLP 784-200-200-10: 100 clients (iid), 10 and 100 per round, 10 local steps of batch 64
  c  MNIST LeNet (conv 6-16, one FC): 100 clients (iid), 100 per round, 10 local steps of batch 64

    python benchmarks/frameworks.py [--workloads a b10 b100 c] [--threads 2] [--mnist ../shared/data] [--out results.json]

Results are printed as they come and written to ``--out`` (JSON). For fl_lightning's paths the
peak resident memory that two rounds add to the data's is measured in a spawned process: the
batched backend's grows with the block size, not with the clients of the round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import FederatedDataModule, MNISTFederated, SyntheticFederated
from fl_lightning.models import LeNet, LogisticRegression, MLP
from fl_lightning.seeding import generator, sample_clients

#: where MNIST is read (``--mnist``; an environment variable, so that Flower's workers read it too)
MNIST_ENV = "FL_LIGHTNING_MNIST"


class RandomMNIST(FederatedDataModule):
    """MNIST-shaped random data, when the real MNIST is not at hand."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(60_000, 1, 28, 28, generator=g), torch.randint(0, 10, (60_000,), generator=g)), None


def mnist(num_clients: int, batch_size: int) -> FederatedDataModule:
    try:
        dm: FederatedDataModule = MNISTFederated(root=os.environ.get(MNIST_ENV, "../shared/data"),
                                                 num_clients=num_clients, partition="iid", batch_size=batch_size)
        dm.setup()
    except RuntimeError:
        print("MNIST not found: random MNIST-shaped data (the same work)")
        dm = RandomMNIST(num_clients=num_clients, partition="iid", batch_size=batch_size)
        dm.setup()
    return dm


class Quiet:
    """Mixes into a reference model: a training step without ``self.log`` (the hand-written loop's exact work)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


class QuietLogisticRegression(Quiet, LogisticRegression):
    pass


class QuietMLP(Quiet, MLP):
    pass


class QuietLeNet(Quiet, LeNet):
    pass


@dataclass
class Workload:
    """One FedAvg configuration."""

    name: str
    description: str
    datamodule: Callable[[], FederatedDataModule]
    client: Callable[[], pl.LightningModule]
    clients_per_round: int
    local_steps: int
    blocks: tuple[int, ...]
    rounds: int  # timed rounds of the fast paths
    slow_rounds: int = 2  # timed rounds of the Trainer-per-client and Flower paths

    @property
    def client_steps(self) -> int:
        return self.clients_per_round * self.local_steps


def _synthetic() -> FederatedDataModule:
    dm = SyntheticFederated(num_clients=30, batch_size=10, seed=0)
    dm.setup()
    return dm


WORKLOADS = {
    "a": Workload("a", "logistic regression 60-10, Synthetic(1,1), 30 clients, 30/round, 20 steps of 10",
                  _synthetic, lambda: QuietLogisticRegression(60, 10, lr=0.05), 30, 20, (10, 30), rounds=20),
    "b10": Workload("b10", "MLP 784-200-200-10, MNIST, 100 clients, 10/round, 10 steps of 64",
                    lambda: mnist(100, 64), lambda: QuietMLP(784, (200, 200), 10, lr=0.05), 10, 10, (10,), rounds=10),
    "b100": Workload("b100", "MLP 784-200-200-10, MNIST, 100 clients, 100/round, 10 steps of 64",
                     lambda: mnist(100, 64), lambda: QuietMLP(784, (200, 200), 10, lr=0.05), 100, 10, (10, 50, 100),
                     rounds=3),
    "c": Workload("c", "LeNet conv 6-16, MNIST, 100 clients, 100/round, 10 steps of 64",
                  lambda: mnist(100, 64), lambda: QuietLeNet(lr=0.05), 100, 10, (10, 50, 100), rounds=2),
}


# ---------------------------------------------------------------------------------- the paths
def flops_per_step(w: Workload, dm: FederatedDataModule) -> float:
    """FLOPs of one local step (forward and backward of one mini-batch), counted by PyTorch."""
    model = w.client()
    batch = next(dm.client_data(0, "train").step_batches(1, generator(0, "flops")))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(batch[0]), batch[1]).backward()
    return float(counter.get_total_flops())


def hand_written(w: Workload, dm: FederatedDataModule, rounds: int) -> float:
    """Plain PyTorch FedAvg over the same client splits and batches; seconds per round."""
    torch.manual_seed(0)
    model = w.client()
    lr = model.lr
    x_all, y_all = dm.pool.tensors
    splits = [torch.from_numpy(s) for s in dm.splits["train"]]
    steps, b = w.local_steps, dm.batch_size
    start = time.perf_counter()
    for r in range(rounds):
        global_state = [p.detach().clone() for p in model.parameters()]
        acc = [torch.zeros_like(p) for p in global_state]
        total = 0
        for cid in sample_clients(0, r, list(dm.train_clients), w.clients_per_round):
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_state):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            idx, gen = splits[cid], generator(0, "batches", r, cid)
            n = len(idx)
            bb = min(b, n)
            perm, pos = torch.randperm(n, generator=gen), 0
            for _ in range(steps):
                if pos + bb > n:
                    perm, pos = torch.randperm(n, generator=gen), 0
                batch = idx[perm[pos : pos + bb]]
                pos += bb
                opt.zero_grad()
                F.cross_entropy(model(x_all[batch]), y_all[batch]).backward()
                opt.step()
            with torch.no_grad():
                for a, p, g in zip(acc, model.parameters(), global_state):
                    a.add_(p - g, alpha=n)
            total += n
        with torch.no_grad():
            for p, g, a in zip(model.parameters(), global_state, acc):
                p.copy_(g + a / total)
    return (time.perf_counter() - start) / rounds


class _Timer(pl.Callback):
    """Wall time of the rounds after the first (warm-up) one."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start


def fl_lightning(w: Workload, dm: FederatedDataModule, rounds: int, backend: str, block: int = 10) -> float:
    """The same FedAvg through fl_lightning; seconds per round (a warm-up round not counted)."""
    torch.manual_seed(0)
    module = FedAvg(w.client(), clients_per_round=w.clients_per_round, local_steps=w.local_steps, seed=0,
                    client_backend=backend, clients_per_block=block)
    timer = _Timer()
    trainer = pl.Trainer(max_epochs=rounds + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[timer], accelerator="cpu")
    trainer.fit(module, dm)
    return timer.seconds / rounds


def trainer_per_client(w: Workload, dm: FederatedDataModule, rounds: int) -> float:
    """A new Lightning Trainer per client per round (Flower's Lightning example); seconds per round."""
    torch.manual_seed(0)
    model = w.client()
    seconds = []
    for r in range(rounds + 1):
        start = time.perf_counter()
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        acc = {k: torch.zeros_like(v) for k, v in global_state.items() if v.is_floating_point()}
        total = 0
        for cid in sample_clients(0, r, list(dm.train_clients), w.clients_per_round):
            model.load_state_dict(global_state)
            data = Subset(dm.pool, dm.splits["train"][cid].tolist())
            loader = DataLoader(data, batch_size=dm.batch_size, shuffle=True, generator=generator(0, "batches", r, cid))
            trainer = pl.Trainer(max_steps=w.local_steps, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                                 num_sanity_val_steps=0, limit_val_batches=0)
            trainer.fit(model, loader)
            n = len(data)
            for k, v in model.state_dict().items():
                if k in acc:
                    acc[k] += (v - global_state[k]) * n
            total += n
        model.load_state_dict({k: (global_state[k] + acc[k] / total) if k in acc else v for k, v in global_state.items()})
        if r > 0:
            seconds.append(time.perf_counter() - start)
    return statistics.mean(seconds)


def _rss_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in KiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_rss_child(key: str, backend: str, block: int, threads: int) -> float:
    """In a fresh process: the peak resident memory (MB) that two fl_lightning rounds add to the data's."""
    torch.set_num_threads(threads)
    w = WORKLOADS[key]
    dm = w.datamodule()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident size (Linux >= 4.0)
    base = _rss_kib("VmRSS")
    fl_lightning(w, dm, 1, backend, block)
    return (_rss_kib("VmHWM") - base) / 1024


def peak_memory(key: str, backend: str, block: int, threads: int) -> float:
    """Peak resident memory (MB) of the rounds of one path, measured in a spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_peak_rss_child, (key, backend, block, threads))


# ---------------------------------------------------------------------------------- Flower
def flower(w: Workload, rounds: int, lightning: bool, threads: int) -> Optional[float]:
    """Flower's simulation engine (Ray): one actor per core; seconds per round (warm-up round not
    counted), or None when ``flwr[simulation]`` is not installed."""
    try:
        import flwr  # noqa: F401
        from flwr.simulation import run_simulation  # noqa: F401
    except ImportError:
        return None
    from flower_apps import run  # the Flower client and server apps, in their own module for Ray

    return run(w.name, rounds, lightning, threads)


# ---------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every path")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the fast paths (the best counts)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["trainer", "flower", "flower-lightning"])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root (random data of its shape if absent)")
    args = parser.parse_args()
    os.environ[MNIST_ENV] = os.path.abspath(args.mnist)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"threads": args.threads, "torch": torch.__version__, "workloads": {}}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for key in args.workloads:
        w = WORKLOADS[key]
        dm = w.datamodule()
        flops = flops_per_step(w, dm)
        print(f"\n[{key}] {w.description}; {flops / 1e6:.2f} MFLOP per local step; {args.threads} thread(s)")
        rows: dict[str, Optional[float]] = {}
        entry = {"description": w.description, "flops_per_step": flops, "rounds": w.rounds, "seconds_per_round": rows}
        results["workloads"][key] = entry

        memory: dict[str, float] = {}
        entry["peak_rss_mb"] = memory

        def report(name: str, seconds: Optional[float], rss: Optional[float] = None) -> None:
            rows[name] = seconds
            if rss is not None:
                memory[name] = rss
            save()
            if seconds is None:
                print(f"  {name:<34} skipped: flwr[simulation] is not installed (pip install -e '.[bench]')")
                return
            hand = rows.get("hand-written PyTorch")
            speedup = f"{hand / seconds:6.2f}x" if hand else "   -   "
            rate = w.client_steps / seconds
            extra = f"  peak RSS +{rss:6.0f} MB" if rss is not None else ""
            print(f"  {name:<34} {seconds * 1e3:9.1f} ms/round  {speedup} hand-written  {rate:8.0f} client-steps/s"
                  f"  {rate * flops / 1e9:6.1f} GFLOP/s{extra}", flush=True)

        # the fast paths are timed interleaved (hand, sequential, batched..., hand, ...), the best of
        # --repeats each, so that the machine's background load touches them alike
        fast = {"hand-written PyTorch": lambda: hand_written(w, dm, w.rounds),
                "fl_lightning sequential": lambda: fl_lightning(w, dm, w.rounds, "sequential")}
        for block in w.blocks:
            fast[f"fl_lightning batched, block {block}"] = lambda block=block: fl_lightning(w, dm, w.rounds, "batched",
                                                                                          block)
        times: dict[str, list[float]] = {name: [] for name in fast}
        for _ in range(args.repeats):
            for name, run in fast.items():
                times[name].append(run())
        entry["runs"] = times
        report("hand-written PyTorch", min(times["hand-written PyTorch"]))
        report("fl_lightning sequential", min(times["fl_lightning sequential"]),
               peak_memory(key, "sequential", 1, args.threads))
        for block in w.blocks:
            name = f"fl_lightning batched, block {block}"
            report(name, min(times[name]), peak_memory(key, "batched", block, args.threads))
        if "trainer" not in args.skip:
            report("Trainer per client per round", trainer_per_client(w, dm, w.slow_rounds))
        if "flower" not in args.skip:
            report("Flower simulation, torch client", flower(w, w.slow_rounds, False, args.threads))
        if "flower-lightning" not in args.skip:
            report("Flower simulation, Lightning client", flower(w, w.slow_rounds, True, args.threads))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
