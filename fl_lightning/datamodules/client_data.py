"""One client's split of a dataset and the mini-batches drawn from it.

Batches come from a ``torch.Generator`` the caller derives from (seed, round, client), so a
client's batch order does not depend on anything else. Tensor-backed datasets
(``TensorDataset``) are sliced directly, which is what makes per-client batching cheap;
other map-style datasets go through ``default_collate``. The batch streams are also available as
the dataset indices of each batch (``step_indices``: all steps as one table; ``epoch_indices``), so
that a backend can gather the batches of many clients at once (:func:`gather`).

The indices live where the split's ``indices`` are: on the accelerator when the datamodule put
its tensor pool there (``FederatedDataModule.place_pool``), so that a batch is one gather on the
device. The permutations are always drawn on the CPU (the same numbers on every device) and the
small permutation is moved to the indices, never the other way round. A batch that must still
cross from the host (a pool kept in host memory) can be copied from pinned memory while the
previous step runs (:func:`prefetched`, :func:`to_device` with ``pinned=True``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Literal, Optional, Sequence, TypeVar, get_args

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset, default_collate

from fl_lightning.lightning_package import move_data_to_device

#: a client's share of its data: what it trains on, validates on and is tested on
Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)

T = TypeVar("T")
U = TypeVar("U")


def take_rows(source: Tensor, index: Tensor) -> Tensor:
    """``source[index]`` for an integer ``index`` of any shape (``source``'s rows, ``index``'s shape
    in front), the same values: one ``index_select`` of the flattened index, which on the CPU takes a
    fifth to a third of advanced indexing's time (a step's batch gather of 1,000 clients x 10
    samples of 60 features: 0.1 against 0.6 ms; 100 x 64 MNIST images: 1.6 against 5.5 ms). A flat
    ``index`` (a sequential client's step) is selected as it is: its reshape and view cost twice the
    select of a small batch (on this CPU 6.5 against 16 us a call)."""
    if index.dim() == 1:
        return source.index_select(0, index)
    return source.index_select(0, index.reshape(-1)).view(index.shape + source.shape[1:])


def gather(dataset: Dataset, indices: Tensor) -> Any:
    """The samples of ``dataset`` at ``indices`` (any shape) as one batch whose tensors have
    ``indices``' shape in front: a ``[clients, batch]`` index gives ``[clients, batch, ...]``.
    Samples other than a ``TensorDataset``'s are collated (``default_collate``: tuples and lists of
    tensors give a tuple, dicts a dict, nested ones alike)."""
    if isinstance(dataset, TensorDataset):
        return tuple(take_rows(t, indices) for t in dataset.tensors)
    flat = default_collate([dataset[i] for i in indices.reshape(-1).tolist()])

    def shaped(t: Tensor) -> Tensor:
        return t.reshape(*indices.shape, *t.shape[1:])

    if isinstance(flat, (list, tuple)):
        return tuple(apply_to_collection(part, Tensor, shaped) for part in flat)
    return apply_to_collection(flat, Tensor, shaped)


def to_device(batch: Any, device: torch.device, pinned: bool = False) -> Any:
    """``batch`` on ``device``: as it is when it is a tuple of tensors there already (the common
    case, checked without walking the collection), else moved by Lightning's ``move_data_to_device``
    (which copies to a CUDA device with ``non_blocking=True``). ``pinned``: its host tensors are
    first put in pinned memory, so that the copy really runs asynchronously (for a batch
    prefetched while the previous step runs: :func:`prefetched`)."""
    if isinstance(batch, tuple) and all(isinstance(t, Tensor) and t.device == device for t in batch):
        return batch
    if pinned:
        batch = apply_to_collection(batch, Tensor, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
    return move_data_to_device(batch, device)


def prefetched(items: Iterable[T], move: Callable[[T], U]) -> Iterator[U]:
    """``move(item)`` of each of ``items``, in order, one item ahead: the next item is drawn and its
    ``move`` started before the current one is handed out (with an asynchronous ``move``, a
    host-to-device copy, the copy of batch ``k + 1`` overlaps the step on batch ``k``)."""
    iterator = iter(items)
    try:
        ahead = move(next(iterator))
    except StopIteration:
        return
    for item in iterator:
        current, ahead = ahead, move(item)
        yield current
    yield ahead


class ClientData:
    """The samples ``indices`` of ``dataset`` that belong to one client split, read in batches of ``batch_size``
    (a local step's) or ``eval_batch_size`` (a pass over the split that trains nothing: a full gradient;
    default: ``batch_size``)."""

    def __init__(self, dataset: Dataset, indices: Tensor, batch_size: int, eval_batch_size: Optional[int] = None
                 ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size}")
        self.dataset = dataset
        self.indices = torch.as_tensor(indices, dtype=torch.long)
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self._size = len(self.indices)  # a Python int: a block of a thousand clients asks for it thousands of times

    def __len__(self) -> int:
        return self._size

    def fetch(self, positions: Tensor) -> Any:
        """The batch of the split's samples at ``positions`` (positions within the split)."""
        return gather(self.dataset, take_rows(self.indices, torch.as_tensor(positions, device=self.indices.device)))

    def step_indices(self, steps: int, generator: torch.Generator) -> Tensor:
        """The dataset indices of ``steps`` batches of ``b = min(batch_size, len)`` samples, one row
        each (``[steps, b]``): each pass over the split is a fresh permutation cut into ``len // b``
        batches (the remainder is left out), the next pass starting when a batch would not fit."""
        return take_rows(self.indices, self.step_positions(steps, generator).to(self.indices.device))

    def step_positions(self, steps: int, generator: torch.Generator) -> Tensor:
        """:meth:`step_indices`' positions within the split, drawn on the host (``[steps, b]``): its
        passes' permutations cut and joined (:func:`stacked_step_positions` of this split alone)."""
        n = self._size
        if n == 0:
            raise ValueError("the client split is empty")
        b = self.step_batch_size
        k = n // b
        passes = num_passes(steps, k)
        if passes == 1:  # a sequential client's usual round: one permutation, no copy
            return torch.randperm(n, generator=generator)[: steps * b].view(steps, b)
        cut = torch.stack([torch.randperm(n, generator=generator)[: k * b] for _ in range(passes)])
        return cut.view(passes * k, b)[:steps]

    @property
    def step_batch_size(self) -> int:
        """The size of a local step's batch, ``min(batch_size, len)``."""
        return min(self.batch_size, len(self))

    def step_batches(self, steps: int, generator: torch.Generator) -> Iterator[Any]:
        """``steps`` batches of ``min(batch_size, len)`` samples, reshuffling at each pass."""
        for idx in self.step_indices(steps, generator):
            yield gather(self.dataset, idx)

    def epoch_indices(
        self, epochs: int = 1, generator: Optional[torch.Generator] = None, batch_size: Optional[int] = None
    ) -> Iterator[Tensor]:
        """The dataset indices of ``epochs`` passes in chunks of ``batch_size`` (default: the
        split's; the last chunk may be smaller); shuffled if a generator is given."""
        n, b = len(self), batch_size or self.batch_size
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
            order = order.to(self.indices.device)
            for start in range(0, n, b):
                yield take_rows(self.indices, order[start : start + b])

    def epoch_batches(
        self, epochs: int = 1, generator: Optional[torch.Generator] = None, batch_size: Optional[int] = None
    ) -> Iterator[Any]:
        """``epochs`` passes in chunks of ``batch_size`` (default: the split's; the last chunk may
        be smaller); shuffled if a generator is given, in index order otherwise."""
        for idx in self.epoch_indices(epochs, generator, batch_size):
            yield gather(self.dataset, idx)

    def full(self) -> Any:
        """The whole split as one batch."""
        return self.fetch(torch.arange(len(self)))


