"""The batched backend: a block of clients advances one local step together, vectorized with ``torch.func``.

Every client of a block runs ``client_init`` on its own (eagerly); then the block's runs are
stacked along a new client dimension (parameters, floating buffers, optimizer state, state
entries, scratch tensors) and ``client_step`` runs once per local step under ``torch.func.vmap``:
the client module's ``training_step`` (or forward) is evaluated with ``functional_call`` at each
client's tensors, gradients come from ``torch.func.grad``, and the local optimizer is a pure
function (:class:`~fl_lightning.optim.functional.FunctionalSGD`). After the last step the runs
are unstacked and each client runs ``client_final``; its update goes through the same callbacks
and aggregation as in the sequential backend.

What it guarantees:

* Each client sees the same mini-batches, in the same order, as in the sequential backend (the
  engine's keyed streams), so for a client module without random draws the result equals the
  sequential backend's to float tolerance.
* Clients whose batches at a step differ in shape (fewer samples than the batch size, the last
  batch of an epoch) run that step as separate vectorized calls, and clients that have finished
  their steps sit out: nothing is padded, so a mean loss (and BatchNorm's batch statistics) stay
  those of real samples, as FedJAX's pad-and-mask gives them. The price: a step where not every
  client of the block takes part copies the taking part clients' rows of the stacked state in
  and out, so ``local_epochs`` on clients of very unequal sizes can run slower than the
  sequential backend; equal-sized steps (``local_steps``) never pay it.
* A client module that draws random numbers itself (Dropout) gets independent draws for every
  client (``vmap(randomness="different")``) from the global RNG seeded by the block's key
  ``(seed, "client", first client, "block", round, last client)``: reproducible for a given seed
  and block layout, equal to the sequential backend in distribution only. The block layout
  depends on ``clients_per_block`` and on the number of processes (each process makes blocks of
  its share of the round), so such draws differ between 1 and N processes; deterministic clients
  give the same result on any number of processes.
* Memory grows with the block size (``clients_per_block``), not with the clients of the round,
  except for lock-step algorithms (FedDRO): all of a process's clients of the round advance one
  step at a time, so all their blocks are stacked at once.

What it refuses, with the reason and the way out: local optimizers other than
``torch.optim.SGD``; ``16-mixed`` (its loss scaler steps one optimizer); algorithms whose local
rule is not a function of tensors (``batchable = False``: a torch optimizer of their own, a
start model generated with a graph); a ``training_step`` that changes Python state of the client
module (a counter, a list it appends to, a tensor kept on ``self``, a torchmetrics ``Metric``
updated there), checked at the first step of every block; and one that reads a tensor's value
in Python (``.item()``, an ``if`` on a tensor), which ``vmap`` cannot run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
from pytorch_lightning.utilities.data import extract_batch_size
from torch import Tensor, nn
from torch.func import grad as func_grad
from torch.func import vmap
from torchmetrics import Metric

from fl_lightning.backends.base import ClientBackend
from fl_lightning.backends.sequential import training_loss
from fl_lightning.datamodules.client_data import gather, to_device
from fl_lightning.distributed import all_reduce_sum, rank_and_world
from fl_lightning.lightning_compat import lightning_module_attributes, routed_log, tree_flatten, tree_unflatten
from fl_lightning.local_logging import call_options
from fl_lightning.optim.functional import FunctionalSGD, functional_optimizer
from fl_lightning.run import ClientRun, Model

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


class FunctionalRun(ClientRun):
    """A client's round as tensors: the batched backend's run.

    In ``client_init`` and ``client_final`` it is one client's run, evaluated eagerly; in
    ``client_step`` and ``client_share`` (under ``vmap``) it is one client's view of the block
    (``client_id`` and ``num_samples`` are None there: a step must not depend on them).

    Args:
        module: the federated module.
        function: the local optimizer as a function.
        tensors: the trained model (parameters, then floating buffers).
        **fields: the :class:`~fl_lightning.run.ClientRun` fields.
    """

    def __init__(self, module: "FederatedModule", function: FunctionalSGD, tensors: list[Tensor], **fields: Any) -> None:
        super().__init__(**fields)
        self.module = module
        self.function = function
        self.tensors = tensors
        self.opt_state: list[Tensor] = []
        #: ``self.log`` calls of the client during a vectorized step: name -> (value * batch size, batch size)
        self.logs: dict[str, tuple[Tensor, Tensor]] = {}
        #: their options, by name
        self.log_options: dict[str, dict[str, Any]] = {}
        self._active: Model = None

    @property
    def params(self) -> list[Tensor]:
        return self.tensors[: self.layout.num_param_tensors]

    @property
    def lr(self) -> float:
        return self.function.lr

    def loss_and_grad(
        self,
        batch: Any,
        model: Model = None,
        loss_fn: Optional[Callable[[Any], Any]] = None,
        has_aux: bool = False,
    ) -> tuple[Any, list[Tensor]]:
        k = self.layout.num_param_tensors
        target = list(self.tensors if model is None else model)
        functional = self.module.functional_client

        def loss_of(params: tuple[Tensor, ...], buffers: tuple[Tensor, ...]) -> tuple[Tensor, Any]:
            tensors = [*params, *buffers]
            logs: dict[str, tuple[Tensor, Tensor]] = {}
            self._active = tensors
            try:
                with routed_log(self.module.client, self._collector(logs, batch)):
                    if loss_fn is not None:
                        out = loss_fn(batch)
                    else:
                        out = training_loss(functional.training_step(tensors, batch, self.step_index))
            finally:
                self._active = None
            loss, aux = out if has_aux else (out, None)
            carried = {"loss": loss.detach(), "logs": logs}
            if has_aux:
                carried["aux"] = aux
            return loss, carried

        with self.module.trainer.precision_plugin.forward_context():
            grads, carried = func_grad(loss_of, has_aux=True)(tuple(target[:k]), tuple(target[k:]))
        loss, aux, logs = carried["loss"], carried.get("aux"), carried["logs"]
        for name, (total, size) in logs.items():
            if name in self.logs:  # a second model of the step logged the same name: both count
                total, size = total + self.logs[name][0], size + self.logs[name][1]
            self.logs[name] = (total, size)
        return ((loss, aux), list(grads)) if has_aux else (loss, list(grads))

    def _collector(self, logs: dict[str, tuple[Tensor, Tensor]], batch: Any) -> Callable[..., None]:
        """The client's ``self.log`` inside a gradient: values are returned with the loss, with
        the call's batch size, for the round's buffered mean."""

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            options = call_options(args, kwargs)
            if isinstance(value, Metric) or options.get("reduce_fx", "mean") not in ("mean", torch.mean):
                raise ValueError(
                    f"the client's training_step logs {name!r} as a torchmetrics Metric or with another reduce_fx "
                    "than the mean: the batched backend logs per-round means only; use client_backend='sequential'"
                )
            size = options.pop("batch_size", None) or extract_batch_size(batch)
            logs[name] = (torch.as_tensor(value).detach().float().reshape(()) * size, torch.tensor(float(size)))
            self.log_options[name] = options

        return log

    def forward(self, *args: Any, model: Model = None) -> Any:
        tensors = model if model is not None else (self._active if self._active is not None else self.tensors)
        with self.module.trainer.precision_plugin.forward_context():
            return self.module.functional_client.forward(list(tensors), *args)

    def step(self, grads: Sequence[Tensor]) -> None:
        self.opt_state = self.function.step_(self.tensors[: self.layout.num_param_tensors], grads, self.opt_state)

    def end(self) -> Tensor:
        return self.layout.flatten(self.tensors)

    def restart(self, start: Tensor) -> None:
        self.start = start
        self.tensors = [t.clone() for t in self.layout.split(start)]

    def copy_model(self, vector: Optional[Tensor] = None) -> list[Tensor]:
        if vector is not None:
            return super().copy_model(vector)
        return [t.clone() for t in self.tensors]

    def fetch(self, positions: Tensor) -> Any:
        assert self.client_id is not None, "fetch is for client_init and client_final"
        data = self.module.datamodule.client_data(self.client_id, "train")
        return self.module.prepare_batch(self.client_id, data.fetch(positions))

    def epoch(self, batch_size: int) -> Iterator[Any]:
        assert self.client_id is not None, "epoch is for client_init and client_final"
        data = self.module.datamodule.client_data(self.client_id, "train")
        for batch in data.epoch_batches(1, batch_size=batch_size):
            yield self.module.prepare_batch(self.client_id, batch)

    # ------------------------------------------------------------ the carry: what a step reads and writes
    def carry(self) -> dict[str, Any]:
        """The run's per-client values (a pytree; its non-tensor leaves must agree over a block)."""
        return {"tensors": self.tensors, "opt": self.opt_state, "start": self.start, "state": self.state,
                "scratch": self.scratch}

    def load_carry(self, carry: dict[str, Any]) -> None:
        """Take the values of :meth:`carry` back."""
        self.tensors, self.opt_state, self.start = list(carry["tensors"]), list(carry["opt"]), carry["start"]
        self.state, self.scratch = dict(carry["state"]), dict(carry["scratch"])

    @classmethod
    def view(cls, template: "FunctionalRun", carry: dict[str, Any], step: int, extras: Any) -> "FunctionalRun":
        """One client's run inside a vectorized step, built from its carry."""
        run = cls(template.module, template.function, list(carry["tensors"]), client_id=None,  # type: ignore[arg-type]
                  round_idx=template.round, num_samples=None, layout=template.layout,  # type: ignore[arg-type]
                  start=carry["start"], state={}, num_steps=template.num_steps, shared=template.shared)
        run.load_carry(carry)
        run.step_index, run.steps_taken, run.extra_batches = step, step, extras  # a client at step k took k steps
        return run


