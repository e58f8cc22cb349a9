"""``fl_lightning.testing.check_algorithm`` catches algorithms that break the engine's promises, each with a
message naming the property, what differed and the fix, and lets a correct one pass (every algorithm of the
package passes it: ``tests/test_contract.py``)."""

from __future__ import annotations

import re

import pytest
import pytorch_lightning as pl
import torch

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.testing import PROPERTIES, AlgorithmCheck, check_algorithm
from tests.helpers import TWO_PROCESSES


class RemembersClients(FedAvg):
    """Keeps each client's last model in a dict on ``self``: per-client state the checkpoint does not hold."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.last_models = {}

    def client_final(self, run):
        self.last_models[run.client_id] = run.end()
        return super().client_final(run)


class AppendsUpdates(FedAvg):
    """Keeps a list of the clients' updates on ``self``."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.history = []

    def client_final(self, run):
        uploads = super().client_final(run)
        self.history.append(uploads["delta"].clone())
        return uploads


class RowsInABuffer(FedAvg):
    """Writes each client's last loss into its row of a registered buffer (in the checkpoint, but written by each
    process for its own clients only)."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.register_buffer("losses", torch.zeros(6))

    def client_step(self, run, batch):
        loss, grads = run.loss_and_grad(batch)
        run.step(grads)
        self.losses[run.client_id] = loss.detach()
        return loss


class CountsOnTheClass(FedAvg):
    """Counts each client's rounds in a dict that is a class attribute."""

    rounds_of = {}

    def client_init(self, run):
        self.rounds_of[run.client_id] = self.rounds_of.get(run.client_id, 0) + 1


class Memory(torch.nn.Module):
    """A submodule that keeps per-client values in a dict."""

    def __init__(self):
        super().__init__()
        self.norms = {}


class OnASubmodule(FedAvg):
    """Keeps per-client values on a submodule of the algorithm."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.memory = Memory()

    def client_final(self, run):
        self.memory.norms[run.client_id] = float(run.start.norm())
        return super().client_final(run)


class SeenClients(FederatedCallback):
    """Adds each updating client to its module's ``seen`` set (outside the client protocol's hooks)."""

    def on_client_update(self, trainer, module, update):
        module.seen.add(update.client_id)
        return update


class GrowsOutsideTheHooks(FedAvg):
    """Collects the clients it has seen with a callback of its own: a set that grows with the clients seen."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.seen = set()

    def configure_callbacks(self):
        return [*super().configure_callbacks(), SeenClients()]


@pytest.mark.parametrize("cls, attribute, found", [
    (RemembersClients, "self.last_models", "new keys"),
    (AppendsUpdates, "self.history", "length"),
    (RowsInABuffer, "self.losses", "entries"),
    (CountsOnTheClass, "CountsOnTheClass.rounds_of", "keys"),
    (OnASubmodule, "self.memory.norms", "new keys"),
])
def test_per_client_state_on_the_module_is_caught(cls, attribute, found):
    with pytest.raises(AssertionError) as caught:
        check_algorithm(cls, properties="client_state", local_steps=2)
    message = str(caught.value)
    assert message.startswith(f"check_algorithm({cls.__name__}) [client_state]: {attribute} is changed by the client "
                              "hooks of clients [")
    assert found in message and "in round 0" in message
    assert "self.add_client_state(name, default)" in message and "run.state[name]" in message


def test_state_that_grows_with_the_clients_seen_is_caught():
    with pytest.raises(AssertionError, match=re.escape("[client_state]: self.seen grows during the run, from 3 "
                                                       "entries after round 0 to ")):
        check_algorithm(GrowsOutsideTheHooks, properties="client_state", local_steps=2)


