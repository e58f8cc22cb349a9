"""``ClientMetrics``: the distribution of accuracy over clients, not only its pooled mean.

After each validation run, every client's model (the global model, or the algorithm's
personalized model for that client, see ``FederatedModule.client_eval_state``) is evaluated
on the client's own split; the callback logs the mean, the worst and the 10th percentile
of client accuracy, under names that say the split (``clients_test/acc_mean``,
``clients_unseen_val/acc_worst``...). Under DDP the clients are divided over processes and the
accuracies gathered, so the figures equal the single-process ones. When every selected client's
split is empty (``test_fraction=0``, say) it warns once, saying why, instead of logging nothing
silently. Data without accuracy (targets that are not class labels: a regression's) is refused at
setup: ``FederatedEvaluation`` evaluates any client module with its own metrics.
"""

from __future__ import annotations

from typing import Any, Iterator, Literal, Optional, Sequence, Union, get_args

import torch
from torch import Tensor

from fl_lightning.callbacks.accuracy import accuracies_of, check_accuracy_data
from fl_lightning.datamodules.client_data import SPLITS, Split
from fl_lightning.distributed import gather_clients, my_clients
from fl_lightning.functional.client_summaries import summarize
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl, rank_zero_warn

#: which clients a metric callback evaluates: those that train, the unseen ones, or all
Population = Literal["train", "unseen", "all"]
POPULATIONS: tuple[Population, ...] = get_args(Population)


def accuracy_summary(accuracies: Tensor, prefix: str) -> dict[str, float]:
    """Mean (uniform over clients), worst and 10th percentile of per-client accuracies
    (:func:`~fl_lightning.functional.client_summaries.summarize`'s figures)."""
    summary = summarize(accuracies, torch.ones_like(accuracies), higher_is_better=True, percentiles=(10,))
    return {f"{prefix}/acc_{stat}": summary[stat] for stat in ("mean", "worst", "p10")}


def default_prefix(name: str, split: str, clients: str) -> str:
    """A metric prefix naming the evaluated split and, for unseen clients, that they are unseen."""
    return f"{name}_unseen_{split}" if clients == "unseen" else f"{name}_{split}"


def population(datamodule: Any, clients: str) -> list[int]:
    """The ids of the clients a metric callback draws from: ``train`` (those that take part in
    training), ``unseen`` or ``all``."""
    if clients == "train":
        return sorted(datamodule.train_clients)
    if clients == "unseen":
        return sorted(datamodule.unseen_clients)
    return list(range(datamodule.num_clients))


class ClientMetrics(FederatedCallback):
    """Log per-client accuracy statistics after validation.

    Args:
        split: the clients' split to evaluate (``test``, ``val``, or ``train``: the data they
            train on, which is large and optimistic), or several: each client's model is then
            made once (for a personalized algorithm, one generation or lookup) and evaluated on
            each, and every split logs under its own prefix.
        clients: ``train`` (clients that take part in training), ``unseen`` or ``all``.
        prefix: metric name prefix (default ``clients_<split>`` or ``clients_unseen_<split>``);
            only with a single split.
    """

    #: the first word of the default metric prefix
    name = "clients"

    def __init__(
        self,
        split: Union[Split, Sequence[Split]] = "test",
        clients: Population = "train",
        prefix: Optional[str] = None,
    ) -> None:
        splits = (split,) if isinstance(split, str) else tuple(split)
        bad = [s for s in splits if s not in SPLITS]
        if bad or not splits or len(set(splits)) != len(splits):
            raise ValueError(f"split must be 'train', 'val' or 'test', or a list of distinct ones, got {split!r}")
        if clients not in POPULATIONS:
            raise ValueError(f"clients must be 'train', 'unseen' or 'all', got {clients!r}")
        if prefix is not None and len(splits) > 1:
            raise ValueError(
                f"prefix={prefix!r} names one split's metrics and split={list(splits)!r} has {len(splits)}: leave "
                "prefix out (each split logs under its default prefix) or use one callback per split"
            )
        self.splits = splits
        self.clients = clients
        self.prefixes = {s: prefix or default_prefix(self.name, s, clients) for s in splits}
        self._warned = False

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        check_accuracy_data(pl_module, type(self).__name__)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        if trainer.sanity_checking:
            return
        results = self.evaluate(pl_module)
        for split in self.splits:
            accuracies = [acc[split] for _, acc in sorted(results.items()) if split in acc]
            if accuracies:
                for name, value in accuracy_summary(torch.tensor(accuracies), self.prefixes[split]).items():
                    log_agreed(pl_module, name, value, batch_size=1)
            elif not self._warned:
                self._warned = True
                dm = pl_module.engine.datamodule
                rank_zero_warn(
                    f"{type(self).__name__}(split={split!r}, clients={self.clients!r}) has nothing to evaluate: "
                    f"the selected clients' {split!r} splits are empty: "
                    f"{dm.empty_split_reason(split, population(dm, self.clients))} (or choose another split)"
                )

    def client_states(self, module: Federation, client_ids: Sequence[int]) -> Iterator[tuple[int, Optional[Tensor]]]:
        """``(client, the model evaluated for it)`` for each of ``client_ids``, as each is made (flat
        parameters; None: the global model): the algorithm's own model for the client
        (``FederatedModule.client_eval_state``). The one extension point of the model evaluated."""
        for cid in client_ids:
            yield cid, module.client_eval_state(cid)

    def evaluate(self, module: Federation) -> dict[int, dict[str, float]]:
        """``{client: {split: accuracy}}``: each selected client's model (:meth:`client_states`,
        made once) on each of its non-empty splits, this process's share of the clients
        (``my_clients``), gathered from all processes; clients whose splits are all empty are left out."""
        dm = module.engine.datamodule
        data = {cid: splits for cid in my_clients(population(dm, self.clients))
                if (splits := {s: d for s in self.splits if len(d := dm.client_data(cid, s)) > 0})}
        return gather_clients({cid: accuracies_of(module, state, data[cid])
                               for cid, state in self.client_states(module, list(data))})