class _Indices:
    """A client's batch given by its dataset indices (gathered with the block's other clients')."""

    __slots__ = ("indices",)

    def __init__(self, indices: Tensor) -> None:
        self.indices = indices


class _BlockStep:
    """One local step of every client of a block, as dataset indices ``[clients, batch]`` (and those
    of the extra streams): the batches of the whole block are gathered in one go."""

    __slots__ = ("main", "extras")

    def __init__(self, main: Tensor, extras: dict[str, Tensor]) -> None:
        self.main, self.extras = main, extras


def _step_table(module: "FederatedModule", runs: list[FunctionalRun]) -> Optional[list[_BlockStep]]:
    """The block's steps as :class:`_BlockStep` when every client takes the same number of steps with
    batches of the same size (``local_steps``), else None (``local_epochs``, a client smaller than
    the batch): each client's steps are one table of dataset indices, the block's one stack."""
    steps = runs[0].num_steps
    if steps is None or any(run.num_steps != steps for run in runs):
        return None
    tables = {stream: [module.client_step_indices(run.client_id, steps, stream) for run in runs]
              for stream in ("batches", *module.extra_batch_streams)}
    if any(len({t.shape for t in column}) != 1 for column in tables.values()):
        return None
    stacked = {stream: torch.stack(column) for stream, column in tables.items()}
    main = stacked.pop("batches")
    return [_BlockStep(main[:, k], {name: t[:, k] for name, t in stacked.items()}) for k in range(steps)]


