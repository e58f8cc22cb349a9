"""A client module's own metrics in validation and test under ``fl_ddp``: the whole set's, what one
process logs (``fl_lightning.evaluation_logging``, the evaluation loaders' unpadded shards of
``fl_lightning.strategy``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from fl_lightning.algorithms import FedAvg
from fl_lightning.evaluation_logging import check_no_step_syncs, epoch_value, merge, reduction_of
from fl_lightning.models import LogisticRegression
from fl_lightning.strategy import unpadded
from tests.helpers import TWO_PROCESSES, synthetic, trainer


def test_reductions_are_read_as_lightning_reads_them():
    assert [reduction_of(fx) for fx in ("mean", "AVG", "sum", "max", "min", torch.mean, sum, torch.max, min)] == \
        ["mean", "mean", "sum", "max", "min", "mean", "sum", "max", "min"]
    assert reduction_of("median") is None and reduction_of(torch.median) is None


def test_the_processes_accumulations_merge_by_their_reduction():
    key = ("loss", "")
    one = {key: ("mean", 6.0, 3, False, {}), ("worst", ""): ("max", 2.0, 1, False, {}),
           ("seen", ""): ("sum", 3.0, 1, False, {}), ("best", ""): ("min", 0.5, 1, False, {})}
    two = {key: ("mean", 2.0, 2, False, {}), ("worst", ""): ("max", 5.0, 1, False, {}),
           ("seen", ""): ("sum", 2.0, 1, False, {}), ("best", ""): ("min", 0.7, 1, False, {})}
    merged = merge([one, {}, two])
    assert epoch_value(*merged[key][:3]) == pytest.approx(8.0 / 5)  # the mean over the 5 samples
    assert {name: epoch_value(*merged[(name, "")][:3]) for name in ("worst", "seen", "best")} == \
        {"worst": 5.0, "seen": 5.0, "best": 0.5}
    assert merge([{}, two]) == two  # a name only some processes logged is theirs


class OwnSampler(DistributedSampler):
    """A sampler of the user's that pads as ``DistributedSampler`` does (and may draw differently)."""


def loader(size: int, rank: int, sampler: type = DistributedSampler) -> DataLoader:
    dataset = TensorDataset(torch.arange(size))
    return DataLoader(dataset, batch_size=4, sampler=sampler(dataset, num_replicas=2, rank=rank, shuffle=False))


def samples(dataloader: DataLoader) -> list[int]:
    return [int(i) for (batch,) in dataloader for i in batch]


def test_an_evaluation_loader_is_split_over_the_processes_without_repeating_a_sample():
    """Lightning's ``DistributedSampler`` gives 2 processes 27 + 27 of 53 samples (one twice); fl_ddp's 27 + 26."""
    assert len(samples(loader(53, 0))) + len(samples(loader(53, 1))) == 54
    shards = [samples(unpadded(loader(53, rank))) for rank in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(53))
    assert unpadded(loader(53, 1)).batch_size == 4
    even = loader(52, 1)
    assert unpadded(even) is even  # nothing to repeat: left as it is


def test_a_padding_sampler_that_cannot_be_rebuilt_or_an_empty_shard_is_refused():
    with pytest.raises(ValueError, match="OwnSampler shards 53 samples over 2 processes as 54"):
        unpadded(loader(53, 0, OwnSampler))
    with pytest.raises(ValueError, match="a loader of 1 samples on 2 processes would leave a process without any"):
        unpadded(loader(1, 0))


def test_a_client_metric_that_syncs_at_every_step_is_refused():
    client = LogisticRegression(in_features=20, num_classes=10)
    check_no_step_syncs(client)
    client.acc = MulticlassAccuracy(num_classes=10, dist_sync_on_step=True)
    with pytest.raises(ValueError, match="Metric 'acc' has dist_sync_on_step=True"):
        check_no_step_syncs(client)


class OwnMetrics(LogisticRegression):
    """Logs as most modules do, without ``sync_dist``: a mean, a sum, a maximum, a value per batch and
    on the epoch, and a torchmetrics ``Metric``, in validation and test."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(in_features=20, num_classes=10)
        self.val_accuracy = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes=10, average="micro")

    def _own(self, batch, stage: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        self.log(f"own/{stage}_loss", losses.mean())
        self.log(f"own/{stage}_seen", float(len(y)), reduce_fx="sum")
        self.log(f"own/{stage}_worst", losses.max(), reduce_fx="max")
        self.log(f"own/{stage}_forked", losses.mean(), on_step=True, on_epoch=True)
        accuracy.update(logits, y)
        self.log(f"own/{stage}_acc", accuracy)

    def validation_step(self, batch, batch_idx):
        self._own(batch, "val", self.val_accuracy)

    def test_step(self, batch, batch_idx):
        self._own(batch, "test", self.test_accuracy)


@pytest.mark.slow
def test_a_clients_own_metrics_on_two_processes_are_the_whole_sets():
    """53 validation and 53 test samples in batches of 7 (shards of 27 and 26: 4 batches each): every
    value the client logs without ``sync_dist`` is the one process's, to 1e-6; before, the first
    process's shard's (``own/val_loss`` 2.8112 for 2.8272), and a ``Metric`` counted a repeated sample."""
    logged = {}
    for devices in (1, 2):
        data = synthetic(5, seed=1, eval_batch_size=7, test_fraction=0.1)
        module = FedAvg(OwnMetrics(), clients_per_round=2)
        fit = trainer(1, devices=devices, strategy=TWO_PROCESSES if devices > 1 else "auto")
        fit.validate(module, data, verbose=False)
        metrics = dict(fit.callback_metrics)
        fit.test(module, data, verbose=False)
        logged[devices] = {name: float(value) for name, value in {**metrics, **fit.callback_metrics}.items()}
    one, two = logged[1], logged[2]
    names = [f"own/{stage}_{name}" for stage in ("val", "test") for name in ("loss", "seen", "worst", "acc")]
    names += ["own/val_forked", "own/val_forked_epoch", "own/test_forked"]
    assert one["own/val_seen"] == one["own/test_seen"] == 53
    assert {name: two[name] for name in names} == pytest.approx({name: one[name] for name in names}, rel=1e-6)
