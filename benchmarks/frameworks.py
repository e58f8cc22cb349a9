"""The same FedAvg work through every path installed here, in one run: ms per round, the speed-up
over a hand-written PyTorch loop, client-steps per second and achieved FLOP/s.

Paths: a hand-written PyTorch FedAvg loop; fl_lightning's sequential backend, a Trainer batch per
client and (``block`` = the round's clients) one a round; its batched backend (blocks of 10, 50, 100
clients); a new Lightning ``Trainer`` per client per round (the
pattern of Flower's Lightning example); Flower's simulation engine (Ray) with a plain-torch
client and with a Lightning client, when ``flwr[simulation]`` is installed
(``pip install -e ".[bench]"``; skipped with a message otherwise). Every path trains the same
client module with plain SGD on the same clients' data (the same mini-batch size and number of
local steps), with the same number of intra-op threads (``--threads``; Flower runs one client per
core, each with ``threads / cores`` threads). With ``--compile-step``: the batched backend's compiled
step, and the limit it could reach, one ``vmap(grad(loss))`` step over the stacked clients with plain
SGD in place compiled by ``torch.compile`` (see ``--accelerator gpu``).

Workloads:
  a      the quickstart's logistic regression (60 -> 10) on Synthetic(1, 1): 30 clients, all 30 per
         round, 20 local steps of batch 10
  b      MNIST MLP 784-200-200-10: 100 clients (iid), 10 and 100 per round, 10 local steps of batch 64
  c      MNIST LeNet (conv 6-16, one FC): 100 clients (iid), 100 per round, 10 local steps of batch 64
  a1000  a's logistic regression, 1,000 clients, all per round, 20 local steps of batch 10
  b1000  b's MLP, 1,000 clients (iid), all per round, 10 local steps of batch 32

    python benchmarks/frameworks.py [--workloads a b10 b100 c] [--threads 2] [--mnist ../shared/data] [--out results.json]
    python benchmarks/frameworks.py --accelerator gpu [--workloads a b100 c a1000 b1000] [--compile-step] [--out r.json]

Results are printed as they come and written to ``--out`` (JSON). For fl_lightning's paths the
peak resident memory that two rounds add to the data's is measured in a spawned process: the
batched backend's grows with the block size, not with the clients of the round.

``--accelerator gpu`` (a CUDA device) times instead: the hand-written loop on the GPU (the pool on
the device, one client after another); fl_lightning's sequential backend (not for 1,000 clients: as
slow as the loop); its batched backend in blocks, in fp32 and, at the largest block, bf16-mixed
(and with ``--compile-step`` the compiled step, where the installed ``BatchedBackend`` has that
option); and the limit of the approach, one ``vmap(grad(loss))`` step over the stacked clients with
plain SGD in place, the data on the device, run eagerly, replayed as a captured CUDA graph and (with
``--compile-step``) compiled by ``torch.compile``. It
prints ms per round, the speed-up over the hand-written loop, the achieved TFLOP/s (the FLOPs that
``FlopCounterMode`` counts in a local step's forward and backward: matrix products and
convolutions) and their fraction of the card's fp32 matrix-product rate, measured in the same run
(the best of ``torch.mm`` of two 8192 x 8192 fp32 matrices, TF32 off: the whole run uses
``torch.set_float32_matmul_precision("highest")``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, Subset
from torch.utils.flop_counter import FlopCounterMode

from common import QuietLeNet, QuietLogisticRegression, QuietMLP, mnist_or_random, status_kib

from fl_lightning.algorithms import FedAvg
from fl_lightning.backends import BatchedBackend
from fl_lightning.datamodules import FederatedDataModule, SyntheticFederated
from fl_lightning.seeding import generator, sample_clients

#: where MNIST is read (``--mnist``; an environment variable, so that Flower's workers read it too)
MNIST_ENV = "FL_LIGHTNING_MNIST"

#: whether the installed ``BatchedBackend`` can compile its step (``--compile-step``)
HAS_COMPILE_STEP = "compile_step" in inspect.signature(BatchedBackend.__init__).parameters

HAND = "hand-written PyTorch"
#: the limit of the batched approach with its step compiled: what ``compile_step`` could reach
LIMIT_COMPILED = "limit: vmap(grad) step, compiled"


def mnist(num_clients: int, batch_size: int) -> FederatedDataModule:
    return mnist_or_random(os.environ.get(MNIST_ENV, "../shared/data"), num_clients=num_clients, partition="iid",
                           batch_size=batch_size)[0]


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
    rounds: int  # timed rounds of the fast paths (on a GPU: of the hand-written loop and the sequential backend)
    slow_rounds: int = 2  # timed rounds of the Trainer-per-client and Flower paths
    gpu_rounds: int = 10  # timed rounds of the batched backend and of the limit on a GPU
    sequential_on_gpu: bool = True  # whether the GPU run times the sequential backend

    @property
    def client_steps(self) -> int:
        return self.clients_per_round * self.local_steps


def _synthetic(num_clients: int = 30) -> FederatedDataModule:
    dm = SyntheticFederated(num_clients=num_clients, batch_size=10, seed=0)
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
    # the 1,000-client workloads are the GPU run's (a round of the loop takes ~17 s on an H100)
    "a1000": Workload("a1000", "logistic regression 60-10, Synthetic(1,1), 1,000 clients, 1,000/round, 20 steps of 10",
                      lambda: _synthetic(1000), lambda: QuietLogisticRegression(60, 10, lr=0.05), 1000, 20,
                      (100, 1000), rounds=2, sequential_on_gpu=False),
    "b1000": Workload("b1000", "MLP 784-200-200-10, MNIST, 1,000 clients, 1,000/round, 10 steps of 32",
                      lambda: mnist(1000, 32), lambda: QuietMLP(784, (200, 200), 10, lr=0.05), 1000, 10, (100, 1000),
                      rounds=2, sequential_on_gpu=False),
}

#: the workloads each accelerator runs by default
DEFAULT_WORKLOADS = {"cpu": ["a", "b10", "b100", "c"], "gpu": ["a", "b100", "c", "a1000", "b1000"]}


# ---------------------------------------------------------------------------------- the paths
def flops_per_step(w: Workload, dm: FederatedDataModule) -> float:
    """FLOPs of one local step (forward and backward of one mini-batch), counted by PyTorch."""
    model = w.client()
    batch = next(dm.client_data(0, "train").step_batches(1, generator(0, "flops")))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(batch[0]), batch[1]).backward()
    return float(counter.get_total_flops())


def synchronize() -> None:
    """Wait for the CUDA device's queued work, if CUDA is in use (a no-op otherwise)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def hand_written(w: Workload, dm: FederatedDataModule, rounds: int, device: str = "cpu") -> float:
    """Plain PyTorch FedAvg over the same client splits and batches, the model and the pool on
    ``device``; seconds per round."""
    torch.manual_seed(0)
    model = w.client().to(device)
    lr = model.lr
    x_all, y_all = (t.to(device) for t in dm.pool.tensors)
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
    synchronize()
    return (time.perf_counter() - start) / rounds