def _index_stream(module: "FederatedModule", run: FunctionalRun) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A run's step batches as dataset indices (the engine's keyed order)."""
    extras = {s: module.client_indices(run.client_id, run.num_steps, s) for s in module.extra_batch_streams}
    for idx in module.client_indices(run.client_id, run.num_steps):
        yield _Indices(idx), {name: _Indices(next(it)) for name, it in extras.items()}


class _Block:
    """A block of clients whose runs advance together: the runs, their keyed batch streams (or,
    when every client's steps have the same shapes, the table of all its steps), and while they
    step, their carries stacked along the client dimension (built once, taken back into the runs
    once, at the end)."""

    def __init__(self, runs: list[FunctionalRun], streams: list[Iterator[tuple[Any, dict[str, Any]]]],
                 table: Optional[list[_BlockStep]] = None) -> None:
        self.runs, self.streams, self.table = runs, streams, table
        self.tensors, self.spec, self.static = _stack([run.carry() for run in runs]) if runs else ([], None, {})
        #: each step's outputs (name -> values stacked over the clients that took part, None: all of them)
        self.outputs: list[tuple[Optional[list[int]], dict[str, Tensor]]] = []
        #: whether the client module's Python state was checked in this block (at its first step)
        self.checked = False

    def record(self, members: Optional[list[int]], outputs: dict[str, Tensor]) -> None:
        """Keep a step's outputs, stacked over ``members`` (None: every client of the block)."""
        self.outputs.append((members, outputs))
        for i in range(len(self.runs)) if members is None else members:
            self.runs[i].steps_taken += 1

    def unstack(self) -> None:
        """Give every run its values back, and its step outputs (each client's series, one index per
        client when every client took every step)."""
        for i, run in enumerate(self.runs):
            run.load_carry(tree_unflatten(_merge([t[i] for t in self.tensors], self.static), self.spec))
        names = {name for _, outputs in self.outputs for name in outputs}
        for name in sorted(names):
            if all(members is None and name in out for members, out in self.outputs):
                series = torch.stack([out[name].reshape(len(self.runs)) for _, out in self.outputs], dim=1)
                for i, run in enumerate(self.runs):
                    run.record_series(name, series[i])
                continue
            for members, out in self.outputs:
                if name in out:
                    for j, i in enumerate(range(len(self.runs)) if members is None else members):
                        self.runs[i].record({name: out[name][j]})


class BatchedBackend(ClientBackend):
    """Runs blocks of ``clients_per_block`` clients, each block's local steps vectorized.

    Args:
        clients_per_block: how many clients advance together (memory grows with it).
    """

    def __init__(self, clients_per_block: int = 10) -> None:
        self.clients_per_block = clients_per_block
        self._blocks: list[_Block] = []
        self._lockstep_clients: list[list[int]] = []

    # ------------------------------------------------------------ schedule
    def num_work_items(self, module: "FederatedModule") -> int:
        if module.lockstep:
            assert module.local_steps is not None
            return module.local_steps
        _, world = rank_and_world()
        return math.ceil(math.ceil(module.clients_per_round / world) / self.clients_per_block)

    def start_round(self, module: "FederatedModule", clients: list[int]) -> list[Any]:
        self._blocks = []
        blocks = [clients[i : i + self.clients_per_block] for i in range(0, len(clients), self.clients_per_block)]
        if module.lockstep:
            self._lockstep_clients = blocks
            return list(range(self.num_work_items(module)))
        return blocks

    def run_work_item(self, module: "FederatedModule", item: Any) -> None:
        if module.lockstep:
            self._lockstep_item(module, item)
            return
        block = self._init_block(module, item)
        if block.table is not None:
            for step, block_step in enumerate(block.table):
                self._advance(module, block, block_step, step, "step")
            self._finish_block(module, block)
            return
        step = 0
        while block.runs:
            items = [next(stream, None) for stream in block.streams]
            if all(i is None for i in items):
                break
            self._advance(module, block, items, step, "step")
            step += 1
        self._finish_block(module, block)

    # ------------------------------------------------------------ runs
    def new_run(self, module: "FederatedModule", client_id: int, function: Optional[FunctionalSGD] = None
                ) -> FunctionalRun:
        """A run of ``client_id`` from the global model, with its state and ``function``, the round's
        local optimizer as a function (default: made from the client's; the same for every client
        of a round, since it holds no state)."""
        assert module.round_start is not None
        if function is None:
            function = functional_optimizer(module.local_optimizer(), module.state.params)
        start = module.round_start
        return FunctionalRun(
            module, function, [t.clone() for t in module.state.layout.split(start)],
            client_id=client_id, round_idx=module.current_epoch, num_samples=module.datamodule.num_samples(client_id),
            layout=module.state.layout, start=start, state=module.load_client_state(client_id),
            num_steps=module.local_steps, shared=module.shared,
        )

    def _init_block(self, module: "FederatedModule", clients: list[int]) -> _Block:
        runs = []
        function = functional_optimizer(module.local_optimizer(), module.state.params)
        for cid in clients:
            if not module.lockstep and module.upload_is_forged(cid):
                module.receive(module.forged_placeholder(cid), None)
                continue
            run = self.new_run(module, cid, function)
            if module.overrides_client_init:
                with module.local_work(cid, "round", run.round):
                    module.client_init(run)
            if run.optimizer is not None:
                raise ValueError(f"{type(module).__name__}.client_init sets a torch optimizer of its own; the batched "
                                 "backend runs the client's optimizer as a function: use client_backend='sequential'")
            if run.num_steps == 0 and not module.lockstep:  # no step to take (LocalOnly's spent budget): done now
                self._finish_runs(module, [run])
                continue
            runs.append(run)
        if module.changes_local_batches or any(run.batches is not None for run in runs):
            return _Block(runs, [module.step_batches(run) for run in runs])
        table = None if module.lockstep or not runs else _step_table(module, runs)
        if table is not None:
            return _Block(runs, [], table)
        return _Block(runs, [_index_stream(module, run) for run in runs])  # gathered a step at a time

    def _finish_block(self, module: "FederatedModule", block: _Block) -> None:
        block.unstack()
        self._finish_runs(module, block.runs)

    @staticmethod
    def _finish_runs(module: "FederatedModule", runs: list[FunctionalRun]) -> None:
        """``client_final`` of each run, and its update handed to the module."""
        for run in runs:
            with module.local_work(run.client_id, "final", run.round):
                uploads = module.client_final(run)
            module.receive(module.client_update(run, uploads), run.state)

    # ------------------------------------------------------------ lock-step rounds
    def _lockstep_item(self, module: "FederatedModule", step: int) -> None:
        if step == 0:
            self._blocks = [self._init_block(module, clients) for clients in self._lockstep_clients]
        items = [[next(stream) for stream in block.streams] for block in self._blocks]
        shares = [self._advance(module, block, its, step, "share") for block, its in zip(self._blocks, items)]
        if any(s is not None for s in shares):
            module.shared = module.server_share(self._weighted_mean(module, shares))
            for block in self._blocks:
                for run in block.runs:
                    run.shared = module.shared
        for block, its in zip(self._blocks, items):
            self._advance(module, block, its, step, "step")
        if step == self.num_work_items(module) - 1:
            for block in self._blocks:
                self._finish_block(module, block)
            self._blocks = []

    def _weighted_mean(self, module: "FederatedModule", shares: list[Optional[Tensor]]) -> Tensor:
        """``sum_k n_k share_k / sum_k n_k`` over all processes' clients of the round (one all-reduce)."""
        if any(s is None for s in shares):
            raise RuntimeError("client_share must return a value for every client or for none, at a given step")
        total = float(sum(module.datamodule.num_samples(c) for c in module.round_clients))
        acc: Optional[Tensor] = None
        for block, share in zip(self._blocks, shares):
            assert share is not None
            weights = torch.tensor([run.num_samples / total for run in block.runs], dtype=torch.float64,
                                   device=share.device)
            part = torch.tensordot(weights, share.to(torch.float64), dims=1)
            acc = part if acc is None else acc + part
        assert acc is not None
        return all_reduce_sum(acc)

    # ------------------------------------------------------------ one vectorized step of a block
    def _advance(self, module: "FederatedModule", block: _Block, items: Any, step: int,
                 phase: str) -> Optional[Tensor]:
        """Run ``phase`` (``"step"``: ``client_step``; ``"share"``: ``client_share``) of local step
        ``step`` for the block's clients that have a batch (``items``: one per client, None for a
        client without, or a :class:`_BlockStep` of them all), one vectorized call per batch shape;
        returns the stacked shares of the ``"share"`` phase (None if the clients share nothing)."""
        groups: dict[Any, list[int]] = {}
        if isinstance(items, _BlockStep):
            groups[None] = list(range(len(block.runs)))
        else:
            for i, item in enumerate(items):
                if item is not None:
                    groups.setdefault(_signature(item), []).append(i)
        everyone = len(groups) == 1 and len(next(iter(groups.values()))) == len(block.runs)
        results = []
        first, last = block.runs[0], block.runs[-1]
        with module.local_work(first.client_id, "block", first.round, last.client_id, phase, step):
            for members in groups.values():
                index = None if everyone else torch.tensor(members, device=block.tensors[0].device)
                tensors = block.tensors if index is None else [t.index_select(0, index) for t in block.tensors]
                given = items if isinstance(items, _BlockStep) else [items[i] for i in members]
                results.append((members, index, self._call(module, block, tensors, given, step, phase)))
                block.checked = True
        self._take_back(block, results)
        if phase == "step":
            for members, index, (_, _, _, out) in results:
                block.record(None if index is None else members, out)
            return None
        shares = {m: out["share"][j] for members, _, (_, _, _, out) in results if "share" in out
                  for j, m in enumerate(members)}
        return torch.stack([shares[i] for i in sorted(shares)]) if shares else None

    @staticmethod
    def _take_back(block: _Block, results: list) -> None:
        """Write the groups' new carries into the block's stacked carry."""
        specs = {(repr(spec), repr(static)) for _, _, (_, spec, static, _) in results}
        if len(specs) > 1:
            raise ValueError("the clients of a block changed their run values differently at one step; the batched "
                             "backend needs the same structure for every client: use client_backend='sequential'")
        _, _, (_, spec, static, _) = results[0]
        if len(results) == 1 and results[0][1] is None:  # every client, one call: take the new carry as it is
            # (a value the step made without the client dimension, a constant, comes out of vmap expanded: give
            # it memory of its own, since later steps write into the carry in place)
            block.tensors = [t.contiguous() if t.dim() and t.stride(0) == 0 else t for t in results[0][2][0]]
            block.spec, block.static = spec, static
            return
        if repr(spec) == repr(block.spec) and static == block.static:  # same structure: overwrite the groups' rows
            for _, index, (tensors, _, _, _) in results:
                for t, new in zip(block.tensors, tensors):
                    t.index_copy_(0, index, new)
            return
        if sum(len(members) for members, _, _ in results) < len(block.runs):
            raise ValueError("a step changed the structure of the run values while some clients of the block had no "
                             "batch; use client_backend='sequential'")
        full = [torch.empty((len(block.runs), *t.shape[1:]), dtype=t.dtype, device=t.device) for t in results[0][2][0]]
        for _, index, (tensors, _, _, _) in results:
            for t, new in zip(full, tensors):
                t.index_copy_(0, index, new)
        block.tensors, block.spec, block.static = full, spec, static

    def _call(self, module: "FederatedModule", block: _Block, tensors: list[Tensor], items: Any, step: int,
              phase: str) -> tuple[list[Tensor], Any, dict[int, Any], dict[str, Tensor]]:
        """One ``vmap`` of the phase's hook over stacked carries ``tensors`` (the block's structure)
        and the clients' batches (``items``: one per client, or a :class:`_BlockStep`); returns the
        new stacked carry, its structure and the hook's outputs, stacked."""
        if isinstance(items, _BlockStep):
            batch = _gather(module, items.main)
            extras = {name: _gather(module, indices) for name, indices in items.extras.items()}
        else:
            batch = _stack_batches(module, [item[0] for item in items])
            extras = {name: _stack_batches(module, [item[1][name] for item in items]) for name in items[0][1]}
        template, spec, static, side = block.runs[0], block.spec, block.static, {}
        hook = module.client_step if phase == "step" else module.client_share

        def one_client(tensors: list[Tensor], batch: Any, extras: Any) -> tuple[list[Tensor], dict[str, Tensor], dict]:
            run = FunctionalRun.view(template, tree_unflatten(_merge(tensors, static), spec), step, extras)
            out = hook(run, batch)
            new_leaves, side["spec"] = tree_flatten(run.carry())
            new_tensors, side["static"] = _split(new_leaves)
            side["options"] = run.log_options
            if phase == "share":
                return new_tensors, ({} if out is None else {"share": out}), run.logs
            return new_tensors, _named_outputs(out), run.logs

        guard = None if block.checked else _PythonState(module.client)  # at the block's first step
        try:
            new_tensors, outputs, logs = vmap(one_client, randomness="different")(tensors, batch, extras)
        except RuntimeError as error:
            if "vmap" not in str(error):
                raise
            if guard is not None:
                guard.check()  # a Metric's update, a counter: the clearer reason, where it is one
            raise ValueError(
                f"{type(module).__name__}.{'client_step' if phase == 'step' else 'client_share'} cannot be vectorized "
                "over clients: the client module's training_step (or the algorithm's step) reads a tensor's value in "
                "Python (.item(), float(), bool(), an if on a tensor, a torchmetrics update) or calls an operation "
                "torch.func.vmap does not support; use client_backend='sequential' (torch's message follows)"
            ) from error
        if guard is not None:
            guard.check()
        for name, (total, size) in logs.items():
            module.client_logs.add(name, total.sum(), int(size.sum()), side["options"].get(name, {}))
        return new_tensors, side["spec"], side["static"], outputs


# ------------------------------------------------------------------ stacking pytrees over clients
def _split(leaves: list[Any]) -> tuple[list[Tensor], dict[int, Any]]:
    """The tensor leaves, and the other leaves by position."""
    return [x for x in leaves if isinstance(x, Tensor)], {j: x for j, x in enumerate(leaves) if not isinstance(x, Tensor)}


def _merge(tensors: Sequence[Tensor], static: dict[int, Any]) -> list[Any]:
    """The leaves of :func:`_split` put back in order."""
    out, it = [], iter(tensors)
    for j in range(len(tensors) + len(static)):
        out.append(static[j] if j in static else next(it))
    return out


def _stack(carries: list[dict[str, Any]]) -> tuple[list[Tensor], Any, dict[int, Any]]:
    """The clients' carries stacked leaf by leaf: (stacked tensors, the pytree spec, the shared non-tensor leaves)."""
    flat = [tree_flatten(c) for c in carries]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise ValueError("the clients of a block hold different run values (scratch/state keys or list lengths); "
                         "the batched backend needs the same structure for every client: use client_backend='sequential'")
    tensors, static = _split(flat[0][0])
    for leaves, _ in flat[1:]:
        if _split(leaves)[1] != static:
            raise ValueError(f"the clients of a block hold different non-tensor run values ({_split(leaves)[1]} vs "
                             f"{static}); a batched step reads tensors only: use client_backend='sequential'")
    columns = [_split(leaves)[0] for leaves, _ in flat]
    return [torch.stack(column) for column in zip(*columns)], spec, static


def _gather(module: "FederatedModule", indices: Tensor) -> Any:
    """The samples of the pool at ``indices`` ``[clients, batch]``, on the device."""
    return to_device(gather(module.datamodule.pool, indices), module.device)


def _stack_batches(module: "FederatedModule", batches: list[Any]) -> Any:
    """The clients' batches of a step stacked along a new first dimension: gathered from the
    dataset in one go when given as indices, else stacked leaf by leaf."""
    first = batches[0]
    if isinstance(first, _Indices):
        return _gather(module, torch.stack([b.indices for b in batches]))
    if isinstance(first, tuple) and all(isinstance(t, Tensor) for t in first):  # the usual (x, y)
        return tuple(torch.stack(column) for column in zip(*batches))
    flat = [tree_flatten(b) for b in batches]
    return tree_unflatten([torch.stack(column) for column in zip(*(leaves for leaves, _ in flat))], flat[0][1])


def _signature(item: tuple[Any, dict[str, Any]]) -> tuple:
    """The shapes of a step's batches: clients with the same signature run the step together."""
    batch, extras = item
    if isinstance(batch, _Indices):
        return (len(batch.indices), *(len(e.indices) for e in extras.values()))
    if not extras and isinstance(batch, tuple) and all(isinstance(t, Tensor) for t in batch):  # the usual (x, y)
        return tuple(t.shape for t in batch)
    return tuple(tuple(x.shape) if isinstance(x, Tensor) else x for x in tree_flatten(item)[0])


def _named_outputs(out: Any) -> dict[str, Tensor]:
    """A step's output as named scalars (``{"loss": out}`` for a tensor; none for None)."""
    if out is None:
        return {}
    return dict(out) if isinstance(out, dict) else {"loss": out}


class _PythonState:
    """Detects a ``training_step`` that changes Python state of the client module: in a vectorized
    step it runs once for the whole block, not once per client, so a counter, a list it appends
    to, a tensor it keeps or a torchmetrics ``Metric`` it updates would be wrong.

    The snapshot holds every attribute of the client module and its submodules but Lightning's
    and torch's own: scalars and strings by value, containers by length, other objects (tensors
    kept on ``self``) by identity.
    """

    def __init__(self, client: nn.Module) -> None:
        self.client = client
        self.before = self._snapshot()

    def _snapshot(self) -> dict[tuple[str, str], Any]:
        # attributes that Lightning and torch keep on every module are not the client's own Python state
        framework = lightning_module_attributes() | {"log"}
        values: dict[tuple[str, str], Any] = {}
        for prefix, mod in self.client.named_modules():
            for key, value in vars(mod).items():
                if key in framework and not (isinstance(mod, Metric) and key == "_update_count"):
                    continue
                if isinstance(value, (bool, int, float, str)) or value is None:
                    values[(prefix, key)] = value
                elif isinstance(value, (list, dict, set, tuple)):
                    values[(prefix, key)] = ("len", len(value))
                elif isinstance(value, Tensor):
                    values[(prefix, key)] = ("id", id(value))
        return values

    def check(self) -> None:
        after = self._snapshot()
        changed = sorted(f"{p + '.' if p else ''}{k}" for (p, k), v in after.items()
                         if (p, k) not in self.before or self.before[(p, k)] != v)
        if changed:
            raise ValueError(
                f"the client's training_step changes Python state ({', '.join(changed)}): in the batched backend it runs "
                "once per block of clients, not once per client; keep such state out of training_step or use "
                "client_backend='sequential'"
            )