class CachesTheRound(FedAvg):
    """Caches a value of the round on ``self``, computed by the round's first client: not per-client state."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.cached_round = -1
        self.start_norm = torch.zeros(())

    def client_init(self, run):
        if self.cached_round != run.round:
            self.cached_round = run.round
            self.start_norm = run.start.norm()


def test_a_cache_of_the_round_is_not_per_client_state():
    assert check_algorithm(CachesTheRound, properties="client_state", local_steps=2) == {"client_state": "passed"}


class NoisySteps(FedAvg):
    """Adds noise from the global RNG to each local step: the batched backend draws it per block of clients."""

    def client_step(self, run, batch):
        loss, grads = run.loss_and_grad(batch)
        run.step([g + 0.01 * torch.randn_like(g) for g in grads])
        return loss


def test_a_batched_run_that_differs_is_caught():
    with pytest.raises(AssertionError) as caught:
        check_algorithm(NoisySteps, properties="batched", local_steps=2)
    message = str(caught.value)
    assert re.match(r"check_algorithm\(NoisySteps\) \[batched\]: the batched backend's run differs from the "
                    r"sequential backend's by more than 1e-05: after round 0, module\.client\.\S+ differs by ", message)
    assert "batchable = False" in message


class MomentumOnAnAttribute(FedAvg):
    """Server momentum kept as a plain tensor attribute: not in the checkpoint."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.velocity = torch.zeros(self.global_model.dim)

    def server_update(self, aggregate):
        self.velocity = 0.9 * self.velocity + aggregate["delta"]
        self.global_model.load(self.engine.round_start + self.velocity)


class MomentumInABuffer(MomentumOnAnAttribute):
    """The same server momentum, registered: in the checkpoint."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        del self.velocity
        self.register_buffer("velocity", torch.zeros(self.global_model.dim))


def test_state_lost_across_a_resume_is_caught():
    with pytest.raises(AssertionError) as caught:
        check_algorithm(MomentumOnAnAttribute, properties="resume", local_steps=2)
    message = str(caught.value)
    assert message.startswith("check_algorithm(MomentumOnAnAttribute) [resume]: a run stopped after round 0 and "
                              "resumed from its checkpoint differs from the uninterrupted run: after round 1, module.")
    assert "[self.velocity] changed from round to round and are not parameters or buffers" in message
    assert "self.register_buffer(name, tensor)" in message
    assert check_algorithm(MomentumInABuffer, properties="resume", local_steps=2) == {"resume": "passed"}


class LargestUpdate(FederatedCallback):
    """Tracks the largest update norm of the run in the module's buffer."""

    def on_client_update(self, trainer, module, update):
        module.largest.copy_(torch.maximum(module.largest, update.tensors["delta"].norm()))
        return update


class TracksTheLargestUpdate(FedAvg):
    """Reads every update it receives (a callback of its own), NaN included."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.register_buffer("largest", torch.zeros(()))

    def configure_callbacks(self):
        return [*super().configure_callbacks(), LargestUpdate()]


def test_an_update_with_nan_that_reaches_the_server_is_caught():
    with pytest.raises(AssertionError, match=re.escape(
            "check_algorithm(TracksTheLargestUpdate) [nonfinite_update]: client ") + r"\d+" + re.escape(
            "'s update of round 1, all NaN, made the round's result non-finite, so the round was refused")):
        check_algorithm(TracksTheLargestUpdate, properties="nonfinite_update", local_steps=2)


class AveragesWhatItSaw(FedAvg):
    """Averages the deltas its clients left on ``self`` instead of the aggregate: on two processes, each
    process sees only its own clients'."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.deltas = []

    def client_final(self, run):
        uploads = super().client_final(run)
        self.deltas.append(uploads["delta"].clone())
        return uploads

    def server_update(self, aggregate):
        self.global_model.load(self.engine.round_start + torch.stack(self.deltas).mean(0))
        self.deltas = []


def test_two_processes_that_differ_from_one_are_caught():
    with pytest.raises(AssertionError, match=re.escape(
            "check_algorithm(AveragesWhatItSaw) [two_processes]: two processes differ from one by more than 1e-05: "
            "after round 0, module.client.")):
        check_algorithm(AveragesWhatItSaw, properties="two_processes", two_process_strategy=TWO_PROCESSES,
                        local_steps=2)


class ReadsTheTrainersData(FedAvg):
    """Its client step reads the batch size from the engine's datamodule, which a node without a Trainer lacks."""

    def client_step(self, run, batch):
        loss, grads = run.loss_and_grad(batch)
        run.step([g * (self.engine.datamodule.batch_size / len(batch[0])) for g in grads])
        return loss


