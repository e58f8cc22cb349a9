"""A batched block's local steps: their batches gathered for several steps at once from a tensor pool
(a step at a time from any other), one setting of local work for all of them with each step's random
draws seeded as in a setting of its own, and one structure of the optimizer state from the first step on."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.backends.batched import batches as batches_module
from fl_lightning.backends.batched.backend import Block
from fl_lightning.backends.batched.batches import BatchGroup
from fl_lightning.backends.context import ClientContext
from fl_lightning.datamodules.synthetic import SyntheticFederated
from fl_lightning.optim.sgd_function import FunctionalSGD, SGDHyperparameters
from fl_lightning.seeding import keyed_rng, keyed_rngs
from tests.helpers import global_vector, synthetic, trainer
from tests.test_batched import DropoutClient, mlp
from tests.test_pool_on_device import MapStyleSynthetic


class GatherCount:
    """Counts the engine's gathers from the pool (``ClientContext.gather``) during rounds (not the
    batches of setup's trials of the client's step and of the algorithm's first step)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = ClientContext.gather

        def gather(context: ClientContext, indices: torch.Tensor):
            if (context.trainer.training and context.algorithm.engine.round_start is not None
                    and context.algorithm._current_fx_name != "setup"):
                self.calls += 1
            return original(context, indices)

        monkeypatch.setattr(ClientContext, "gather", gather)


def fit(make, map_style: bool = False) -> FedAvg:
    """Two rounds of ``make``'s federation of 6 clients, each with a full batch of 16 at every step."""
    torch.manual_seed(0)
    module = make()
    dm = (MapStyleSynthetic if map_style else SyntheticFederated)(num_clients=6, dim=20, batch_size=16,
                                                                  max_samples=80, min_samples=60)
    trainer(2).fit(module, dm)
    return module


def sgd(momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
        frozen: bool = False) -> SGDHyperparameters:
    return SGDHyperparameters(0.1, momentum, dampening, weight_decay, nesterov, frozen)


def fedavg() -> FedAvg:
    return FedAvg(mlp(), clients_per_round=4, local_steps=5, seed=1, client_backend="batched", clients_per_block=4)


def scaffold() -> SCAFFOLD:
    return SCAFFOLD(mlp(), clients_per_round=4, local_steps=5, seed=1, client_backend="batched",
                    clients_per_block=4)


@pytest.mark.parametrize("make", [fedavg, scaffold], ids=["FedAvg", "SCAFFOLD"])
def test_steps_gathered_together_or_apart_give_the_same_rounds(make, monkeypatch):
    """A block's 5 steps gathered at once (1 gather a round), 2 at a time (3) and one at a time (5)."""
    results = {}
    row = 20 * 4 + 8  # a sample's bytes: 20 float32 features and an int64 label
    one_step = 4 * 16 * row  # 4 clients x a batch of 16
    for cap, gathers in [(batches_module.GATHER_AHEAD_BYTES, 1), (2 * one_step, 3), (1, 5)]:
        monkeypatch.setattr(batches_module, "GATHER_AHEAD_BYTES", cap)
        count = GatherCount(monkeypatch)
        results[cap] = global_vector(fit(make))
        assert count.calls == 2 * gathers  # 2 rounds of one block
        monkeypatch.undo()
    reference, *others = results.values()
    for other in others:
        assert torch.equal(other, reference)


def test_a_map_style_pool_is_gathered_a_step_at_a_time(monkeypatch):
    """Its ``__getitem__`` may draw random numbers: each step gathers its own batch, inside its setting."""
    count = GatherCount(monkeypatch)
    fit(fedavg, map_style=True)
    assert count.calls == 2 * 5


def test_keyed_rngs_reseed_draws_as_a_keyed_rng_of_its_own():
    torch.manual_seed(7)
    outside = torch.get_rng_state()
    with keyed_rngs(3, "client", 2, "block") as reseed:
        together = []
        for step in range(3):
            reseed("step", step)
            together.append(torch.rand(4))
    assert torch.equal(torch.get_rng_state(), outside)  # the global stream goes on as if nothing had drawn
    for step in range(3):
        with keyed_rng(3, "client", 2, "block", "step", step):
            assert torch.equal(torch.rand(4), together[step])
    assert not torch.equal(together[0], together[1])


def test_a_blocks_steps_in_one_setting_draw_as_in_a_setting_each():
    """Dropout's masks of a block's steps run by ``_steps`` (one setting of local work) are those of
    steps each in a setting of their own (the lock-step rounds' way, ``_advance`` alone)."""
    module = FedAvg(DropoutClient(), clients_per_round=2, local_steps=3, client_backend="batched")
    trainer(1).fit(module, synthetic(2))  # attaches the Trainer
    backend, context = module.engine.backend, module.engine.context
    module.on_train_epoch_start()
    steps = [(torch.randn(8, 20), torch.randint(0, 10, (8,))) for _ in range(3)]

    def block() -> Block:
        plan = iter([[BatchGroup([0, 1], [(batch, {}), (batch, {})])] for batch in steps])
        return Block([backend.new_run(context, cid) for cid in (0, 1)], plan)

    outside = torch.get_rng_state()
    together = block()
    backend._steps(context, together)
    assert torch.equal(torch.get_rng_state(), outside)
    apart = block()
    for step, groups in enumerate(apart.plan):
        backend._advance(context, apart, groups, step, "step")
    together.unstack()
    apart.unstack()
    for a, b in zip(together.runs, apart.runs):
        assert torch.equal(a.end(), b.end())


@pytest.mark.parametrize("hyper", [sgd(), sgd(weight_decay=1e-2), sgd(0.9, dampening=0.3), sgd(0.9, nesterov=True)],
                         ids=["plain", "weight-decay", "momentum-dampening", "nesterov"])
def test_sgd_from_its_initial_state_steps_as_from_an_empty_one(hyper):
    function = FunctionalSGD([hyper, sgd(frozen=True)])
    torch.manual_seed(0)
    start = [torch.randn(3), torch.randn(2)]
    grads = [[torch.randn(3), torch.randn(2)] for _ in range(3)]
    runs = []
    for state in (function.initial_state(), []):
        params = [p.clone() for p in start]
        for g in grads:
            state = function.step_(params, g, state)
        runs.append((params, state))
    (params, state), (expected, expected_state) = runs
    assert all(torch.equal(p, q) for p, q in zip(params, expected))
    assert [s is None for s in state] == [s is None for s in expected_state]
    if hyper.momentum == 0:  # the state a step keeps is the initial one: one structure for a compiled step
        assert state == function.initial_state() == [None, None]