class _Timer(pl.Callback):
    """Wall time of the rounds after the first ``warmup`` ones."""

    def __init__(self, warmup: int = 1) -> None:
        self.warmup = warmup

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.warmup:
            synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synchronize()
        self.seconds = time.perf_counter() - self.start


def fl_lightning(w: Workload, dm: FederatedDataModule, rounds: int, backend: str, block: Optional[int] = None,
                 accelerator: str = "cpu", precision: str = "32-true", compile_step: bool = False,
                 callbacks: Sequence[pl.Callback] = ()) -> float:
    """The same FedAvg through fl_lightning on ``accelerator`` in ``precision`` in blocks of ``block``
    clients (None: the backend's default; ``compile_step``: the batched backend's compiled step), with
    ``callbacks`` added; seconds per round, a warm-up round not
    counted (two with ``compile_step``: its step compiled in the first round and once more in the
    second, 12 s and 1.6 s for workload a on 2 CPU cores)."""
    torch.manual_seed(0)
    module = FedAvg(w.client(), clients_per_round=w.clients_per_round, local_steps=w.local_steps, seed=0,
                    client_backend=backend, clients_per_block=block)
    if compile_step:
        torch.compiler.reset()  # compile anew: the earlier runs' modules count against the recompile limit
        counters.clear()
        module.engine.backend = BatchedBackend(block, compile_step=True)
    timer = _Timer(2 if compile_step else 1)
    trainer = pl.Trainer(max_epochs=rounds + timer.warmup, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[timer, *callbacks],
                         accelerator=accelerator, devices=1, precision=precision)
    trainer.fit(module, dm)
    if compile_step:  # a step that graph-breaks runs (partly) eager: say so beside its time
        breaks = sum(counters["graph_break"].values())
        print(f"    compiled step: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks", flush=True)
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


