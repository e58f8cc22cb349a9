"""Federated evaluation: each client's own metrics (``FederatedEvaluation``) and their summaries
over clients (``functional.client_summaries.summarize``), checked against hand computations."""

from __future__ import annotations

import contextlib
import io
import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F

from fl_lightning.algorithms import FedAvg, FedDeper
from fl_lightning.callbacks import ClientMetrics, FederatedEvaluation, LocalFinetuning
from fl_lightning.callbacks.federated_evaluation import TABLE_FILE, short_name
from fl_lightning.callbacks.metric_direction import direction_from_name
from fl_lightning.functional.client_summaries import summarize
from fl_lightning.datamodules import NaturalIdPartitioner
from tests import helpers
from tests.helpers import TWO_PROCESSES, synthetic, tiny_client, trainer

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "your_dataset.md"


# ------------------------------------------------------------------ summarize
def test_summarize_against_a_hand_computation():
    values = torch.tensor([0.2, 0.8, 0.5, 0.1])
    weights = torch.tensor([10.0, 30.0, 20.0, 40.0])
    out = summarize(values, weights, higher_is_better=True, percentiles=(10, 50, 90))
    assert out["weighted"] == pytest.approx((2 + 24 + 10 + 4) / 100)
    assert out["mean"] == pytest.approx(1.6 / 4)
    assert (out["worst"], out["best"]) == (pytest.approx(0.1), pytest.approx(0.8))
    # sorted 0.1, 0.2, 0.5, 0.8; position q * 3, linear between neighbours
    assert out["p10"] == pytest.approx(0.1 + 0.3 * 0.1)
    assert out["p50"] == pytest.approx(0.35)
    assert out["p90"] == pytest.approx(0.5 + 0.7 * 0.3)
    lower = summarize(values, weights, higher_is_better=False, percentiles=())
    assert (lower["worst"], lower["best"]) == (pytest.approx(0.8), pytest.approx(0.1))
    assert set(lower) == {"weighted", "mean", "worst", "best"}
    unknown = summarize(values, weights, higher_is_better=None, percentiles=(2.5,))
    assert set(unknown) == {"weighted", "mean", "p2.5"}


def test_summarize_refuses_what_it_cannot_summarize():
    with pytest.raises(ValueError, match="non-empty 1-D"):
        summarize(torch.tensor([]), torch.tensor([]), None)
    with pytest.raises(ValueError, match="shape of values"):
        summarize(torch.ones(3), torch.ones(2), None)
    with pytest.raises(ValueError, match="positive sum"):
        summarize(torch.ones(2), torch.zeros(2), None)
    with pytest.raises(ValueError, match=r"percentiles must be in \[0, 100\]"):
        summarize(torch.ones(2), torch.ones(2), None, percentiles=(150,))


def test_names_and_directions():
    assert [short_name(n) for n in ("val/mse", "val_acc", "test/f1", "train_loss", "val_", "mse")] == [
        "mse", "acc", "f1", "loss", "val_", "mse"]
    assert direction_from_name("top1_acc") is True
    assert direction_from_name("AUROC") is True
    assert direction_from_name("mse") is False
    assert direction_from_name("mean_abs_err") is False
    assert direction_from_name("bias") is None
    assert direction_from_name("acc_loss") is None  # the words disagree
    assert direction_from_name("interrupts") is None  # words, not substrings


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="split"):
        FederatedEvaluation(split="holdout")
    with pytest.raises(ValueError, match="hook"):
        FederatedEvaluation(hook="training_step")
    with pytest.raises(ValueError, match="fraction must be in \\(0, 1\\]"):
        FederatedEvaluation(fraction=0.0)
    with pytest.raises(ValueError, match="at most one of fraction and num_clients"):
        FederatedEvaluation(fraction=0.5, num_clients=3)
    with pytest.raises(ValueError, match="cohort"):
        FederatedEvaluation(cohort="random")
    with pytest.raises(ValueError, match="percentiles"):
        FederatedEvaluation(percentiles=(10, 101))
    assert FederatedEvaluation(split="test").hook == "test_step"
    assert FederatedEvaluation().prefix == "clients_val"
    assert FederatedEvaluation(split="test", clients="unseen").prefix == "clients_unseen_test"


