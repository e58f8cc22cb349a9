"""Per-round, per-client configuration of the clients' local work (``FederatedCallback.configure_client``,
Flower's ``on_fit_config_fn``): heterogeneous local steps and epochs, learning rates and dropped clients
on both backends, and ``Stragglers`` (FedProx's systems heterogeneity): keyed draws, the same on two
processes as on one, after a resume and in either backend; refusals for lock-step algorithms."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from fl_lightning import ClientConfig
from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedDRO, FedProx, FedProxVR
from fl_lightning.callbacks import FederatedCallback, Stragglers
from fl_lightning.functional.dro import KLDRO
from tests.helpers import TWO_PROCESSES, synthetic, trainer
from tests.test_batched import RecordSteps, assert_close, mlp
from tests.test_contract import Snapshot, outcome


class StopAfter(pl.Callback):
    """Stops the run after ``rounds`` rounds (as an interruption would, with the configuration unchanged)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 == self.rounds:
            trainer.should_stop = True


class Configure(FederatedCallback):
    """Each client's configuration from ``settings(round, client)``: the changes to make (Flower's
    ``on_fit_config_fn``, per client)."""

    def __init__(self, settings) -> None:
        self.settings = settings

    def configure_client(self, trainer, module, round_idx, client_id, config):
        return config.replace(**self.settings(round_idx, client_id))


class RecordUpdates(FederatedCallback):
    """Which clients sent an update in each round."""

    def __init__(self) -> None:
        self.clients: dict[int, list[int]] = {}

    def on_round_updates(self, trainer, module, updates):
        self.clients[module.current_epoch] = [u.client_id for u in updates]
        return updates


def fedavg(backend: str = "sequential", **kwargs) -> FedAvg:
    kwargs.setdefault("local_steps", 4)
    return FedAvg(mlp(), clients_per_round=5, client_backend=backend, clients_per_block=5, seed=1, **kwargs)


def fit(module, callbacks, rounds: int = 2):
    trainer(rounds, callbacks=callbacks).fit(module, synthetic(6))
    return module


# ------------------------------------------------------------------ the configuration
def test_a_client_configuration_is_checked_and_names_the_setting():
    config = ClientConfig(local_steps=5)
    assert (config.unit, config.work, config.changes_lr) == ("local_steps", 5, False)
    assert config.replace(local_steps=2, lr_scale=0.5).changes_lr
    with pytest.raises(ValueError, match="no setting 'steps'; its settings are local_steps, local_epochs, lr"):
        config.replace(steps=2)
    with pytest.raises(ValueError, match="exactly one of local_steps and local_epochs, got local_steps=5, "
                                         "local_epochs=2"):
        config.replace(local_epochs=2)
    with pytest.raises(ValueError, match="local_steps must be >= 0 and an integer, got -1"):
        config.replace(local_steps=-1)
    with pytest.raises(ValueError, match="local_epochs must be >= 1 and an integer, got 0"):
        ClientConfig(local_epochs=0)
    with pytest.raises(ValueError, match=r"lr must be > 0 and finite, got 0"):
        config.replace(lr=0)
    with pytest.raises(ValueError, match=r"lr_scale must be > 0 and finite, got nan"):
        config.replace(lr_scale=float("nan"))
    with pytest.raises(ValueError, match="drop must be True or False, got 1"):
        config.replace(drop=1)
    assert config.replace(lr=0.2, lr_scale=0.5).rates([0.1, 0.1]) == [0.1, 0.1]
    with pytest.raises(ValueError, match=r"sets lr=0.2, and the local optimizer's trainable parameter groups have "
                                         r"several rates \(\[0.1, 0.3\]\): scale them with lr_scale"):
        config.replace(lr=0.2).rates([0.1, 0.3])


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_each_client_takes_its_configured_steps_each_round(backend):
    """Steps that vary by client and round (clients of one block with different step counts), the
    same results in both backends."""
    steps = lambda round_idx, client: {"local_steps": 1 + (client + round_idx) % 4}  # noqa: E731
    record = RecordSteps()
    module = fit(fedavg(backend), [Configure(steps), record])
    assert record.steps and all(taken == steps(r, c)["local_steps"] for (r, c), taken in record.steps.items())
    assert len(set(record.steps.values())) > 1
    if backend == "batched":
        assert_close(outcome(module), outcome(fit(fedavg(), [Configure(steps)])), atol=1e-5)