def num_passes(steps: int, per_pass: int) -> int:
    """The passes over a split that ``steps`` batches take, ``per_pass`` whole batches a pass (at least one)."""
    return max(1, -(-steps // per_pass))


def stacked_step_positions(splits: Sequence[ClientData], steps: int, generators: Sequence[torch.Generator]) -> Tensor:
    """Each split's positions of ``steps`` batches of ``b`` samples, ``[len(splits), steps, b]``, for
    splits of one step batch size ``b`` (:attr:`ClientData.step_batch_size`), each from its generator
    (on the host): each pass over a split is a fresh permutation cut into ``len // b`` batches (the
    remainder left out), the next pass starting when a batch would not fit. The permutations are
    drawn split by split, then put in place for all splits with a few operations (a block of a
    thousand clients would otherwise cost a slice per permutation and a concatenation per client)."""
    if len(splits) == 1:  # one client: its passes cut and joined, the same draws
        return splits[0].step_positions(steps, generators[0]).unsqueeze(0)
    sizes = [len(split) for split in splits]
    if 0 in sizes:
        raise ValueError("the client split is empty")
    b = splits[0].step_batch_size
    if any(split.step_batch_size != b for split in splits):
        raise ValueError(f"the splits' step batch sizes differ: {[split.step_batch_size for split in splits]}")
    per_pass = [n // b for n in sizes]
    passes = [num_passes(steps, k) for k in per_pass]
    drawn = torch.cat([torch.randperm(n, generator=g) for n, k, g in zip(sizes, passes, generators) for _ in range(k)])
    n, k, p = (torch.tensor(values).view(-1, 1) for values in (sizes, per_pass, passes))
    first = (p * n).cumsum(0) - p * n  # where each split's permutations start in ``drawn``
    step = torch.arange(steps).view(1, -1)
    start = first + (step // k) * n + (step % k) * b  # [splits, steps]: where each batch starts in ``drawn``
    return take_rows(drawn, start.unsqueeze(-1) + torch.arange(b))


def stacked_indices(splits: Sequence[ClientData], positions: Tensor) -> Tensor:
    """``splits[i].indices[positions[i]]`` for every ``i`` (``positions``: stacked on the host, one
    row per split): one copy to the splits' device and one gather there for all of them, where
    indexing each split would cost a copy and a gather per split (on a GPU, launches and syncs per
    client)."""
    sizes = torch.tensor([0] + [len(split) for split in splits[:-1]]).cumsum(0)
    flat = torch.cat([split.indices for split in splits])
    shifted = positions + sizes.view(-1, *[1] * (positions.dim() - 1))
    return take_rows(flat, shifted.to(flat.device))