# ------------------------------------------------------------------ cohorts
def federation(num_clients: int = 20, seed: int = 0) -> SimpleNamespace:
    """What ``cohort_of`` reads of the engine."""
    dm = SimpleNamespace(train_clients=list(range(num_clients - 4)),
                         unseen_clients=list(range(num_clients - 4, num_clients)), num_clients=num_clients)
    return SimpleNamespace(engine=SimpleNamespace(datamodule=dm), seed=seed)


def test_a_sampled_cohort_is_reproducible_and_changes_with_the_round():
    evaluation = FederatedEvaluation(fraction=0.3, min_clients=2)
    module = federation()
    cohorts = [evaluation.cohort_of(module, r) for r in range(5)]
    assert cohorts == [FederatedEvaluation(fraction=0.3, min_clients=2).cohort_of(federation(), r) for r in range(5)]
    assert all(len(c) == 4 and c == sorted(c) and set(c) <= set(range(16)) for c in cohorts)  # int(0.3 * 16)
    assert len({tuple(c) for c in cohorts}) > 1
    other_seed = [evaluation.cohort_of(federation(seed=1), r) for r in range(5)]
    assert other_seed != cohorts
    assert FederatedEvaluation(fraction=0.1, min_clients=3).cohort_size(16) == 3
    assert FederatedEvaluation(num_clients=5, clients="all").cohort_of(module, 0) != list(range(5))


def test_a_fixed_cohort_is_the_same_every_round():
    evaluation = FederatedEvaluation(num_clients=3, clients="unseen", cohort="fixed")
    cohorts = [evaluation.cohort_of(federation(), r) for r in range(4)]
    assert all(c == cohorts[0] for c in cohorts) and set(cohorts[0]) <= {16, 17, 18, 19}
    assert FederatedEvaluation().cohort_of(federation(), 7) == list(range(16))  # the whole population
    with pytest.raises(ValueError, match=r"num_clients=5 is above the number of 'unseen' clients \(4\)"):
        FederatedEvaluation(num_clients=5, clients="unseen").cohort_of(federation(), 0)


# ------------------------------------------------------------------ a regression client
class Regressor(pl.LightningModule):
    """Linear regression of the Synthetic label read as a number: logs an MSE and an MAE (scalars),
    a torchmetrics MeanAbsoluteError under a name that tells no direction, and a bias (no direction)."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.net = nn.Linear(20, 1)
        self.l1 = torchmetrics.MeanAbsoluteError()
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred, target = self(x), y.float()
        self.log("val/mse", F.mse_loss(pred, target))
        self.log("val/mae", (pred - target).abs().mean())
        self.l1(pred, target)
        self.log("val/l1", self.l1)
        self.log("val/bias", (pred - target).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def by_hand(module, dm, clients, personalized=True) -> dict[str, list[float]]:
    """Each client's MSE, MAE and bias on its whole val split, with its model."""
    out: dict[str, list[float]] = {"mse": [], "mae": [], "bias": [], "n": []}
    saved = module.global_model.flatten()
    with torch.no_grad():
        for cid in clients:
            state = module.client_eval_state(cid) if personalized else None
            if state is not None:
                module.global_model.load(state)
            x, y = dm.client_data(cid, "val").full()
            error = module.client.eval()(x) - y.float()
            module.global_model.load(saved)
            out["mse"].append(float((error ** 2).mean()))
            out["mae"].append(float(error.abs().mean()))
            out["bias"].append(float(error.mean()))
            out["n"].append(len(y))
    return out


def logged(t: pl.Trainer, prefix: str = "clients_val/") -> dict[str, float]:
    return {k: float(v) for k, v in t.callback_metrics.items() if k.startswith(prefix)}