class UndeclaredServerState(FedAvg):
    """Its clients read a server value (a buffer the server update changes) that it does not declare with
    ``add_broadcast``: a node's copy of the algorithm keeps the initial value."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.register_buffer("scale", torch.ones(()))

    def client_step(self, run, batch):
        loss, grads = run.loss_and_grad(batch)
        run.step([g * self.scale for g in grads])
        return loss

    def server_update(self, aggregate):
        super().server_update(aggregate)
        self.scale.mul_(0.5)


@pytest.mark.parametrize("cls, found", [
    (ReadsTheTrainersData, "round of round 1 without a Trainer fails (RuntimeError: ReadsTheTrainersData is not "
                           "attached to a `Trainer`.)"),
    (UndeclaredServerState, "round of round 1 without a Trainer differs from the fit's in upload delta"),
])
def test_client_hooks_that_need_more_than_a_node_has_are_caught(cls, found):
    with pytest.raises(AssertionError, match=re.escape(f"check_algorithm({cls.__name__}) [without_trainer]: client ")
                       + ".*" + re.escape(found) + ".*run.data.*self.add_broadcast"):
        check_algorithm(cls, properties="without_trainer", rounds=2, local_steps=2)


def test_declared_server_state_reaches_a_node():
    class DeclaredServerState(UndeclaredServerState):
        def __init__(self, client, **kwargs):
            super().__init__(client, **kwargs)
            self.add_broadcast("scale")

    assert check_algorithm(DeclaredServerState, properties="without_trainer", rounds=2, local_steps=2) == {
        "without_trainer": "passed"}


def test_a_module_that_does_not_pickle_is_caught_before_starting_processes():
    class Local(FedAvg):
        pass

    with pytest.raises(AssertionError, match=re.escape("check_algorithm(Local) [two_processes]: the module does not "
                                                       "pickle (") + ".*define Local at the top level"):
        check_algorithm(Local, properties="two_processes")


def test_a_correct_algorithm_passes_and_the_global_rng_is_left_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    report = check_algorithm(FedAvg, properties=[p for p in PROPERTIES if p != "two_processes"], local_steps=2)
    assert report == {"client_state": "passed", "batched": "passed", "resume": "passed", "nonfinite_update": "passed",
                      "without_trainer": "passed"}
    assert torch.equal(torch.rand(3), expected)


def test_the_client_and_data_can_be_given():
    from tests.helpers import synthetic, tiny_client

    report = check_algorithm(FedAvg, tiny_client, lambda: synthetic(5), properties=("client_state", "resume"),
                             rounds=2, clients_per_round=2, local_steps=1)
    assert report == {"client_state": "passed", "resume": "passed"}


def test_the_batched_backends_arguments_go_to_the_batched_run_only():
    """``compile_step=True`` is refused by the sequential backend: the other runs are built without it."""
    check = AlgorithmCheck(FedAvg, compile_step=True, clients_per_block=3, local_steps=2)
    assert check.batched_kwargs == {"clients_per_block": 3, "compile_step": True}
    assert check.build().hparams["compile_step"] is False  # not refused: compile_step is left out


@pytest.mark.parametrize("arguments, error, words", [
    (dict(properties="speed"), ValueError, "properties must be one or some of ['client_state', 'batched', 'resume', "
                                           "'nonfinite_update', 'without_trainer', 'two_processes'], got 'speed'"),
    (dict(properties=[]), ValueError, "properties must be one or some of"),
    (dict(rounds=1), ValueError, "rounds must be >= 2 and an integer, got 1"),
    (dict(client_backend="batched"), ValueError, "client_backend='batched': the checks choose the backend"),
])
def test_bad_arguments_are_refused(arguments, error, words):
    with pytest.raises(error, match=re.escape(words)):
        check_algorithm(FedAvg, **arguments)


def test_the_algorithm_must_be_a_federated_module_class():
    with pytest.raises(TypeError, match=r"cls must be a FederatedModule subclass \(the algorithm's class\), got "
                                        r"<class 'pytorch_lightning.*LightningModule'>"):
        check_algorithm(pl.LightningModule)
