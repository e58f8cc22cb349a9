"""The small federation that :func:`~fl_lightning.testing.check_algorithm` runs, and what its runs produce.

:class:`AlgorithmCheck` builds an algorithm afresh for each run (the same initial model every time), its
data and quiet CPU Trainers in a temporary folder; :func:`outcome` is what a run has produced after a round
and :func:`first_difference` says, in words, where two runs' outcomes part.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import os
import tempfile
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from fl_lightning.callbacks import FederatedCallback
from fl_lightning.datamodules import FederatedDataModule, SyntheticFederated
from fl_lightning.lightning_package import Strategy, pl
from fl_lightning.models import MLP
from fl_lightning.module import FederatedModule
from fl_lightning.testing.state_probe import StateProbe, few
from fl_lightning.validation import check_int

#: how far apart the batched backend's and the sequential backend's results, and two processes' and one's,
#: may be: the engine's documented float tolerance (README: "The batched backend" and "Multi-GPU")
TOLERANCE = 1e-5

#: the algorithm's arguments that configure the batched backend: given to the batched run only
BATCHED_ARGUMENTS = ("clients_per_block", "compile_step")

#: a run's results after each round: round -> :func:`outcome`
Outcomes = dict[int, dict[str, Tensor]]
#: a client module, or a function returning a new one (None: :func:`default_client`)
ClientSource = Union[pl.LightningModule, Callable[[], pl.LightningModule], None]
#: a datamodule, or a function returning a new one (None: :func:`default_datamodule`)
DataSource = Union[FederatedDataModule, Callable[[], FederatedDataModule], None]


def outcome(module: FederatedModule) -> dict[str, Tensor]:
    """What a run has produced so far, by name, as CPU copies: the module's floating tensors
    (``module.<name>``: the global model as ``module.client.*``, server networks and buffers), the server
    optimizer's state (``server_optimizer.<parameter index>.<key>``), a lock-step algorithm's ``shared``
    value and every client's stored entries (``store.<client>.<entry>``).

    Args:
        module: a module being fitted (read from a callback: the server optimizer is the Trainer's).
    """
    out = {f"module.{k}": v.detach().cpu().clone() for k, v in module.state_dict().items() if v.is_floating_point()}
    for index, entries in module.engine.server_optimizer.state_dict()["state"].items():
        out.update({f"server_optimizer.{index}.{key}": value.detach().cpu().clone()
                    for key, value in entries.items() if isinstance(value, Tensor)})
    shared = getattr(module, "shared", None)
    if isinstance(shared, Tensor):
        out["shared"] = shared.detach().cpu().clone()
    for client in module.engine.store.clients():
        for name in module.engine.state_specs:
            value = module.engine.store.get(client, name)
            if value is not None:
                out[f"store.{client}.{name}"] = value.detach().cpu().clone()
    return out


def first_difference(expected: Outcomes, actual: Outcomes, atol: float = 0.0) -> Optional[str]:
    """Where ``actual`` first differs from ``expected`` by more than ``atol`` (0: bitwise; NaN equals NaN), in
    words: the round, the tensor, the largest difference and where it is, how many tensors differ; None where
    both ran the same rounds and agree after each."""
    if expected.keys() != actual.keys():
        return f"the runs ended rounds {sorted(expected)} and {sorted(actual)}"
    for round_idx in sorted(actual):
        a, b = expected[round_idx], actual[round_idx]
        if a.keys() != b.keys():
            only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
            return (f"after round {round_idx} the runs hold different tensors: {few(only_a)} only in the first, "
                    f"{few(only_b)} only in the second")
        differing = [(key, found) for key, found in ((key, _difference(a[key], b[key])) for key in a)
                     if found[0] > atol]
        if differing:
            key, (size, where) = differing[0]
            return (f"after round {round_idx}, {key} differs by {size:.3g} ({where}); {len(differing)} of {len(a)} "
                    f"tensors differ: {few([k for k, _ in differing])}")
    return None


def _difference(a: Tensor, b: Tensor) -> tuple[float, str]:
    """The largest absolute difference of ``a`` and ``b`` and where it is, in words (inf where their shapes
    differ, or where one holds NaN and the other not)."""
    if a.shape != b.shape:
        return math.inf, f"shape {tuple(a.shape)} against {tuple(b.shape)}"
    x, y = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    if x.numel() == 0:
        return 0.0, "empty"
    gap = torch.where(x.isnan() & y.isnan(), torch.zeros_like(x), (x - y).abs().nan_to_num(nan=math.inf))
    index = int(gap.argmax())
    return float(gap[index]), f"entry {index}: {float(x[index]):.8g} against {float(y[index]):.8g}"


def default_client() -> pl.LightningModule:
    """The client of the checks unless one is given: an MLP of 20 inputs, 8 hidden units and 10 classes
    (SGD at 0.1), initialized from seed 0."""
    torch.manual_seed(0)
    return MLP(in_features=20, hidden=(8,), num_classes=10, lr=0.1)


def default_datamodule() -> FederatedDataModule:
    """The data of the checks unless some is given: Synthetic(1, 1) of 20 features and 10 classes over 6
    clients of 20 to 120 samples, batches of 16."""
    return SyntheticFederated(num_clients=6, dim=20, batch_size=16, min_samples=20, max_samples=120)


class AlgorithmCheck:
    """The small federation of one algorithm that the checks run: the algorithm built afresh for each run
    (the same initial model every time), its data, and quiet CPU Trainers in a temporary folder.

    Args:
        cls: the algorithm, a :class:`~fl_lightning.module.FederatedModule` subclass.
        client: the client module (copied for each run), or a function returning a new one; None:
            :func:`default_client`.
        datamodule: the data (copied for each run), or a function returning a new one; None:
            :func:`default_datamodule`.
        rounds: the rounds of each run (at least 2: the resumed run goes on after the first half).
        two_process_strategy: the two-process run's strategy (a registered name or a ``Strategy``):
            ``"fl_ddp_spawn"`` starts two fresh Python processes (their imports cost seconds; the algorithm's
            class must be importable: defined at the top level of a module); ``"fl_ddp_notebook"`` forks them
            (faster, where forking is safe: not from a process with threads of its own).
        **kwargs: the algorithm's arguments (``clients_per_round`` is 3 unless it or ``clients_fraction`` is
            given); those of the batched backend (:data:`BATCHED_ARGUMENTS`) go to the batched run only.

    Raises:
        TypeError: ``cls`` is not a ``FederatedModule`` subclass.
        ValueError: ``rounds`` is not an integer >= 2, or ``kwargs`` holds ``client_backend`` (the checks
            choose the backend of each run).
    """

    def __init__(self, cls: type[FederatedModule], client: ClientSource = None, datamodule: DataSource = None, *,
                 rounds: int = 3, two_process_strategy: Union[str, Strategy] = "fl_ddp_spawn",
                 **kwargs: Any) -> None:
        if not (isinstance(cls, type) and issubclass(cls, FederatedModule)):
            raise TypeError(f"cls must be a FederatedModule subclass (the algorithm's class), got {cls!r}")
        if "client_backend" in kwargs:
            raise ValueError(f"client_backend={kwargs['client_backend']!r}: the checks choose the backend of each "
                             "run themselves (the sequential one, and the batched one to compare); leave it out")
        self.cls = cls
        self.rounds = check_int("rounds", rounds, 2)
        self.two_process_strategy = two_process_strategy
        if "clients_per_round" not in kwargs and "clients_fraction" not in kwargs:
            kwargs["clients_per_round"] = 3
        #: the batched run's own arguments
        self.batched_kwargs = {name: kwargs.pop(name) for name in BATCHED_ARGUMENTS if name in kwargs}
        self.kwargs = kwargs
        self._client = client
        self._datamodule = datamodule
        self._folder: Optional[tempfile.TemporaryDirectory] = None

    @property
    def name(self) -> str:
        """The algorithm's class name."""
        return self.cls.__name__

    def client(self) -> pl.LightningModule:
        """A new client module, as given."""
        if self._client is None:
            return default_client()
        if isinstance(self._client, pl.LightningModule):
            return copy.deepcopy(self._client)
        return self._client()

    def data(self) -> FederatedDataModule:
        """A new datamodule, as given."""
        if self._datamodule is None:
            return default_datamodule()
        if isinstance(self._datamodule, pl.LightningDataModule):
            return copy.deepcopy(self._datamodule)
        return self._datamodule()

    def build(self, **overrides: Any) -> FederatedModule:
        """The algorithm built afresh from its arguments (copied) and ``overrides``, with the global RNG at
        seed 0."""
        kwargs = {**copy.deepcopy(self.kwargs), **overrides}
        client = self.client()
        torch.manual_seed(0)
        return self.cls(client, **kwargs)

    @property
    def folder(self) -> str:
        """The runs' temporary folder (removed by :meth:`close`)."""
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="fl-check-")
        return self._folder.name

    def close(self) -> None:
        """Remove the runs' folder."""
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def fit(self, module: FederatedModule, callbacks: Sequence[pl.Callback] = (), ckpt_path: Optional[str] = None,
            **trainer_kwargs: Any) -> Outcomes:
        """Fit ``module`` for :attr:`rounds` rounds, on one CPU process without validation, logger or
        checkpoints unless ``trainer_kwargs`` say otherwise, the run's warnings and Lightning's messages
        silenced; its :func:`outcome` after every round it ran."""
        folder = tempfile.mkdtemp(prefix="run-", dir=self.folder)
        record = RoundOutcomes(os.path.join(folder, "outcomes.pt"))
        settings: dict[str, Any] = dict(max_epochs=self.rounds, accelerator="cpu", devices=1, logger=False,
                                        enable_checkpointing=False, enable_progress_bar=False,
                                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                                        default_root_dir=folder)
        with quiet():
            trainer = pl.Trainer(callbacks=[*callbacks, record], **{**settings, **trainer_kwargs})
            trainer.fit(module, self.data(), ckpt_path=ckpt_path)
        return torch.load(record.path, weights_only=True)

    @functools.cached_property
    def reference(self) -> "Reference":
        """The reference run: the sequential backend on one process, the module watched by a
        :class:`~fl_lightning.testing.state_probe.StateProbe`."""
        module = self.build()
        probe = StateProbe(module)
        return Reference(self.fit(module, callbacks=[probe]), probe)


@dataclasses.dataclass
class Reference:
    """The reference run's results after every round, and what its probe saw."""

    outcomes: Outcomes
    probe: StateProbe


class RoundOutcomes(FederatedCallback):
    """Records a run's :func:`outcome` at the end of every round and writes them to ``path`` when training ends
    (on the first process: the way back from spawned processes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.outcomes: Outcomes = {}

    def on_round_end(self, trainer: pl.Trainer, module: Any, round_idx: int,
                     aggregate: Optional[dict[str, Tensor]]) -> None:
        if trainer.is_global_zero:
            self.outcomes[round_idx] = outcome(module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            torch.save(self.outcomes, self.path)


@contextmanager
def quiet() -> Iterator[None]:
    """The checks' runs without their warnings and Lightning's information messages."""
    lightning = logging.getLogger(pl.__name__)
    level = lightning.level
    lightning.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        lightning.setLevel(level)