def test_a_regression_clients_figures_equal_a_hand_computation(tmp_path):
    dm = synthetic(8, val_fraction=0.3, eval_batch_size=7)  # several batches per client
    torch.manual_seed(0)
    module = FedAvg(Regressor(), clients_per_round=4, local_steps=3, seed=1)
    evaluation = FederatedEvaluation(fraction=0.5, table=True)
    t = trainer(2, callbacks=[evaluation], default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"direction of 'val/bias' is unknown.*higher_is_better=\{'bias': True\}"):
        t.fit(module, dm)
    cohort = evaluation.cohort_of(module, 1)
    assert len(cohort) == 4  # int(0.5 * 8 training clients)
    hand = by_hand(module, dm, cohort)
    figures = logged(t)
    n = torch.tensor(hand["n"], dtype=torch.float64)
    for metric, higher in (("mse", False), ("mae", False), ("bias", None)):
        values = torch.tensor(hand[metric], dtype=torch.float64)
        assert figures[f"clients_val/{metric}_weighted"] == pytest.approx(float((values * n).sum() / n.sum()), rel=1e-5)
        assert figures[f"clients_val/{metric}_mean"] == pytest.approx(float(values.mean()), rel=1e-5)
        for q in (10, 90):
            expected = float(torch.quantile(values, q / 100))
            assert figures[f"clients_val/{metric}_p{q}"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        if higher is None:
            assert f"clients_val/{metric}_worst" not in figures
        else:
            assert figures[f"clients_val/{metric}_worst"] == pytest.approx(max(hand[metric]), rel=1e-5)
            assert figures[f"clients_val/{metric}_best"] == pytest.approx(min(hand[metric]), rel=1e-5)
    # the torchmetrics Metric: computed per client, its direction (lower) declared by the Metric
    assert figures["clients_val/l1_mean"] == pytest.approx(figures["clients_val/mae_mean"], rel=1e-5)
    assert figures["clients_val/l1_worst"] == pytest.approx(max(hand["mae"]), rel=1e-5)
    assert figures["clients_val/num_clients"] == 4
    # the weighted MSE is the pooled MSE over the cohort's samples
    pooled = sum(m * k for m, k in zip(hand["mse"], hand["n"])) / sum(hand["n"])
    assert figures["clients_val/mse_weighted"] == pytest.approx(pooled, rel=1e-5)
    # the table: one compact line per evaluation, the same per-client values
    lines = (tmp_path / TABLE_FILE).read_text().splitlines()
    assert len(lines) == 2 and all(len(line) < 2000 for line in lines)
    rows = [json.loads(line) for line in lines]
    assert [row["round"] for row in rows] == [1, 2]
    assert rows[0]["clients"] == evaluation.cohort_of(module, 0) and rows[1]["clients"] == cohort
    assert rows[1]["num_samples"] == hand["n"]
    assert rows[1]["metrics"]["val/mse"] == pytest.approx(hand["mse"], rel=1e-5)
    assert sorted(rows[1]["metrics"]) == ["val/bias", "val/l1", "val/mae", "val/mse"]
    assert rows[1]["prefix"] == "clients_val" and rows[1]["personalized"] is True


def test_the_direction_argument_gives_worst_and_best_without_a_warning():
    torch.manual_seed(0)
    module = FedAvg(Regressor(), clients_per_round=2, local_steps=1)
    t = trainer(1, callbacks=[FederatedEvaluation(higher_is_better={"val/bias": True}, percentiles=())])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*direction.*")
        t.fit(module, synthetic(4, val_fraction=0.3))
    figures = logged(t)
    assert figures["clients_val/bias_best"] >= figures["clients_val/bias_worst"]
    assert not any("_p10" in k or "_p90" in k for k in figures)


def test_an_empty_split_warns_once_and_logs_nothing():
    t = trainer(2, callbacks=[FederatedEvaluation(split="test")])
    with pytest.warns(UserWarning, match=r"FederatedEvaluation\(split='test', clients='train'\) has nothing to "
                                         r"evaluate and logs nothing: none of the 4 clients it draws from has 'test' "
                                         r"data: "
                                         r"test_fraction=0 holds out no test data: set test_fraction > 0"):
        t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4, test_fraction=0.0))
    assert not any(name.startswith("clients_test/") for name in t.callback_metrics)