def test_each_client_takes_its_configured_epochs_in_both_backends():
    epochs = lambda round_idx, client: {"local_epochs": 1 + client % 2}  # noqa: E731
    done = {}
    for backend in ("sequential", "batched"):
        record = RecordSteps()
        module = fit(fedavg(backend, local_steps=None, local_epochs=2), [Configure(epochs), record])
        done[backend] = (outcome(module), record.steps)
    sizes = synthetic(6)
    sizes.setup("fit")
    for (_, client), taken in done["sequential"][1].items():  # a pass is ceil(n / batch) steps
        assert taken == epochs(0, client)["local_epochs"] * -(-sizes.num_samples(client) // sizes.batch_size)
    assert done["batched"][1] == done["sequential"][1]
    assert_close(done["sequential"][0], done["batched"][0], atol=1e-5)


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_the_configured_learning_rate_is_set_or_scaled(backend):
    """``lr`` sets the local rate and ``lr_scale`` multiplies it: every client at half the rate is the
    run of a client module at half the rate; clients at different rates (blocks of their own in the
    batched backend) give the sequential backend's result."""
    half = lambda make: fit(fedavg(backend), [Configure(make)])  # noqa: E731
    slower = fedavg(backend)
    slower.client.lr = 0.05  # the client module's own rate: its configure_optimizers reads it
    reference = outcome(fit(slower, []))
    assert_close(outcome(half(lambda r, c: {"lr_scale": 0.5})), reference, atol=0.0)
    assert_close(outcome(half(lambda r, c: {"lr": 0.05})), reference, atol=0.0)
    rates = lambda round_idx, client: {"lr": 0.02 * (1 + client % 3)}  # noqa: E731
    mixed = outcome(fit(fedavg(backend), [Configure(rates)]))
    assert_close(mixed, outcome(fit(fedavg(), [Configure(rates)])), atol=1e-5)
    assert not torch.equal(mixed["module.client.net.1.weight"], reference["module.client.net.1.weight"])


def test_a_dropped_client_does_no_work_and_sends_nothing():
    record, updates = RecordSteps(), RecordUpdates()
    drop = lambda round_idx, client: {"drop": client % 2 == round_idx % 2}  # noqa: E731
    fit(fedavg(), [Configure(drop), record, updates])
    for round_idx, clients in updates.clients.items():
        assert clients and all(client % 2 != round_idx % 2 for client in clients)
    assert sorted(record.steps) == sorted((r, c) for r, clients in updates.clients.items() for c in clients)


def test_changing_local_steps_in_on_round_start_still_works():
    """The way before ``configure_client``: the module's ``local_steps`` set in ``on_round_start``."""

    class MoreSteps(FederatedCallback):
        def on_round_start(self, trainer, module, round_idx, clients):
            module.local_steps = 2 + round_idx

    record = RecordSteps()
    fit(fedavg(), [MoreSteps(), record])
    assert set(record.steps.items()) == {((r, c), 2.0 + r) for r, c in record.steps}


def test_configurations_the_algorithm_cannot_run_are_refused():
    epochs = Configure(lambda r, c: {"local_steps": None, "local_epochs": 2})
    with pytest.raises(ValueError, match=r"round 0: client \d's configuration \(configure_client\) gives "
                                         r"local_epochs=2, and FedAvg counts local work in local_steps "
                                         r"\(local_steps=4\): configure local_steps"):
        fit(fedavg(), [epochs])

    class Wrong(FederatedCallback):
        def configure_client(self, trainer, module, round_idx, client_id, config):
            return {"local_steps": 2}

    with pytest.raises(TypeError, match=r"Wrong.configure_client must return a ClientConfig \(config.replace\(...\)\), "
                                        "got dict"):
        fit(fedavg(), [Wrong()])
    feddro = lambda: FedDRO(mlp(), KLDRO(lam=2.0), beta=0.5, local_steps=3, clients_per_round=6)  # noqa: E731
    with pytest.raises(ValueError, match="gives local_steps=2, and FedDRO moves its clients in lock-step: every client "
                                         "takes the round's local_steps=3"):
        fit(feddro(), [Configure(lambda r, c: {"local_steps": 2})])
    with pytest.raises(ValueError, match="gives drop=True, and FedDRO moves its clients in lock-step"):
        fit(feddro(), [Configure(lambda r, c: {"drop": c == 0})])
    fit(feddro(), [Configure(lambda r, c: {"lr_scale": 0.5})], rounds=1)  # the rate alone is the algorithm's business


def test_fedproxvr_takes_the_configured_steps():
    """FedProxVR's ``tau`` is the client's configured local steps (its output iterate ``tau + 1``)."""
    record = RecordSteps()
    module = FedProxVR(mlp(), mu=0.1, lr=0.05, output_iterate="last", local_steps=4, clients_per_round=5)
    fit(module, [Configure(lambda r, c: {"local_steps": 1 + c % 3}), record])
    assert all(taken == 1 + c % 3 for (_, c), taken in record.steps.items())


# ------------------------------------------------------------------ stragglers
def stragglers_of(record: RecordSteps, full: float) -> dict[int, dict[int, float]]:
    """Each round's clients that took fewer than ``full`` steps, with their steps."""
    out: dict[int, dict[int, float]] = {}
    for (round_idx, client), taken in record.steps.items():
        if taken < full:
            out.setdefault(round_idx, {})[client] = taken
    return out


def test_partial_stragglers_do_a_keyed_random_part_of_their_work():
    """Of 5 clients at fraction 0.4, 2 straggle each round (FedProx's count), each with 1 to 3 of its 4
    steps (FedProx's ``randint(1, E)``), drawn from (seed, round, client): other seeds, other draws."""
    runs = []
    for seed in (None, None, 7):
        record = RecordSteps()
        t = trainer(3, callbacks=[Stragglers(0.4, seed=seed), record])
        t.fit(fedavg(), synthetic(6))
        runs.append(stragglers_of(record, 4.0))
        assert float(t.callback_metrics["round/stragglers"]) == 2.0
    assert runs[0] == runs[1] and runs[0] != runs[2]
    for rounds in runs:
        assert len(rounds) == 3 and all(len(clients) == 2 for clients in rounds.values())
        assert all(1 <= taken <= 3 for clients in rounds.values() for taken in clients.values())
    record = RecordSteps()
    fit(fedavg(local_steps=10), [Stragglers(1.0, min_fraction=0.5), record])
    assert set(record.steps.values()) <= {5.0, 6.0, 7.0, 8.0, 9.0}


def test_dropped_stragglers_send_no_update():
    partial, dropped = RecordSteps(), RecordUpdates()
    fit(fedavg(), [Stragglers(0.4), partial])
    fit(fedavg(), [Stragglers(0.4, mode="drop"), dropped])
    for round_idx, clients in stragglers_of(partial, 4.0).items():  # the same stragglers, dropped
        assert set(dropped.clients[round_idx]) == {c for r, c in partial.steps if r == round_idx} - set(clients)


@pytest.mark.parametrize("mode", ["partial", "drop"])
def test_stragglers_resume_bitwise(mode, tmp_path):
    build = lambda: FedProx(mlp(), mu=0.1, local_steps=4, clients_per_round=5)  # noqa: E731
    straight = fit(build(), [Stragglers(0.6, mode=mode)], rounds=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(3, callbacks=[Stragglers(0.6, mode=mode), checkpoint, StopAfter(1)],
            enable_checkpointing=True).fit(build(), synthetic(6))
    resumed = build()
    trainer(3, callbacks=[Stragglers(0.6, mode=mode)]).fit(resumed, synthetic(6), ckpt_path=str(tmp_path / "last.ckpt"))
    assert_close(outcome(straight), outcome(resumed), atol=0.0)


@pytest.mark.parametrize("mode", ["partial", "drop"])
def test_stragglers_in_the_batched_backend_give_the_sequential_result(mode):
    results = [outcome(fit(SCAFFOLD(mlp(), local_steps=4, clients_per_round=5, client_backend=backend, seed=1),
                           [Stragglers(0.6, mode=mode)], rounds=3)) for backend in ("sequential", "batched")]
    assert_close(*results, atol=1e-5)


@pytest.mark.slow
def test_stragglers_on_two_processes_give_the_result_of_one(tmp_path):
    results = []
    for devices in (1, 2):
        path = str(tmp_path / f"{devices}.pt")
        strategy = TWO_PROCESSES if devices > 1 else "auto"
        module = SCAFFOLD(mlp(), local_steps=4, clients_per_round=5, seed=1)
        callbacks = [Stragglers(0.4), Stragglers(0.4, mode="drop", seed=3), Snapshot(path)]
        trainer(2, devices=devices, strategy=strategy, callbacks=callbacks).fit(module, synthetic(6))
        results.append(torch.load(path))
    assert_close(*results, atol=1e-5)


def test_stragglers_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\], got 1.5"):
        Stragglers(1.5)
    with pytest.raises(ValueError, match="mode must be 'partial' or 'drop', got 'slow'"):
        Stragglers(0.5, mode="slow")
    with pytest.raises(ValueError, match=r"min_fraction must be in \[0, 1\), got 1"):
        Stragglers(0.5, min_fraction=1)
    with pytest.raises(ValueError, match=r"Stragglers\(mode='partial'\) gives a straggler part of its local work, and "
                                         "FedAvg's clients do local_epochs=1, which has no part: give more local work "
                                         "or use mode='drop'"):
        fit(fedavg(local_steps=None, local_epochs=1), [Stragglers(0.5)])
    fit(fedavg(local_steps=1), [Stragglers(0.5, mode="drop")], rounds=1)
    with pytest.raises(ValueError, match="Stragglers changes the local work of some of a round's clients, and FedDRO "
                                         "moves its clients in lock-step"):
        fit(FedDRO(mlp(), KLDRO(lam=2.0), beta=0.5, local_steps=3, clients_per_round=6), [Stragglers(0.5)])
