"""Client state store, state vectors and keyed randomness."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.seeding import derive_seed, generator, sample_clients
from fl_lightning.state import ClientStateStore, StateSpec
from fl_lightning.vectors import StateVector


def test_store_is_lazy_on_cpu_and_round_trips():
    store = ClientStateStore()
    assert store.get(3, "c") is None
    assert 3 not in store


def test_state_defaults_are_fresh_copies():
    value = torch.ones(2)
    for spec in (StateSpec(value), StateSpec(lambda: value)):
        first = spec.initial()
        first += 1
        assert torch.equal(spec.initial(), torch.ones(2))  # never the default itself
    assert StateSpec().initial() is None


def test_store_round_trips():
    store = ClientStateStore()
    store.set(3, "c", torch.full((2,), 2.0))
    assert store.get(3, "c").device.type == "cpu" and store.nbytes() == 8
    copy = ClientStateStore()
    copy.load_state_dict(store.state_dict())
    assert list(copy.clients()) == [3] and torch.equal(copy.get(3, "c"), store.get(3, "c"))


def test_store_keeps_a_copy():
    store, value = ClientStateStore(), torch.zeros(2)
    store.set(0, "v", value)
    value += 1
    assert torch.equal(store.get(0, "v"), torch.zeros(2))


def test_state_vector_round_trip_with_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    sv = StateVector(net)
    assert sv.num_params == 3 * 2 + 2 + 2 + 2 and sv.dim == sv.num_params + 4  # + running mean/var
    vec = torch.arange(sv.dim, dtype=torch.float32)
    sv.load(vec)
    assert torch.equal(sv.flatten(), vec)
    assert torch.equal(net[1].running_var, vec[-2:])
    with pytest.raises(ValueError, match="entries"):
        sv.load(torch.zeros(3))


def test_keyed_generators():
    assert derive_seed(0, "a", 1) == derive_seed(0, "a", 1) != derive_seed(0, "a", 2) != derive_seed(0, "b", 1)
    a = torch.rand(3, generator=generator(1, "x", 2))
    assert torch.equal(a, torch.rand(3, generator=generator(1, "x", 2)))


def test_sample_clients():
    picked = sample_clients(0, 5, list(range(100)), 10)
    assert picked == sorted(set(picked)) and len(picked) == 10
    assert picked == sample_clients(0, 5, list(range(100)), 10) != sample_clients(0, 6, list(range(100)), 10)
    assert sample_clients(0, 0, [4, 7], 2) == [4, 7]
    with pytest.raises(ValueError, match="clients_per_round"):
        sample_clients(0, 0, [1, 2], 3)