class Uneven(helpers.RegressionData):
    """120 regression samples in 4 natural clients of 3, 3, 57 and 57 samples."""

    def partition_keys(self):
        return np.repeat([0, 1, 2, 3], [3, 3, 57, 57])


def test_clients_without_data_in_the_split_are_left_out_with_a_warning_saying_why():
    """Two clients too small for val_fraction=0.1 hold no val sample: the warning (once) names them
    and why; the figures are the two others'. When none has any, the warning says why too."""
    evaluation = FederatedEvaluation()
    t = trainer(2, callbacks=[evaluation])
    data = Uneven(num_clients=None, partitioner=NaturalIdPartitioner(), val_fraction=0.1)
    with pytest.warns(UserWarning) as caught:
        t.fit(FedAvg(helpers.Regressor(), clients_per_round=2, local_steps=2), data)
    mine = [str(w.message) for w in caught if "FederatedEvaluation" in str(w.message)]
    assert mine == ["FederatedEvaluation(split='val', clients='train'): 2 of the 4 clients of the cohort have no 'val' "
                    "data and are left out of its figures (clients_val/num_clients counts the clients evaluated): "
                    "val_fraction=0.1 holds out round(0.1 x n) of a client's samples, and 2 client(s) are too small "
                    "for any (client 0: round(0.1 x 3) = 0, client 1: round(0.1 x 3) = 0): raise val_fraction, or "
                    "make fewer, larger clients"]
    figures = logged(t)
    assert figures["clients_val/num_clients"] == 2 and "clients_val/mse_mean" in figures
    small = trainer(1, callbacks=[FederatedEvaluation(clients="all")])  # no val set: no validation runs
    with pytest.warns(UserWarning, match=r"FederatedEvaluation\(split='val', clients='all'\) has nothing to evaluate "
                                         r"and logs nothing: none of the 4 clients it draws from has 'val' data: "
                                         r"val_fraction=0.1 holds out .* 4 client\(s\) are too small for any "
                                         r"\(client 0: round\(0.1 x 2\) = 0"):
        small.fit(FedAvg(helpers.Regressor(), clients_per_round=2, local_steps=1),
                  helpers.RegressionData(n=8, val_fraction=0.1))


def test_client_metrics_figures_are_the_classifiers_own_accuracy_per_client():
    """ClientMetrics' accuracy summaries are FederatedEvaluation's of the classifier's own ``test_acc``."""
    dm = synthetic(6, test_fraction=0.3)
    t = trainer(1, callbacks=[ClientMetrics(), FederatedEvaluation(split="test", prefix="own_test")])
    t.fit(FedAvg(tiny_client(), clients_per_round=3, local_steps=2), dm)
    figures = logged(t, "")
    for stat in ("mean", "worst", "p10"):
        assert figures[f"own_test/acc_{stat}"] == pytest.approx(figures[f"clients_test/acc_{stat}"], abs=1e-6)
    assert figures["own_test/loss_worst"] >= figures["own_test/loss_best"]


def test_personalized_models_are_evaluated_per_client():
    def run(personalized: bool) -> dict[str, float]:
        torch.manual_seed(0)
        module = FedDeper(Regressor(lr=0.01), clients_per_round=4, local_steps=3, seed=2)
        evaluation = FederatedEvaluation(personalized=personalized, higher_is_better={"bias": True})
        t = trainer(2, callbacks=[evaluation])
        t.fit(module, dm)
        figures = logged(t)
        hand = by_hand(module, dm, evaluation.cohort_of(module, 1), personalized)
        assert figures["clients_val/mse_mean"] == pytest.approx(sum(hand["mse"]) / len(hand["mse"]), rel=1e-5)
        return figures

    dm = synthetic(4, val_fraction=0.3)
    personal, shared = run(True), run(False)
    assert abs(personal["clients_val/mse_mean"] - shared["clients_val/mse_mean"]) > 1e-4