def _peak_rss_child(key: str, backend: str, block: int, threads: int) -> float:
    """In a fresh process: the peak resident memory (MB) that two fl_lightning rounds add to the data's."""
    torch.set_num_threads(threads)
    w = WORKLOADS[key]
    dm = w.datamodule()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident size (Linux >= 4.0)
    base = status_kib("VmRSS")
    fl_lightning(w, dm, 1, backend, block)
    return (status_kib("VmHWM") - base) / 1024


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


# ---------------------------------------------------------------------------------- the GPU's limit
def matmul_rate(device: str, size: int = 8192, repeats: int = 10) -> float:
    """The device's fp32 matrix-product rate in FLOP/s: the best of 3 timings of ``repeats``
    products of two ``size`` x ``size`` matrices (TF32 off, the run's float32 matmul precision)."""
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    a @ b  # warm-up: cuBLAS' handle and kernels
    best = float("inf")
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * repeats / best


def stacked_sgd_step(w: Workload, dm: FederatedDataModule, device: str) -> tuple[Callable[[], None], Tensor, Tensor]:
    """The limit of the batched approach for workload ``w``: the round's clients' parameters stacked
    on ``device`` and ``step()``, one ``vmap(grad(loss))`` over them with plain SGD in place, each
    client's batch one gather from the pool on the device at the indices in ``index``
    (clients x batch; a static input: copy a step's indices into it). Returns ``step``, ``index``
    and the round's index ``table`` (local steps x clients x batch), drawn with replacement from each
    client's split (the same gather as the loop's batches; the cost does not depend on the draws)."""
    torch.manual_seed(0)
    model = w.client().to(device)
    names = [name for name, _ in model.named_parameters()]
    clients = sample_clients(0, 0, list(dm.train_clients), w.clients_per_round)
    params = [p.detach().expand(len(clients), *p.shape).clone() for p in model.parameters()]
    x_all, y_all = (t.to(device) for t in dm.pool.tensors)
    g = generator(0, "limit")
    table = torch.stack([torch.from_numpy(dm.splits["train"][cid])[
        torch.randint(len(dm.splits["train"][cid]), (w.local_steps, dm.batch_size), generator=g)] for cid in clients],
        dim=1).to(device)
    index = table[0].clone()

    def loss(client_params: list[Tensor], client_index: Tensor) -> Tensor:
        out = torch.func.functional_call(model, dict(zip(names, client_params)), (x_all[client_index],))
        return F.cross_entropy(out, y_all[client_index])

    gradients = torch.func.vmap(torch.func.grad(loss))

    def step() -> None:
        for p, grad in zip(params, gradients(params, index)):
            p.sub_(grad, alpha=model.lr)

    return step, index, table


