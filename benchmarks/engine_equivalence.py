"""Bitwise before/after check of an engine refactor: every algorithm, both client backends, on CPU.

Runs a tiny deterministic federation (3 rounds, 8 generated clients, few local steps, a small
MLP, fixed seeds, one CPU thread) for every algorithm class that ``fl_lightning.algorithms``
exports, with each client backend it supports (``"sequential"``; ``"batched"`` but for
:data:`SEQUENTIAL_ONLY`), plus a few engine features: ``local_epochs``, a robust aggregator, a
data-poisoning attack and a client with BatchNorm. Each case records

* ``model``: sha256 of the client module's ``state_dict()`` (names, dtypes, shapes and bytes of
  its floating tensors, in key order): the global model between rounds;
* ``store``: sha256 of every stored client-state entry (``module.engine.store``), read through the
  store's ``get``, in sorted ``(client, name)`` order;
* ``metrics``: ``trainer.callback_metrics`` as floats (with ``ClientMetrics``' per-client test accuracy);
* ``server_params``: sha256 of the sorted digests of the federated module's parameters that are
  not the client module's (the hypernetwork algorithms' server networks), independent of names;
* ``module_tensors`` (informational): sha256 of the sorted digests of every floating tensor of
  the federated module's own ``state_dict()``, independent of their names and order. It covers
  the server networks of the hypernetwork algorithms (whose client module holds no trained
  model), but a refactor may legitimately re-lay out the module's tensors, so a difference there
  is reported without failing the comparison.

Only stable public names are used (algorithm classes, models, datamodules, callbacks,
``module.client``, ``module.engine.store`` or, before the engine, ``module.store``), so the same script runs on the code before and after a
refactor::

    PYTHONPATH=<before tree> python benchmarks/engine_equivalence.py --out before.json
    PYTHONPATH=<after tree>  python benchmarks/engine_equivalence.py --out after.json
    python benchmarks/engine_equivalence.py --compare before.json after.json   # exit 1 on a difference

``--only NAME`` (repeatable, a substring of case names) runs a subset.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Iterable

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

import fl_lightning.algorithms as algorithms
from fl_lightning.algorithms import (
    PDSGD,
    RAGA,
    RFA,
    SCAFFOLD,
    ByrdSAGA,
    CompositionalFedAvg,
    FastDRO,
    FedAvg,
    FedDeper,
    FedDRO,
    FedProx,
    FedProxVR,
    LocalOnly,
    PeFLL,
    PFedHN,
)
from fl_lightning.callbacks import ClientMetrics, LabelFlipAttack, TrimmedMean
from fl_lightning.datamodules import SyntheticFederated
from fl_lightning.functional.dro import KLDRO
from fl_lightning.models import MLP, LogisticRegression
from fl_lightning.models.hypernetwork import MLPEmbedding

NUM_CLIENTS, PER_ROUND, STEPS, ROUNDS, DIM, CLASSES = 8, 4, 2, 3, 20, 10

#: exported classes that are bases of others (abstract hooks), run through their subclasses
BASES = {"LockStepCompositional": "base of FedDRO and CompositionalFedAvg",
         "HypernetworkFederation": "base of PeFLL and PFedHN"}


def mlp(momentum: float = 0.0, weight_decay: float = 0.0) -> MLP:
    """The client of most cases: a 20-8-10 MLP with a fixed initialization."""
    torch.manual_seed(0)
    return MLP(in_features=DIM, hidden=(8,), num_classes=CLASSES, lr=0.1, momentum=momentum, weight_decay=weight_decay)


class BatchNormClient(pl.LightningModule):
    """A small client with BatchNorm (running statistics are federated buffers) and momentum SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("client_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(num_clients: int = NUM_CLIENTS) -> SyntheticFederated:
    """Synthetic(1, 1): 8 small generated clients (or ``num_clients``) with val and test splits."""
    return SyntheticFederated(num_clients=num_clients, dim=DIM, num_classes=CLASSES, min_samples=20, max_samples=60,
                              batch_size=8, test_fraction=0.2, seed=0)


def common(backend: str) -> dict[str, Any]:
    """The engine arguments of every case: the backend, blocks of 3 clients (a ragged last one), the seed."""
    return {"client_backend": backend, "clients_per_block": 3, "seed": 1}


def pefll(backend: str) -> PeFLL:
    """PeFLL with a small embedding network and hypernetwork."""
    torch.manual_seed(0)
    embedding = MLPEmbedding(DIM, CLASSES, 4, hidden=(8,))
    torch.manual_seed(0)
    client = LogisticRegression(in_features=DIM, num_classes=CLASSES, lr=0.1)
    return PeFLL(client, embedding, hypernetwork_width=8, clients_per_round=PER_ROUND, local_steps=STEPS,
                 descriptor_batch_size=8, **common(backend))


def pfedhn(backend: str) -> PFedHN:
    """pFedHN with small client embeddings and hypernetwork."""
    torch.manual_seed(0)
    client = LogisticRegression(in_features=DIM, num_classes=CLASSES, lr=0.1)
    return PFedHN(client, embedding_dim=4, hypernetwork_width=8, new_client_rounds=1, clients_per_round=PER_ROUND,
                  local_steps=STEPS, **common(backend))


#: algorithm name -> builder(backend) of its tiny federation
ALGORITHMS: dict[str, Callable[[str], pl.LightningModule]] = {
    "FedAvg": lambda b: FedAvg(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "FedProx": lambda b: FedProx(mlp(), mu=0.1, clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "SCAFFOLD": lambda b: SCAFFOLD(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "FedDeper": lambda b: FedDeper(mlp(), rho=0.1, clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "FedDRO": lambda b: FedDRO(mlp(), KLDRO(lam=2.0), beta=0.5, clients_per_round=NUM_CLIENTS, local_steps=STEPS,
                               **common(b)),
    "CompositionalFedAvg": lambda b: CompositionalFedAvg(mlp(), KLDRO(lam=2.0), case="II",
                                                         clients_per_round=NUM_CLIENTS, local_steps=STEPS, **common(b)),
    "FedProxVR": lambda b: FedProxVR(mlp(), estimator="svrg", mu=0.1, clients_per_round=PER_ROUND, local_steps=STEPS,
                                     **common(b)),
    "RAGA": lambda b: RAGA(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "RFA": lambda b: RFA(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "ByrdSAGA": lambda b: ByrdSAGA(mlp(), clients_per_round=PER_ROUND, **common(b)),
    "PeFLL": pefll,
    "PFedHN": pfedhn,
    "FastDRO": lambda b: FastDRO(mlp(), alpha=0.5, clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
    "PDSGD": lambda b: PDSGD(mlp(), lam=2.0, local_steps=STEPS, **common(b)),  # one client holds every sample
    "LocalOnly": lambda b: LocalOnly(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
}

#: engine features and algorithm variants, run with both backends: name -> (builder(backend), callbacks())
FEATURES: dict[str, tuple[Callable[[str], pl.LightningModule], Callable[[], list]]] = {
    "FedAvg-local_epochs": (lambda b: FedAvg(mlp(), clients_per_round=PER_ROUND, local_epochs=1, **common(b)), list),
    "FedAvg-TrimmedMean": (lambda b: FedAvg(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
                           lambda: [TrimmedMean(num_trimmed=1)]),
    "FedAvg-LabelFlip": (lambda b: FedAvg(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS, **common(b)),
                         lambda: [LabelFlipAttack(count=3)]),
    "FedAvg-BatchNorm": (lambda b: FedAvg(BatchNormClient(), clients_per_round=PER_ROUND, local_steps=STEPS,
                                          **common(b)), list),
    "FedAvgM-client_momentum": (lambda b: FedAvg(mlp(momentum=0.9, weight_decay=1e-3), clients_per_round=PER_ROUND,
                                                 local_steps=STEPS, server_momentum=0.9, **common(b)), list),
    "FedDeper-independent-gauss_seidel": (lambda b: FedDeper(mlp(), rho=0.1, independent_batches=True,
                                                             update_order="gauss_seidel", clients_per_round=PER_ROUND,
                                                             local_steps=STEPS, **common(b)), list),
    "SCAFFOLD-spilled_store": (lambda b: SCAFFOLD(mlp(), clients_per_round=PER_ROUND, local_steps=STEPS,
                                                  client_state_memory=0, **common(b)), list),
}

#: the algorithms the batched backend refuses at setup (its trial of their steps: ByrdSAGA's per-client
#: minibatch index, PDSGD's step reading the client's sample count)
SEQUENTIAL_ONLY = frozenset({"ByrdSAGA", "PDSGD"})

#: further sequential-only variants of algorithms: name -> builder()
SEQUENTIAL_VARIANTS: dict[str, Callable[[], pl.LightningModule]] = {
    "FedProxVR-sarah-last": lambda: FedProxVR(mlp(), estimator="sarah", mu=0.1, clients_per_round=PER_ROUND,
                                              local_steps=STEPS, output_iterate="last", **common("sequential")),
}


def cases() -> dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], list]]]:
    """Every case: ``name/backend -> (module builder, callbacks builder)``.

    Raises:
        RuntimeError: an exported algorithm has no builder here (a new class must be added).
    """
    missing = sorted(set(algorithms.__all__) - set(ALGORITHMS) - set(BASES))
    if missing:
        raise RuntimeError(f"no equivalence case for the exported algorithm(s) {missing}: add a builder to ALGORITHMS")
    out = {}
    for name, build in ALGORITHMS.items():
        backends = ["sequential"] if name in SEQUENTIAL_ONLY else ["sequential", "batched"]
        for backend in backends:
            out[f"{name}/{backend}"] = (lambda build=build, backend=backend: build(backend), list)
    for name, (build, callbacks) in FEATURES.items():
        for backend in ("sequential", "batched"):
            out[f"{name}/{backend}"] = (lambda build=build, backend=backend: build(backend), callbacks)
    for name, build in SEQUENTIAL_VARIANTS.items():
        out[f"{name}/sequential"] = (build, list)
    return out


def _digest_tensor(h: Any, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())


def model_hash(client: nn.Module) -> str:
    """sha256 of the client module's floating tensors, in ``state_dict`` key order."""
    h = hashlib.sha256()
    for name, value in client.state_dict().items():
        if value.is_floating_point():
            _digest_tensor(h, name, value)
    return h.hexdigest()


def store_hash(store: Any) -> tuple[str, int]:
    """sha256 over every stored ``(client, name)`` entry (read with ``store.get``), and their count."""
    h = hashlib.sha256()
    entries = sorted(store.entries())
    for cid, name in entries:
        _digest_tensor(h, f"{cid}|{name}", store.get(cid, name))
    return h.hexdigest(), len(entries)


def unordered_hash(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the sorted per-tensor digests of the floating ``tensors`` (independent of names and order)."""
    digests = []
    for value in tensors:
        if value.is_floating_point():
            h = hashlib.sha256()
            _digest_tensor(h, "", value)
            digests.append(h.hexdigest())
    return hashlib.sha256("".join(sorted(digests)).encode()).hexdigest()


def server_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The federated module's parameters that are not the client module's (the server networks)."""
    client = {id(p) for p in module.client.parameters()}
    return [p for p in module.parameters() if id(p) not in client]


def run_case(build: Callable[[], pl.LightningModule], callbacks: Callable[[], list]) -> dict[str, Any]:
    """Fit one federation and return its hashes and metrics."""
    torch.manual_seed(0)
    module = build()
    with tempfile.TemporaryDirectory(prefix="fl-equiv-") as root:
        trainer = pl.Trainer(max_epochs=ROUNDS, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=root,
                             callbacks=[*callbacks(), ClientMetrics(split="test")])
        trainer.fit(module, data(1 if isinstance(module, PDSGD) else NUM_CLIENTS))
        store, entries = store_hash(getattr(module, "engine", module).store)  # the store before and after Engine v4
        return {
            "model": model_hash(module.client),
            "store": store,
            "store_entries": entries,
            "server_params": unordered_hash(server_parameters(module)),
            "module_tensors": unordered_hash(module.state_dict().values()),
            "metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
        }


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def compare(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Print, per case, ``same`` or what differs; True when every case is the same."""
    ok = True
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            print(f"{case}: only in {'A' if case in a else 'B'}")
            ok = False
            continue
        x, y = a[case], b[case]
        if "error" in x or "error" in y:
            if x.get("error") != y.get("error"):
                print(f"{case}: error A={x.get('error')!r} B={y.get('error')!r}")
                ok = False
            else:
                print(f"{case}: same (both failed: {x['error']})")
            continue
        diffs = [field for field in ("model", "store", "store_entries", "server_params") if x[field] != y[field]]
        ma, mb = x["metrics"], y["metrics"]
        for name in sorted(set(ma) | set(mb)):
            if name not in ma or name not in mb:
                diffs.append(f"metric {name} only in {'A' if name in ma else 'B'}")
            elif not _same_float(ma[name], mb[name]):
                diffs.append(f"metric {name} {ma[name]!r} != {mb[name]!r}")
        note = "" if x["module_tensors"] == y["module_tensors"] else " (note: module_tensors differ, not counted)"
        print(f"{case}: {'same' if not diffs else 'DIFFERS: ' + '; '.join(diffs)}{note}")
        ok = ok and not diffs
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the cases' results (JSON) here")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="compare two result files; exit 1 on a difference")
    parser.add_argument("--only", action="append", default=[], help="run the cases whose name contains this")
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as fa, open(args.compare[1]) as fb:
            a, b = json.load(fa), json.load(fb)
        ok = compare(a, b)
        print(f"{'all' if ok else 'NOT all'} {len(set(a) | set(b))} cases the same")
        return 0 if ok else 1
    if not args.out:
        parser.error("give --out FILE (run) or --compare A B")

    torch.set_num_threads(1)  # bitwise results regardless of the machine's cores
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    selected = {n: c for n, c in cases().items() if not args.only or any(s in n for s in args.only)}
    results: dict[str, Any] = {}
    start = time.perf_counter()
    failed = 0
    for name, (build, callbacks) in selected.items():
        t0 = time.perf_counter()
        try:
            results[name] = run_case(build, callbacks)
        except Exception as error:  # recorded: a case that fails before and after alike is the same
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            failed += 1
        status = "error: " + results[name]["error"] if "error" in results[name] else results[name]["model"][:12]
        print(f"{name:44s} {time.perf_counter() - t0:5.1f}s  {status}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(f"{len(results)} cases ({failed} failed) in {time.perf_counter() - start:.0f}s -> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
