"""``FederatedEvaluation``: each client's own metrics, by its module's ``validation_step``, and their
distribution over clients.

After each validation run (not the sanity check), a cohort of clients is evaluated: the client
module's own ``validation_step`` (or ``test_step``) runs on each client's split with the client's
model (the global model, or the algorithm's personalized model for that client), and whatever it
logs is collected per client (:meth:`~fl_lightning.engine.FederationEngine.evaluate_clients`). For every logged metric the
callback logs its summary over clients
(:func:`~fl_lightning.functional.client_summaries.summarize`): ``clients_val/mse_weighted``,
``clients_val/mse_mean``, ``clients_val/mse_worst``, ``clients_val/mse_best``,
``clients_val/mse_p10``, ``clients_val/mse_p90``, and ``clients_val/num_clients``.

The cohort is every selected client, a ``fraction`` of them (at least ``min_clients``: Flower's
``fraction_evaluate`` and ``min_evaluate_clients``) or ``num_clients`` of them, drawn from the
run's seed and the round (``cohort="sampled"``) or once for the whole run (``cohort="fixed"``,
curves comparable across rounds). The draw does not depend on the number of processes: under
DDP the cohort is divided over processes and the results gathered, so every process logs the
figures of one process. Clients of the cohort whose split is empty (too small for the datamodule's
``val_fraction``, say) are left out of the figures, with a warning (once) saying how many and why;
``{prefix}/num_clients`` counts the clients evaluated.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Mapping, Optional, Sequence

import torch

from fl_lightning.callbacks.client_metrics import POPULATIONS, Population, default_prefix, population
from fl_lightning.distributed import all_gather_object, rank_and_world
from fl_lightning.functional.client_summaries import summarize
from fl_lightning.callbacks.metric_direction import direction_from_name
from fl_lightning.datamodules.client_data import SPLITS, Split
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl, rank_zero_warn
from fl_lightning.seeding import generator
from fl_lightning.update import ClientResult
from fl_lightning.validation import check_int, check_number

#: the name of the per-client table in the run's folder (one JSON line per evaluation)
TABLE_FILE = "client_metrics.jsonl"
#: prefixes of logged names left out of the summaries' names (``val/mse`` -> ``mse``)
SPLIT_PREFIXES = ("val/", "val_", "test/", "test_", "train/", "train_")


def short_name(name: str) -> str:
    """A logged name without its split prefix (``val/mse`` and ``val_mse`` -> ``mse``)."""
    for prefix in SPLIT_PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


class FederatedEvaluation(FederatedCallback):
    """Evaluate a cohort of clients with their module's own metrics after each validation run,
    and log each metric's distribution over clients.

    Args:
        split: the clients' split to evaluate (``val``, ``test``, or ``train``: the data they
            train on, large and optimistic).
        hook: the client module's hook to run (default: ``validation_step``, or ``test_step`` for
            ``split="test"``).
        clients: the clients to draw the cohort from: ``train`` (those that take part in
            training), ``unseen`` or ``all``.
        fraction: the fraction of those clients to evaluate (Flower's ``fraction_evaluate``):
            ``max(min_clients, int(fraction * clients))``.
        min_clients: the fewest clients a fractional cohort has (Flower's ``min_evaluate_clients``).
        num_clients: the cohort's size as a count, instead of ``fraction``.
        cohort: ``sampled`` (drawn from the run's seed and the round at every evaluation) or
            ``fixed`` (drawn once from the seed: the same clients every round).
        percentiles: the percentiles over clients to log, each in [0, 100].
        higher_is_better: each metric's direction, by its logged or short name
            (``{"mse": False}``); otherwise the direction declared by the torchmetrics ``Metric``
            logged, otherwise the words of the name (``acc``, ``f1``, ``auroc``... higher;
            ``loss``, ``mse``, ``mae``, ``error``... lower). A metric of unknown direction has no
            ``worst``/``best`` (with a warning naming it).
        personalized: evaluate each client with its personalized model (the algorithm's
            ``client_eval_state``) when the algorithm has one; False: the global model.
        table: also append every evaluation's per-client table to ``client_metrics.jsonl`` in
            the run's folder (one JSON line per evaluation; see :meth:`table_row`).
        prefix: the names' prefix (default ``clients_<split>`` or ``clients_unseen_<split>``).
    """

    def __init__(
        self,
        split: Split = "val",
        hook: Optional[Literal["validation_step", "test_step"]] = None,
        clients: Population = "train",
        fraction: float = 1.0,
        min_clients: int = 1,
        num_clients: Optional[int] = None,
        cohort: Literal["sampled", "fixed"] = "sampled",
        percentiles: Sequence[float] = (10, 90),
        higher_is_better: Optional[Mapping[str, bool]] = None,
        personalized: bool = True,
        table: bool = False,
        prefix: Optional[str] = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
        hook = hook or ("test_step" if split == "test" else "validation_step")
        if hook not in ("validation_step", "test_step"):
            raise ValueError(f"hook must be 'validation_step' or 'test_step', got {hook!r}")
        if clients not in POPULATIONS:
            raise ValueError(f"clients must be 'train', 'unseen' or 'all', got {clients!r}")
        if cohort not in ("sampled", "fixed"):
            raise ValueError(f"cohort must be 'sampled' or 'fixed', got {cohort!r}")
        check_number("fraction", fraction, 0.0, 1.0, low_open=True, high_open=False)
        check_int("min_clients", min_clients, 1)
        if num_clients is not None:
            check_int("num_clients", num_clients, 1)
            if fraction < 1.0:
                raise ValueError(f"give at most one of fraction and num_clients, got fraction={fraction}, "
                                 f"num_clients={num_clients}")
        for q in percentiles:
            check_number("percentiles", q, 0.0, 100.0, high_open=False)
        self.split = split
        self.hook = hook
        self.clients = clients
        self.fraction = fraction
        self.min_clients = min_clients
        self.num_clients = num_clients
        self.cohort = cohort
        self.percentiles = tuple(percentiles)
        self.higher_is_better = dict(higher_is_better or {})
        self.personalized = personalized
        self.table = table
        self.prefix = prefix or default_prefix("clients", split, clients)
        self._folder: Optional[str] = None
        self._warned_empty = False  # warned that no client of a cohort has data in the split
        self._warned_some_empty = False  # warned that some have none
        self._warned: set[str] = set()  # the metrics of unknown direction warned about

    # ------------------------------------------------------------ the cohort
    def candidates(self, module: Federation) -> list[int]:
        """The clients the cohort is drawn from, by id."""
        return population(module.engine.datamodule, self.clients)

    def cohort_size(self, available: int) -> int:
        """How many of ``available`` clients an evaluation takes."""
        if self.num_clients is not None:
            size, asked = self.num_clients, f"num_clients={self.num_clients}"
        else:
            size = max(self.min_clients, int(self.fraction * available))
            asked = f"min_clients={self.min_clients} (with fraction={self.fraction})"
        if size > available:
            raise ValueError(f"{type(self).__name__}: {asked} is above the number of {self.clients!r} clients "
                             f"({available})")
        return size

    def cohort_of(self, module: Federation, round_idx: int) -> list[int]:
        """The clients evaluated in round ``round_idx`` (0-based), sorted by id: the same on every
        process, drawn from ``(seed, "evaluate", round_idx)`` (``cohort="fixed"``: from
        ``(seed, "evaluate")``, the same every round)."""
        candidates = self.candidates(module)
        size = self.cohort_size(len(candidates))
        if size == len(candidates):
            return candidates
        keys = ("evaluate",) if self.cohort == "fixed" else ("evaluate", round_idx)
        order = torch.randperm(len(candidates), generator=generator(module.seed, *keys))
        return sorted(candidates[i] for i in order[:size].tolist())

    # ------------------------------------------------------------ the hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.table:  # on every process: trainer.log_dir is a collective under DDP
            self._folder = trainer.log_dir or trainer.default_root_dir

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        candidates = self.candidates(pl_module)
        self.cohort_size(len(candidates))  # refuse an impossible cohort before training
        dm = pl_module.engine.datamodule
        if all(len(dm.splits[self.split][c]) == 0 for c in candidates):  # (an empty val set: no validation runs)
            self.warn_empty(pl_module, candidates, "it draws from")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        if trainer.sanity_checking:
            return
        round_idx = pl_module.current_epoch
        cohort = self.cohort_of(pl_module, round_idx)
        self.warn_empty(pl_module, cohort)
        results = self.evaluate(pl_module, cohort)
        if not results:
            return
        for name, value in self.summaries(results).items():
            log_agreed(pl_module, name, value, batch_size=1)
        if self.table and trainer.is_global_zero:
            self.write_table(results, round_idx)

    def warn_empty(self, module: Federation, clients: Sequence[int], which: str = "of the cohort") -> None:
        """Warn (once) when some of ``clients`` (those ``which``) have no data in the split, which leaves
        them out of the figures, or when none has any, which leaves nothing to log; the datamodule says why."""
        dm = module.engine.datamodule
        empty = [c for c in clients if len(dm.splits[self.split][c]) == 0]
        if not empty or (self._warned_some_empty if len(empty) < len(clients) else self._warned_empty):
            return
        who = f"{type(self).__name__}(split={self.split!r}, clients={self.clients!r})"
        if len(empty) < len(clients):
            self._warned_some_empty = True
            rank_zero_warn(f"{who}: {len(empty)} of the {len(clients)} clients {which} have no {self.split!r} data and "
                           f"are left out of its figures ({self.prefix}/num_clients counts the clients evaluated): "
                           f"{dm.empty_split_reason(self.split, empty)}")
        else:
            self._warned_empty = True
            rank_zero_warn(f"{who} has nothing to evaluate and logs nothing: none of the {len(clients)} clients "
                           f"{which} has {self.split!r} data: {dm.empty_split_reason(self.split, empty)} (or choose "
                           "another split)")

    # ------------------------------------------------------------ evaluation and summaries
    def evaluate(self, module: Federation, cohort: Sequence[int]) -> list[ClientResult]:
        """The cohort's evaluation, from all processes (each evaluates ``cohort[rank::world]``),
        sorted by client id."""
        rank, world = rank_and_world()
        mine = module.engine.evaluate_clients(list(cohort[rank::world]), self.split, self.hook, self.personalized)
        everyone = [result for part in all_gather_object(mine) for result in part]
        return sorted(everyone, key=lambda result: result.client_id)

    def summaries(self, results: Sequence[ClientResult]) -> dict[str, float]:
        """The logged figures of ``results``: ``{prefix}/{metric}_{stat}`` for every metric, and
        ``{prefix}/num_clients``."""
        names = sorted({name for result in results for name in result.metrics})
        shorts = [short_name(name) for name in names]
        out = {f"{self.prefix}/num_clients": float(len(results))}
        for name, short in zip(names, shorts):
            label = short if shorts.count(short) == 1 else name  # val_loss and val/loss: keep both whole
            scored = [result for result in results if name in result.metrics]
            values = torch.tensor([result.metrics[name] for result in scored], dtype=torch.float64)
            weights = torch.tensor([result.num_samples for result in scored], dtype=torch.float64)
            summary = summarize(values, weights, self.direction(name, scored), self.percentiles)
            out.update({f"{self.prefix}/{label}_{stat}": value for stat, value in summary.items()})
        return out

    def direction(self, name: str, results: Sequence[ClientResult]) -> Optional[bool]:
        """Whether higher is better for the logged ``name``: the ``higher_is_better`` argument (by
        the logged or the short name), else the logged Metric's declaration, else the name's
        words; None (with a warning, once per name) when none says."""
        short = short_name(name)
        for key in (name, short):
            if key in self.higher_is_better:
                return bool(self.higher_is_better[key])
        declared = {result.higher_is_better[name] for result in results if name in result.higher_is_better}
        if len(declared) == 1:
            return declared.pop()
        guessed = direction_from_name(short)
        if guessed is None and name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(
                f"{type(self).__name__}: the direction of {name!r} is unknown (its name tells none and no "
                f"torchmetrics Metric declares one): {self.prefix}/{short}_worst and _best are not logged; "
                f"set higher_is_better={{{short!r}: True}} (or False) to log them")
        return guessed

    # ------------------------------------------------------------ the table
    def table_row(self, results: Sequence[ClientResult], round_idx: int) -> dict[str, Any]:
        """One evaluation's per-client table, by column: ``round`` (1-based, the loggers' step),
        ``prefix``, ``split``, ``hook``, ``personalized``, ``clients``, ``num_samples``, and
        ``metrics`` (each logged name's per-client values, in the order of ``clients``; None
        where a client did not log it)."""
        names = sorted({name for result in results for name in result.metrics})
        return {
            "round": round_idx + 1,
            "prefix": self.prefix,
            "split": self.split,
            "hook": self.hook,
            "personalized": self.personalized,
            "clients": [result.client_id for result in results],
            "num_samples": [result.num_samples for result in results],
            "metrics": {name: [result.metrics.get(name) for result in results] for name in names},
        }

    def write_table(self, results: Sequence[ClientResult], round_idx: int) -> None:
        """Append one evaluation's :meth:`table_row` to ``client_metrics.jsonl`` in the run's folder."""
        assert self._folder is not None, "set in setup"
        os.makedirs(self._folder, exist_ok=True)
        with open(os.path.join(self._folder, TABLE_FILE), "a") as f:
            f.write(json.dumps(self.table_row(results, round_idx), separators=(",", ":")) + "\n")