def captured(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured as one CUDA graph; returns its replay. As the PyTorch notes on CUDA graphs
    do: a few warm-up calls on a side stream (lazy initializations, autograd's stream use), then the
    capture on that same stream; ``step`` reads and writes only tensors allocated before (its static
    inputs and outputs), its temporaries live in the graph's private pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph.replay


def limit(w: Workload, dm: FederatedDataModule, rounds: int, device: str, capture: bool = False,
          compiled: bool = False) -> float:
    """Seconds per round of :func:`stacked_sgd_step`, ``w.local_steps`` steps a round, each the copy
    of its indices and the step: eager, (``capture``) a captured CUDA graph's replay, or
    (``compiled``) the step compiled by ``torch.compile`` (two warm-up rounds: the compile)."""
    step, index, table = stacked_sgd_step(w, dm, device)
    run = captured(step) if capture else torch.compile(step) if compiled else step
    for _ in range(2 if compiled else 1):  # warm-up
        for s in range(w.local_steps):
            index.copy_(table[s])
            run()
    synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        for s in range(w.local_steps):
            index.copy_(table[s])
            run()
    synchronize()
    return (time.perf_counter() - start) / rounds


# ---------------------------------------------------------------------------------- main
def interleaved(paths: dict[str, Callable[[], float]], repeats: int,
                errors: Optional[dict[str, str]] = None) -> dict[str, list[float]]:
    """Every path's seconds per round, ``repeats`` times, interleaved (path 1, path 2, ..., path 1,
    ...), so that the machine's background load and one-off warm-ups touch them alike. With
    ``errors``, a path that raises is recorded there (its error in one line), printed, and not run
    again, and the others go on (a GPU run is too dear to lose to one path); without, it raises."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            if errors is not None and name in errors:
                continue
            try:
                times[name].append(run())
            except Exception as error:  # noqa: BLE001 -- recorded and reported, the run goes on
                if errors is None:
                    raise
                errors[name] = f"{type(error).__name__}: {error}".splitlines()[0][:500]
                print(f"  {name}: FAILED, {errors[name]}", flush=True)
    return times


def gpu_paths(w: Workload, dm: FederatedDataModule, device: str, compile_step: bool) -> dict[str, Callable[[], float]]:
    """The paths the GPU run times for workload ``w`` (``device``: "cuda", or "cpu" to check them)."""
    accelerator = "gpu" if device == "cuda" else "cpu"
    paths: dict[str, Callable[[], float]] = {HAND: lambda: hand_written(w, dm, w.rounds, device)}
    if w.sequential_on_gpu:
        paths["fl_lightning sequential"] = lambda: fl_lightning(w, dm, w.rounds, "sequential", accelerator=accelerator)
    for block in w.blocks:
        paths[f"fl_lightning batched, block {block}"] = lambda block=block: fl_lightning(
            w, dm, w.gpu_rounds, "batched", block, accelerator)
    top = max(w.blocks)
    paths[f"fl_lightning batched, block {top}, bf16-mixed"] = lambda: fl_lightning(
        w, dm, w.gpu_rounds, "batched", top, accelerator, precision="bf16-mixed")
    if compile_step:
        paths[f"fl_lightning batched, block {top}, compiled step"] = lambda: fl_lightning(
            w, dm, w.gpu_rounds, "batched", top, accelerator, compile_step=True)
        paths[f"fl_lightning batched, block {top}, bf16-mixed, compiled step"] = lambda: fl_lightning(
            w, dm, w.gpu_rounds, "batched", top, accelerator, precision="bf16-mixed", compile_step=True)
    paths["limit: vmap(grad) step, eager"] = lambda: limit(w, dm, w.gpu_rounds, device)
    if compile_step:
        paths[LIMIT_COMPILED] = lambda: limit(w, dm, w.gpu_rounds, device, compiled=True)
    if device == "cuda":
        paths["limit: vmap(grad) step, CUDA graph"] = lambda: limit(w, dm, w.gpu_rounds, device, capture=True)
    return paths


def run_gpu(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    """The GPU run (``--accelerator gpu``): the card's fp32 matmul rate, then every workload's paths."""
    device = args.device or "cuda"
    torch.set_float32_matmul_precision("highest")  # fp32 products without TF32, the rate's and the paths'
    size = 8192 if device == "cuda" else 1024  # (a CPU check of the code paths: a quick product)
    peak = matmul_rate(device, size)
    results.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (a check of the GPU paths)",
                   cuda=torch.version.cuda, float32_matmul_precision=torch.get_float32_matmul_precision(),
                   compile_step=args.compile_step,
                   matmul_fp32={"size": size, "tflops": peak / 1e12, "tf32": False})
    print(f"{results['device']}, torch {torch.__version__}: fp32 matmul ({size}^3, TF32 off) {peak / 1e12:.1f} TFLOP/s")
    for key in args.workloads:
        w = WORKLOADS[key]
        dm = w.datamodule()
        flops = flops_per_step(w, dm)
        print(f"\n[{key}] {w.description}; {flops / 1e6:.2f} MFLOP per local step")
        errors: dict[str, str] = {}
        times = interleaved(gpu_paths(w, dm, device, args.compile_step), args.repeats, errors)
        best = {name: min(runs) for name, runs in times.items() if runs}
        tflops = {name: w.client_steps * flops / seconds / 1e12 for name, seconds in best.items()}
        hand = best.get(HAND, float("nan"))
        entry = {"description": w.description, "flops_per_step": flops, "rounds": w.rounds,
                 "gpu_rounds": w.gpu_rounds, "seconds_per_round": best, "runs": times, "errors": errors,
                 "speedup_over_hand": {name: hand / seconds for name, seconds in best.items()},
                 "tflops": tflops, "fraction_of_matmul_fp32": {name: t * 1e12 / peak for name, t in tflops.items()}}
        results["workloads"][key] = entry
        save()
        for name, seconds in best.items():
            print(f"  {name:<56} {seconds * 1e3:10.2f} ms/round  {entry['speedup_over_hand'][name]:8.1f}x hand-written"
                  f"  {tflops[name]:9.3g} TFLOP/s  {100 * entry['fraction_of_matmul_fp32'][name]:9.3g}% of fp32 matmul",
                  flush=True)


def run_cpu(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    """The CPU run: every workload's paths, with the peak memory of fl_lightning's and the slow paths."""
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
            hand = rows.get(HAND)
            speedup = f"{hand / seconds:6.2f}x" if hand else "   -   "
            rate = w.client_steps / seconds
            extra = f"  peak RSS +{rss:6.0f} MB" if rss is not None else ""
            print(f"  {name:<34} {seconds * 1e3:9.1f} ms/round  {speedup} hand-written  {rate:8.0f} client-steps/s"
                  f"  {rate * flops / 1e9:6.1f} GFLOP/s{extra}", flush=True)

        # the fast paths are timed interleaved (hand, sequential, batched..., hand, ...), the best of
        # --repeats each
        top = max(w.blocks)
        whole_round = f"fl_lightning sequential, block {w.clients_per_round}"  # one Trainer batch a round
        fast = {HAND: lambda: hand_written(w, dm, w.rounds),
                "fl_lightning sequential": lambda: fl_lightning(w, dm, w.rounds, "sequential"),
                whole_round: lambda: fl_lightning(w, dm, w.rounds, "sequential", w.clients_per_round)}
        for block in w.blocks:
            fast[f"fl_lightning batched, block {block}"] = lambda block=block: fl_lightning(w, dm, w.rounds, "batched",
                                                                                          block)
        if args.compile_step:
            fast[f"fl_lightning batched, block {top}, compiled step"] = lambda: fl_lightning(
                w, dm, w.rounds, "batched", top, compile_step=True)
            fast[LIMIT_COMPILED] = lambda: limit(w, dm, w.rounds, "cpu", compiled=True)
        times = interleaved(fast, args.repeats)
        entry["runs"] = times
        report(HAND, min(times[HAND]))
        report("fl_lightning sequential", min(times["fl_lightning sequential"]),
               peak_memory(key, "sequential", 1, args.threads))
        report(whole_round, min(times[whole_round]))
        for block in w.blocks:
            name = f"fl_lightning batched, block {block}"
            report(name, min(times[name]), peak_memory(key, "batched", block, args.threads))
        if args.compile_step:
            name = f"fl_lightning batched, block {top}, compiled step"
            report(name, min(times[name]))
            report(LIMIT_COMPILED, min(times[LIMIT_COMPILED]))
        if "trainer" not in args.skip:
            report("Trainer per client per round", trainer_per_client(w, dm, w.slow_rounds))
        if "flower" not in args.skip:
            report("Flower simulation, torch client", flower(w, w.slow_rounds, False, args.threads))
        if "flower-lightning" not in args.skip:
            report("Flower simulation, Lightning client", flower(w, w.slow_rounds, True, args.threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: the GPU run (a CUDA device; see above)")
    parser.add_argument("--workloads", nargs="+", default=None, choices=list(WORKLOADS),
                        help="default: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in DEFAULT_WORKLOADS.items()))
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every path")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the fast paths (the best counts)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["trainer", "flower", "flower-lightning"])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root (random data of its shape if absent)")
    parser.add_argument("--compile-step", action="store_true",
                        help="also time the batched backend's compiled step (BatchedBackend(compile_step=True))")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help=argparse.SUPPRESS)  # "cpu": the GPU run's code paths on the CPU, to check them
    args = parser.parse_args()
    if args.accelerator == "gpu" and args.device is None and not torch.cuda.is_available():
        sys.exit("frameworks.py: --accelerator gpu needs a CUDA device, and torch.cuda.is_available() is False here")
    if args.compile_step and not HAS_COMPILE_STEP:
        print("--compile-step: the installed BatchedBackend has no compile_step parameter; not timed")
        args.compile_step = False
    args.workloads = args.workloads or DEFAULT_WORKLOADS[args.accelerator]
    os.environ[MNIST_ENV] = os.path.abspath(args.mnist)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"accelerator": args.accelerator, "threads": args.threads, "torch": torch.__version__,
                               "workloads": {}}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    (run_gpu if args.accelerator == "gpu" else run_cpu)(args, results, save)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