# ------------------------------------------------------------------ DDP
def ddp_run(devices: int, backend: str) -> dict[str, float]:
    torch.manual_seed(0)
    module = FedAvg(Regressor(), clients_per_round=4, local_steps=2, seed=3, client_backend=backend)
    evaluation = FederatedEvaluation(fraction=0.5, higher_is_better={"bias": True})
    strategy = TWO_PROCESSES if devices > 1 else "auto"
    clients = ClientMetrics(split=["train", "val"])  # two splits, each client's model made once
    finetuned = LocalFinetuning(steps=3, split="val")  # each process finetunes its share of the clients
    t = trainer(2, callbacks=[evaluation, clients, finetuned], devices=devices, strategy=strategy)
    t.fit(module, synthetic(8, val_fraction=0.3, eval_batch_size=5))
    return {**logged(t, "clients_"), **logged(t, "finetuned_")}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_two_processes_log_the_figures_of_one(backend):
    one, two = ddp_run(1, backend), ddp_run(2, backend)
    assert one.keys() == two.keys() and {"clients_val/l1_mean", "clients_train/acc_mean", "clients_val/acc_worst",
                                         "finetuned_val/acc_mean"} <= set(one)
    for name in one:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-7), name


# ------------------------------------------------------------------ the guide's example
def guide_section() -> tuple[str, str]:
    """The guide's regression example, whose FederatedEvaluation its federated evaluation section
    explains (its python blocks: the module and datamodule, then the fit) and the output it shows."""
    text = GUIDE.read_text()
    section = text.split("## Regression and other targets", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
    shown = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return code, shown


def test_the_guides_example_prints_what_the_guide_shows(tmp_path, monkeypatch):
    code, shown = guide_section()
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(GUIDE), "exec"), {})
    assert printed.getvalue() == shown


# ------------------------------------------------------------------ the shipped config
def test_the_config_logs_both_cohorts_and_writes_the_table(tmp_path, monkeypatch):
    from fl_lightning.cli import FederatedCLI

    monkeypatch.setattr("sys.argv", ["fl-lightning"])
    config = str(Path(__file__).resolve().parents[1] / "configs" / "federated_evaluation.yaml")
    cli = FederatedCLI(args=["fit", "--config", config, "--trainer.max_epochs", "1", "--trainer.logger", "false",
                             "--trainer.check_val_every_n_epoch", "1", "--trainer.enable_progress_bar", "false",
                             "--model.init_args.local_steps", "2", "--trainer.default_root_dir", str(tmp_path)])
    figures = logged(cli.trainer, "clients_")
    assert figures["clients_val/num_clients"] == 20 and figures["clients_unseen_val/num_clients"] == 5
    assert figures["clients_val/acc_worst"] <= figures["clients_val/acc_p10"] <= figures["clients_val/acc_best"]
    assert figures["clients_unseen_val/loss_worst"] >= figures["clients_unseen_val/loss_best"]
    (row,) = [json.loads(line) for line in (tmp_path / TABLE_FILE).read_text().splitlines()]
    assert row["prefix"] == "clients_val" and len(row["clients"]) == 20
    assert set(row["metrics"]) == {"val_acc", "val_loss"}


def test_pefll_clients_are_evaluated_with_their_generated_models():
    """PeFLL's clients are evaluated with the model its hypernetwork generates for each of them."""
    import copy

    from fl_lightning.vectors import ModelVector
    from tests.test_pefll import pefll

    dm = synthetic(6, val_fraction=0.3)
    module = pefll(clients_per_round=3)
    t = trainer(2, callbacks=[FederatedEvaluation(prefix="own"), FederatedEvaluation(personalized=False, prefix="global")])
    t.fit(module, dm)
    figures = logged(t, "")
    assert figures["own/loss_mean"] != pytest.approx(figures["global/loss_mean"], rel=1e-4)
    (result,) = module.engine.evaluate_clients([0], "val")
    personal = copy.deepcopy(module.client)
    ModelVector(personal).load(module.client_eval_state(0))
    (x, y), = dm.client_data(0, "val").epoch_batches(1, batch_size=len(dm.client_data(0, "val")))
    with torch.no_grad():
        logits = personal.eval()(x)
    assert result.metrics["val_loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)
    assert result.metrics["val_acc"] == pytest.approx(float((logits.argmax(-1) == y).float().mean()), abs=1e-6)
