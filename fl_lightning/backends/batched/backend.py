"""``BatchedBackend``: the schedule of a round in blocks of clients, the blocks' stacked runs and
their vectorized steps."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch._dynamo.exc import TorchDynamoException
from torch.func import vmap

from fl_lightning.backends.base import ClientBackend, refusal
from fl_lightning.backends.batched.batches import (IndexGroup, StepGroup, fixed_groups, plan_steps, real_batches,
                                                   steps_of)
from fl_lightning.backends.batched.compiled import CompiledStep
from fl_lightning.backends.batched.evaluate import NotVectorizable, evaluate_vectorized
from fl_lightning.backends.batched.final import final_setting, vectorized_final
from fl_lightning.backends.batched.metrics import MetricCalls
from fl_lightning.backends.batched.python_state import PythonState
from fl_lightning.backends.batched.run import FunctionalLocal, FunctionalRun, carried_out
from fl_lightning.backends.batched.sizing import MEMORY_SHARE, activation_bytes, block_size, free_memory
from fl_lightning.backends.batched.stacking import merge_leaves, plain_unflattener, split_leaves, stack_carries
from fl_lightning.backends.batched.step_trial import NOT_VECTORIZABLE, trial_algorithm_step, trial_vectorized_step
from fl_lightning.backends.block import ClientBlock
from fl_lightning.backends.client_round import ClientRoundResult
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.evaluate import StateOf
from fl_lightning.backends.sequential import train_one_by_one
from fl_lightning.backends.stateless import loss_requiring_grad
from fl_lightning.distributed import rank_and_world
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten
from fl_lightning.lightning_package import rank_zero_warn
from fl_lightning.optim.sgd_function import FunctionalSGD, functional_optimizer
from fl_lightning.run import plain_step
from fl_lightning.update import ClientResult


class Block:
    """A block of clients whose runs advance together: the runs, the plan of their steps
    (:func:`~fl_lightning.backends.batched.batches.plan_steps`), and while they step, their carries
    stacked along the client dimension (built once, taken back into the runs once, at the end)."""

    def __init__(self, runs: list[FunctionalRun], plan: Iterator[list[StepGroup]],
                 step: Optional[Callable[[FunctionalRun, Any], Any]] = None, work: str = "block") -> None:
        self.runs, self.plan = runs, plan
        #: the step the runs take (None: the algorithm's ``client_step``), and the key of its local work
        self.step, self.work = step, work
        self.tensors, self.spec, self.static = stack_carries([run.carry() for run in runs]) if runs else ([], None, {})
        #: each step's outputs (name -> values stacked over the clients that took part, None: all of them)
        self.outputs: list[tuple[Optional[list[int]], dict[str, Tensor]]] = []
        #: whether the client module's Python state was checked in this block (at its first step)
        self.checked = False
        #: the runs' clients, in block order (whose values a step's ``self.log`` gives, row by row)
        self.client_ids = tuple(run.client_id for run in runs)
        #: the steps' ``self.log`` values (name, each client's total, samples per client, options, the clients),
        #: handed to the round once the block is done
        self.logs: list[tuple[str, Tensor, int, dict[str, Any], tuple[int, ...]]] = []
        #: steps every client of the block took that the runs' ``steps_taken`` do not count yet
        self._steps_of_all = 0

    def record(self, members: Optional[list[int]], outputs: dict[str, Tensor]) -> None:
        """Keep a step's outputs, stacked over ``members`` (None: every client of the block)."""
        self.outputs.append((members, outputs))
        if members is None:  # counted for the runs once, by :meth:`count_steps`
            self._steps_of_all += 1
        else:
            for i in members:
                self.runs[i].local.steps_taken += 1

    def count_steps(self) -> None:
        """Bring every run's ``steps_taken`` up to date with the steps the whole block took (once per
        block, where a thousand clients' counts at every step cost more than the step's launch)."""
        if self._steps_of_all:
            for run in self.runs:
                run.local.steps_taken += self._steps_of_all
            self._steps_of_all = 0

    def unstack(self) -> None:
        """Give every run its values back, and the mean of each of its step outputs over its steps
        (on the device: the round's end reads every client's at once)."""
        self.count_steps()
        rows = [t.unbind(0) for t in self.tensors]  # every client's views of a leaf at once
        rebuild = plain_unflattener(self.spec) or (lambda leaves: tree_unflatten(leaves, self.spec))
        for i, run in enumerate(self.runs):
            run.load_carry(rebuild(merge_leaves([r[i] for r in rows], self.static)))
        names = sorted({name for _, outputs in self.outputs for name in outputs})
        if not names:
            return
        for name in names:
            means, holders = self._means(name)
            for i in holders:
                self.runs[i]._record_mean(name, means[i])

    def flush_logs(self, context: ClientContext) -> None:
        """Hand the round the steps' ``self.log`` values, in the order the steps logged them."""
        for name, totals, samples, options, clients in self.logs:
            context.logs.add(name, totals, samples, options, clients)
        self.logs = []

    def default_uploads(self) -> Optional[dict[int, dict[str, Tensor]]]:
        """Every run's upload of the default ``client_final``, ``{"delta": end - start}``, by the run's
        ``id``, computed for the whole block from its stacked values after :meth:`unstack`: one flatten
        and one subtraction, where each client costs two operations (on a GPU, two launches each); the
        same numbers. None where the stacked values do not lead with the model and its start (the
        carry's order: the model's tensors, the optimizer state's, then the start)."""
        n, first = len(self.runs), self.runs[0]
        k = len(first.tensors)
        start = k + sum(isinstance(x, Tensor) for x in tree_flatten(first.local.opt_state)[0])
        shapes = [(n, *shape) for shape in first.layout.shapes]
        if (start >= len(self.tensors) or [tuple(t.shape) for t in self.tensors[:k]] != shapes
                or tuple(self.tensors[start].shape) != (n, first.layout.dim)):
            return None
        ends = torch.cat([t.reshape(n, -1).to(torch.float32) for t in self.tensors[:k]], dim=1)
        return {id(run): {"delta": delta} for run, delta in zip(self.runs, (ends - self.tensors[start]).unbind(0))}

    def _means(self, name: str) -> tuple[Tensor, list[int]]:
        """Each client's mean of the step output ``name`` over its steps (NaN for a client without
        one), and which clients (indices in the block) have one: known on the host, not read."""
        n = len(self.runs)
        if all(members is None and name in out for members, out in self.outputs):  # every client, every step
            stacked = torch.stack([out[name].reshape(n).float() for _, out in self.outputs], dim=1)
            return stacked.mean(dim=1), list(range(n))
        values: list[list[Tensor]] = [[] for _ in self.runs]
        for members, out in self.outputs:
            if name in out:
                for j, i in enumerate(range(n) if members is None else members):
                    values[i].append(out[name][j].float())
        nan = torch.full((), float("nan"), device=self.tensors[0].device)
        means = torch.stack([torch.stack(v).mean() if v else nan for v in values])
        return means, [i for i, v in enumerate(values) if v]


class BatchedBackend(ClientBackend):
    """Runs blocks of ``clients_per_block`` clients, each block's local steps vectorized.

    Args:
        clients_per_block: how many clients advance together (memory grows with it). None: every
            client of the round (this process's share under DDP) in one block, as far as a quarter
            of the device's free memory holds their runs and their steps' activations (:func:`~fl_lightning.backends.batched.
            sizing.block_size`), settled once the run's device is known (:meth:`setup`); a block
            that runs out of device memory all the same steps again in halves, and no later block is
            larger (:meth:`_run_block`). In lock-step rounds (FedDRO) every client's run is held
            through the round, a block counts its steps' activations beside them, and out of memory
            is raised, with what to change (:meth:`round`). A number is the user's: out of
            memory is their error.
        compile_step: capture each vectorized step with ``torch.compile`` (:func:`vectorized_hook`,
            :class:`~fl_lightning.backends.batched.compiled.CompiledStep`): one compile per structure of
            the step (seconds to a minute on a CPU, announced with one line: a FedAvg block compiles once
            for the run, the step index and the round being symbols of the graph; a new block shape, or a
            Python value the step reads that changes, compiles again), then every step, block and round
            reuses it. It removes the per-operation dispatch of the eager step, which is most of a small
            model's step on the CPU and on a GPU. False runs every step eagerly (to debug a step).
    """

    def __init__(self, clients_per_block: Optional[int] = None, compile_step: bool = False) -> None:
        super().__init__(clients_per_block or 1)
        #: the block size asked for (None: settled by :meth:`setup`)
        self.requested_block = clients_per_block
        if not isinstance(compile_step, bool):
            raise ValueError(f"compile_step must be True or False, got {compile_step!r}")
        self.compile_step = compile_step
        #: the vectorized step: :func:`vectorized_hook`, compiled with ``compile_step``
        self._vectorized: Callable[..., Any] = CompiledStep(vectorized_hook) if compile_step else vectorized_hook
        #: why each evaluation hook found unvectorizable is evaluated one client after another, by hook
        self._sequential_evaluation: dict[str, str] = {}
        #: why ``client_final`` could not be vectorized (None: it can, or was not tried)
        self._eager_final: Optional[str] = None
        #: whether ``client_final`` was tried vectorized (the first try also checks the module's Python state)
        self._final_tried = False
        #: a client's bytes in an evaluation and the device, for evaluation blocks sized by memory
        self._memory: Optional[tuple[int, torch.device]] = None
        #: a client's bytes in plain local training (its run and a step's activations)
        self._plain_memory = 0
        #: the largest block that fits, by work ("training", "evaluation"), once one ran out of memory
        self._fitting: dict[str, int] = {}
        #: the client module and the recording of its metric objects (:meth:`_recording`)
        self._metric_calls: Optional[tuple[nn.Module, Optional[MetricCalls]]] = None

    def setup(self, context: ClientContext, clients_per_round: int, fit: bool) -> None:
        """Refuse what the batched backend cannot run (:func:`refusals`); in a fit, try its first local step as
        it will run it (:meth:`_try_step`); with ``clients_per_block=None``, settle the block that memory
        holds (:meth:`_size_blocks`)."""
        reasons = refusals(context)
        if reasons:
            raise refusal(context, reasons)
        if fit:
            self._try_step(context)
        self._size_blocks(context, clients_per_round)

    def _size_blocks(self, context: ClientContext, clients_per_round: int) -> None:
        """With ``clients_per_block=None``: the block that memory holds, a client counted as its run's
        tensors (``FederatedModule.client_bytes``) and its activations in a local step (for training
        blocks) or in an evaluation batch (for evaluation blocks:
        :func:`~fl_lightning.backends.batched.sizing.activation_bytes`)."""
        if self.requested_block is None:
            _, world = rank_and_world()
            clients = math.ceil(clients_per_round / world)
            tensors, activations = context.engine.client_bytes(), activation_bytes(context)
            free = free_memory(context.device)
            # a lock-step round holds every client's run through the round: a block adds its steps' activations
            held = clients * tensors if context.lockstep else 0
            if free is not None and held > MEMORY_SHARE * free:
                rank_zero_warn(f"a lock-step round holds all of a process's {clients} clients at once, about "
                               f"{held / 2**20:.0f} MiB of run tensors, more than a quarter of the device's free "
                               f"memory ({free / 2**20:.0f} MiB): lower clients_per_round, add processes "
                               "(strategy='fl_ddp') or use client_backend='sequential'")
            per_client = activations.step + (0 if context.lockstep else tensors)
            self.clients_per_block = block_size(clients, per_client, free, held=held)
            self._memory = (tensors + activations.evaluation, context.device)
            self._plain_memory = tensors + activations.step

    def _try_step(self, context: ClientContext) -> None:
        """The client's ``training_step`` under ``vmap`` on one batch, its metric objects recorded
        (:func:`~fl_lightning.backends.batched.step_trial.trial_vectorized_step`): a step that changes the
        client's Python state, uses a metric otherwise than the backend records, or reads a tensor's
        value in Python is refused at setup, not at the first round's step. Then, where the algorithm has
        a ``client_init`` or a ``client_step`` of its own, its first step of a client's round, vectorized
        as a block runs it (:func:`~fl_lightning.backends.batched.step_trial.trial_algorithm_step`)."""
        trial_vectorized_step(context, self._recording(context))
        if context.lockstep or not (context.prepares_rounds or not context.plain_steps):
            return
        vectorized, self._vectorized = self._vectorized, vectorized_hook  # the trial compiles nothing

        def first_step(runs: list[FunctionalRun]) -> None:
            for members, plan in self._blocks_of(context, runs):
                block = Block(members, plan, work="trial")
                groups = next(block.plan, None)
                if groups is not None:
                    self._advance(context, block, groups, 0, "step")

        try:
            trial_algorithm_step(context, lambda clients: self._start_runs(context, clients)[0], first_step)
        finally:
            self._vectorized = vectorized

    def evaluation_block(self, clients: int) -> int:
        """Clients per block when ``clients`` clients are evaluated: the asked-for block size, or
        (``clients_per_block=None``) all of them as far as memory holds them, and no more than an
        evaluation block that fitted after one ran out of memory."""
        if self._memory is None:
            return self.clients_per_block
        client_bytes, device = self._memory
        return min(block_size(max(clients, 1), client_bytes, free_memory(device)),
                   self._fitting.get("evaluation", clients))

    def run_clients(self, context: ClientContext, clients: list[int]) -> ClientBlock:
        """A block's whole round: every client's ``client_init``, the block's vectorized steps, every
        client's ``client_final`` (in the clients' order). Clients whose batches differ in shape at
        every step (smaller clients than the batch) step as blocks of their own, each step one call
        over a whole block: no client's values are gathered out of a block and written back. Python's
        garbage collector is paused meanwhile (:func:`collection_paused`)."""
        with collection_paused():
            return ClientBlock.of(self._run_clients(context, clients))

    def _run_clients(self, context: ClientContext, clients: list[int]) -> list[ClientRoundResult]:
        """:meth:`run_clients`' work (in parts of the block that fits, once a block ran out of memory)."""
        runs, results = self._start_runs(context, clients)
        uploads: dict[int, dict[str, Tensor]] = {}
        size = self._fitting.get("training", max(len(runs), 1))
        for start in range(0, len(runs), size):
            for members, plan in self._blocks_of(context, runs[start:start + size]):
                uploads.update(self._run_block(context, members, plan))
        return results + self._finish_runs(context, runs, uploads)

    @staticmethod
    def _blocks_of(context: ClientContext, runs: list[FunctionalRun], stream: Optional[str] = None
                   ) -> list[tuple[list[FunctionalRun], Any]]:
        """The blocks ``runs`` step in, each as its runs and the plan of its steps: one block, or one
        for each local optimizer where the clients' configurations give them different rates, and
        one for each shape of batch or number of steps where clients differ in it at every step (none
        for no run). Their batches are the round's, or ``stream``'s (plain local training: a fixed
        number of steps)."""
        blocks = []
        for same in same_optimizer(runs):
            groups = fixed_groups(context, same, stream)
            if groups is None or len(groups) == 1:
                blocks.append((same, plan_steps(context, same) if groups is None else steps_of(context, groups)))
                continue
            blocks.extend(([same[i] for i in g.members],
                           steps_of(context, [IndexGroup(list(range(len(g.members))), g.indices)])) for g in groups)
        return blocks

    def _run_block(self, context: ClientContext, runs: list[FunctionalRun], plan: Any) -> dict[int, dict[str, Tensor]]:
        """The steps and finals of one block of ``runs``, its values given back to the runs; returns
        the uploads it computed, by the run's ``id``. Where the engine chose the block
        (``clients_per_block=None``) and the device runs out of memory before the block gives its
        values back, the block's runs step again in two halves, from their start (nothing of the
        failed block is kept: its values, its steps' logs), and every later block of the run is at
        most that size (a one-time warning says so)."""
        try:
            block = Block(runs, plan)
            self._steps(context, block)
            finals = self._vectorized_finals(context, block) if context.finalizes_rounds else None
        except torch.cuda.OutOfMemoryError:
            if self.requested_block is not None or len(runs) == 1:
                raise
            block = None  # the failed block's memory goes before the halves take theirs
        if block is None:
            return self._halved(context, runs)
        block.unstack()
        block.flush_logs(context)
        if finals is not None:
            return finals
        if context.finalizes_rounds:
            return {}
        try:
            return block.default_uploads() or {}
        except torch.cuda.OutOfMemoryError:  # the runs have their values: each computes its own upload
            return {}

    def _halved(self, context: ClientContext, runs: list[FunctionalRun]) -> dict[int, dict[str, Tensor]]:
        """:meth:`_run_block` for each half of ``runs`` after their block ran out of memory."""
        for run in runs:
            run.local.steps_taken = 0
        half = self._halve(context, "training", len(runs))
        uploads: dict[int, dict[str, Tensor]] = {}
        for part in (runs[:half], runs[half:]):
            for members, plan in self._blocks_of(context, part):
                uploads.update(self._run_block(context, members, plan))
        return uploads

    def evaluate(self, context: ClientContext, client_ids: Sequence[int], state_of: StateOf, split: str,
                 hook: str) -> list[ClientResult]:
        """Blocks of clients (:meth:`evaluation_block`) evaluated at once, ``vmap``-ped over their models
        (:mod:`fl_lightning.backends.batched.evaluate`); where the hook cannot be vectorized, one
        client after another, with a one-time warning that says why (the hook is not tried again)."""
        if hook not in self._sequential_evaluation:
            try:
                return self._evaluate_in_blocks(context, client_ids, state_of, split, hook)
            except NotVectorizable as reason:
                self._sequential_evaluation[hook] = str(reason)
                rank_zero_warn(f"the batched client backend evaluates clients one after another: {reason}")
        return super().evaluate(context, client_ids, state_of, split, hook)

    def _evaluate_in_blocks(self, context: ClientContext, client_ids: Sequence[int], state_of: StateOf, split: str,
                            hook: str) -> list[ClientResult]:
        """:func:`evaluate_vectorized` in :meth:`evaluation_block`'s blocks; where the engine chose the
        block and the device runs out of memory, the evaluation starts again in blocks of half the
        size (it changes nothing but its results), and no later evaluation block is larger."""
        block = self.evaluation_block(len(client_ids))
        while True:
            try:
                return evaluate_vectorized(context, client_ids, state_of, split, hook, block)
            except torch.cuda.OutOfMemoryError:
                if self._memory is None or block == 1:
                    raise
            block = self._halve(context, "evaluation", block)

    def _halve(self, context: ClientContext, work: str, size: int) -> int:
        """Half of ``size`` (rounded up), after a ``work`` block of ``size`` clients ran out of
        memory: no later block of that work is larger (a one-time warning says so); the allocator's
        cache is emptied for the smaller blocks."""
        half = math.ceil(size / 2)
        if work not in self._fitting:
            rank_zero_warn(f"the batched client backend ran out of memory in {work}, in a block of {size} clients: its "
                           f"clients go again in blocks of {half}, and no later {work} block is larger (set "
                           "clients_per_block to choose the size)")
        self._fitting[work] = min(self._fitting.get(work, half), half)
        if context.device.type == "cuda":
            torch.cuda.empty_cache()
        return half

    # ------------------------------------------------------------ plain local training
    def train_clients_plainly(self, context: ClientContext, client_ids: list[int], start: Tensor, steps: Optional[int],
                              stream: str, round_idx: int) -> Iterator[tuple[int, Tensor]]:
        """Blocks of clients trained plainly at once, each block's steps one vectorized call of the
        plain step (:func:`~fl_lightning.run.plain_step`, the local optimizer as a function) over its
        clients: the batches :func:`~fl_lightning.backends.sequential.train_plainly` draws, and its
        results to float tolerance (a client's random draws, Dropout's, are keyed by its block, as in
        the round's blocks). Blocks are the asked-for ``clients_per_block``, or (None) as many clients
        as a quarter of the device's free memory holds (a block that runs out of memory goes again
        in halves). One client after another (:func:`train_one_by_one`) where a callback changes local
        batches or the training is by epochs (``steps`` None)."""
        if context.changes_local_batches or steps is None:
            yield from train_one_by_one(context, client_ids, start, steps, stream, round_idx)
            return
        local = self._local_work(context)
        views = context.global_model.layout.split(start)  # shared by the runs until their block stacks them
        first = 0
        while first < len(client_ids):
            size = self._plain_block(context, len(client_ids) - first)
            runs = []
            for client_id in client_ids[first:first + size]:
                run = context.new_run(FunctionalRun, client_id, local, context, list(views), start=start, plain=True,
                                      round_idx=round_idx)
                run.local.num_steps = steps
                runs.append(run)
            try:
                for members, plan in self._blocks_of(context, runs, stream):
                    block = Block(members, plan, step=plain_step, work=stream)
                    self._steps(context, block)
                    block.unstack()
            except torch.cuda.OutOfMemoryError:
                if self.requested_block is not None or size == 1:
                    raise
                self._halve(context, "training", size)
                continue
            for run in runs:
                yield run.client_id, run.end()
            first += size

    def _plain_block(self, context: ClientContext, clients: int) -> int:
        """Clients per block of plain local training (``clients`` left to train): the asked-for block
        size, or as many as memory holds and no more than a training block that fitted after one ran
        out of memory."""
        if self.requested_block is not None or self._memory is None:
            return min(self.clients_per_block, clients)
        return min(block_size(clients, self._plain_memory, free_memory(context.device)),
                   self._fitting.get("training", clients))

    # ------------------------------------------------------------ runs
    @staticmethod
    def _local_work(context: ClientContext) -> Callable[..., FunctionalLocal]:
        """The round's local work of a run (:meth:`ClientContext.new_run`'s ``local``): the local optimizer as a
        function, the same for every client of a round, since it holds no state."""
        params = context.global_model.params
        function = functional_optimizer(context.engine.local_optimizer(), params)
        return partial(FunctionalLocal, function, [not p.requires_grad for p in params])

    def new_run(self, context: ClientContext, client_id: int, local: Optional[Callable[..., FunctionalLocal]] = None,
                views: Optional[list[Tensor]] = None) -> FunctionalRun:
        """A run of ``client_id`` from the global model, with its state and ``local`` work (default: the
        round's, :meth:`_local_work`). Its tensors are a copy of the start of its own, or ``views`` of the
        round's start that the block's runs share: for runs that nothing writes before their block stacks
        them (no ``client_init``), which saves a copy per client (on a GPU, a launch each) and a split."""
        run = context.new_run(FunctionalRun, client_id, local or self._local_work(context), context,
                              [] if views is None else list(views))
        if views is None:
            run._restart(run.start)  # a copy of its own
        return run

    def _start_runs(self, context: ClientContext, clients: list[int]
                    ) -> tuple[list[FunctionalRun], list[ClientRoundResult]]:
        """The runs of ``clients`` after their ``client_init``, and the results of the clients finished at once
        (forged clients, and clients without a step to take), in the clients' order."""
        algorithm = context.algorithm
        runs: list[FunctionalRun] = []
        results: list[ClientRoundResult] = []
        local = self._local_work(context)
        assert context.engine.round_start is not None, "the round has not started"
        views = None if context.prepares_rounds else context.global_model.layout.split(context.engine.round_start)
        for cid in clients:
            if not context.lockstep and context.is_forged(cid):
                results.append(context.forged_result(cid))
                continue
            run = self.new_run(context, cid, local, views)
            if context.prepares_rounds:
                with context.local_work(cid, "round", run.round):
                    algorithm.client_init(run)
                run.flush_logs()
            if run.local.optimizer is not None:
                raise ValueError(f"{type(algorithm).__name__}.client_init sets a torch optimizer of its own, "
                                 f"{type(run.local.optimizer).__name__}; the batched backend runs the local optimizer as a "
                                 "function and knows SGD and ProxSGD: use client_backend='sequential'")
            if context.lockstep and runs and run.local.function != runs[0].local.function:
                raise ValueError(f"{type(algorithm).__name__} gives the clients of a lock-step round different local "
                                 f"optimizers ({run.local.function} and {runs[0].local.function}: client_init, or the learning "
                                 "rates of their configurations); a lock-step block steps its clients with one: use "
                                 "client_backend='sequential'")
            if run.local.num_steps == 0 and not context.lockstep:  # no step to take (LocalOnly's spent budget): done now
                results.extend(self._finish_runs(context, [run]))
                continue
            runs.append(run)
        return runs, results

    def _vectorized_finals(self, context: ClientContext, block: Block) -> Optional[dict[int, dict[str, Tensor]]]:
        """Every run's ``client_final`` computed once for ``block``, ``vmap``-ped over its stacked carry
        (which takes the new state entries), before the block unstacks: the uploads by the run's ``id``,
        rows of one stacked tensor each. None where the block's clients took different numbers of steps,
        or where the vectorized hook fails (:mod:`~fl_lightning.backends.batched.final`: a draw, a tensor
        read in Python, a client's own field read, a log, Python state changed): then never again, with a
        one-time warning that says why, and each client runs its own, eagerly."""
        runs = block.runs
        block.count_steps()
        if not runs or self._eager_final is not None or len({run.local.steps_taken for run in runs}) > 1:
            return None
        first, last = runs[0], runs[-1]
        side: dict[str, Any] = {}
        work = context.local_work(first.client_id, "block", first.round, last.client_id, "final", first.local.steps_taken)
        try:
            with work, final_setting(context.algorithm, context.client, first=not self._final_tried):
                tensors, uploads = vectorized_final(context.algorithm.client_final, first, block.spec, block.static,
                                                    side, block.tensors)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 (each client's own call raises an error of its own again)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self._eager_final = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
            rank_zero_warn(f"{type(context.algorithm).__name__}.client_final runs once per client: it cannot be "
                           f"vectorized over a block ({self._eager_final})")
            return None
        finally:
            self._final_tried = True
        self._take_back(block, [(None, None, (tensors, side["spec"], side["static"], uploads))])
        return {id(run): {name: value[i] for name, value in uploads.items()} for i, run in enumerate(runs)}

    @staticmethod
    def _finish_runs(context: ClientContext, runs: list[FunctionalRun],
                     computed: Optional[dict[int, dict[str, Tensor]]] = None) -> list[ClientRoundResult]:
        """``client_final`` of each run: their results (``computed``: the default ``client_final``'s uploads of
        some runs, by ``id``, computed by their block)."""
        results = []
        for run in runs:
            uploads = computed.get(id(run)) if computed else None
            if uploads is None:
                with context.local_work(run.client_id, "final", run.round) if context.finalizes_rounds else nullcontext():
                    uploads = context.algorithm.client_final(run)
                run.flush_logs()
            results.append(context.result(run, uploads))
        return results

    # ------------------------------------------------------------ lock-step rounds (a block each group)
    def round(self, context: ClientContext, clients: list[int]) -> Iterator[ClientBlock]:
        """The round (:meth:`ClientBackend.round`); in a lock-step round, out of memory is raised with what
        to change, since a lock-step round is not retried in smaller blocks: its clients have already
        exchanged shares with the server (which may keep state of them) by the step that fails."""
        try:
            yield from super().round(context, clients)
        except torch.cuda.OutOfMemoryError as error:
            if not context.lockstep:
                raise
            error.add_note(f"fl_lightning: the batched backend holds all of a process's clients of a lock-step round "
                           f"({len(clients)} here, in blocks of {self.clients_per_block}) and does not retry it in "
                           "smaller blocks: set clients_per_block lower (a block's activations), clients_per_round "
                           "lower, add processes (strategy='fl_ddp') or use client_backend='sequential'")
            raise

    def lockstep_group(self, context: ClientContext, clients: list[int]) -> "_LockstepBlock":
        runs, _ = self._start_runs(context, clients)  # a lock-step round finishes no client early
        return _LockstepBlock(self, context, Block(runs, plan_steps(context, runs)))

    # ------------------------------------------------------------ one vectorized step of a block
    def _steps(self, context: ClientContext, block: Block) -> None:
        """Every local step of ``block``'s plan, in order. Where the plan draws its batches from the
        engine's index tables (no callback, no batches of ``client_init``'s), the steps share one
        setting of local work (:meth:`ClientContext.local_steps`), each step's random draws seeded
        as in a setting of its own; otherwise each step has its own, the plan drawn outside it."""
        if real_batches(context, block.runs):
            for step, groups in enumerate(block.plan):
                self._advance(context, block, groups, step, "step")
            return
        first, last = block.runs[0], block.runs[-1]
        with context.local_steps(first.client_id, block.work, first.round, last.client_id) as reseed:
            for step, groups in enumerate(block.plan):
                self._advance(context, block, groups, step, "step", reseed)

    def _advance(self, context: ClientContext, block: Block, groups: list[StepGroup], step: int,
                 phase: str, reseed: Optional[Callable[..., None]] = None) -> Optional[Tensor]:
        """Run ``phase`` (``"step"``: ``client_step``; ``"share"``: ``client_share``) of local step
        ``step`` for the block's clients that take it (``groups``: by batch shapes), one vectorized call
        per group; returns the stacked shares of the ``"share"`` phase (None if the clients share nothing).
        The step runs in a setting of local work of its own, or with ``reseed`` (:meth:`_steps`) in the
        block's, the global RNG seeded for the step as a setting of its own would seed it."""
        everyone = len(groups) == 1 and len(groups[0].members) == len(block.runs)
        results = []
        first, last = block.runs[0], block.runs[-1]
        if reseed is not None:
            reseed(phase, step)
        with nullcontext() if reseed is not None else context.local_work(
                first.client_id, block.work, first.round, last.client_id, phase, step):
            for group in groups:
                index = None if everyone else torch.tensor(group.members, device=block.tensors[0].device)
                tensors = block.tensors if index is None else [t.index_select(0, index) for t in block.tensors]
                results.append((group.members, index, self._call(context, block, tensors, group, step, phase)))
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
    def _take_back(block: Block, results: list) -> None:
        """Write the groups' new carries into the block's stacked carry."""
        _, _, (_, spec, static, _) = results[0]
        if len(results) > 1 and len({(repr(s), repr(t)) for _, _, (_, s, t, _) in results}) > 1:
            raise ValueError("the clients of a block changed their run values differently at one step; the batched "
                             "backend needs the same structure for every client: use client_backend='sequential'")
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

    def _call(self, context: ClientContext, block: Block, tensors: list[Tensor], group: StepGroup, step: int,
              phase: str) -> tuple[list[Tensor], Any, dict[int, Any], dict[str, Tensor]]:
        """One ``vmap`` of the phase's hook over stacked carries ``tensors`` (the block's structure)
        and the ``group``'s batches (compiled with ``compile_step``); returns the new stacked carry,
        its structure and the hook's outputs, stacked."""
        batch, extras = group.load(context)
        if phase == "step":
            hook = block.step or context.algorithm.client_step
        else:
            hook = context.lockstep_algorithm().client_share
        side: dict[str, Any] = {}
        recording = self._recording(context)
        if recording is not None:
            side["recording"] = recording
        guard = None if block.checked else PythonState(context.client)  # at the block's first step
        plain = (phase == "step" and (block.step is plain_step or (block.step is None and context.plain_steps))
                 and type(block.runs[0].local.function) is FunctionalSGD)
        try:
            with recording.installed() if recording is not None else nullcontext():
                if plain and self._vectorized is vectorized_hook:  # eager: the gradient outside vmap
                    new_tensors, outputs, logs, metric_tensors = vectorized_plain_step(
                        block.runs[0], block.spec, block.static, side, tensors, batch, extras, step,
                        block.runs[0].round)
                else:
                    new_tensors, outputs, logs, metric_tensors = self._vectorize(
                        hook, block.runs[0], block.spec, block.static, phase, side, tensors, batch, extras, step,
                        block.runs[0].round)
        except RuntimeError as error:
            if "vmap" not in str(error):
                raise
            if guard is not None:
                guard.check()  # a counter, a list appended to: the clearer reason, where it is one
            raise ValueError(
                f"{type(context.algorithm).__name__}.{'client_step' if phase == 'step' else 'client_share'} cannot be vectorized "
                f"over clients: the client module's training_step (or the algorithm's step) {NOT_VECTORIZABLE}"
            ) from error
        if guard is not None:
            guard.check()
        if logs or side.get("metric_calls"):  # a total per client of the group (its members in block order)
            ids = block.client_ids
            clients = ids if len(group.members) == len(ids) else tuple(ids[i] for i in group.members)
            for name, totals in logs.items():
                block.logs.append((name, totals, side["sizes"][name], side["options"].get(name, {}), clients))
            if side.get("metric_calls"):
                assert recording is not None, "metric calls are recorded only where the client has metric objects"
                recording.replay(context, side["metric_calls"], metric_tensors, clients)
        return new_tensors, side["spec"], side["static"], outputs

    def _recording(self, context: ClientContext) -> Optional[MetricCalls]:
        """The recording of the client module's metric objects in vectorized steps (:mod:`~fl_lightning.
        backends.batched.metrics`), made once; None where the client has none."""
        if self._metric_calls is None or self._metric_calls[0] is not context.client:
            calls = MetricCalls(context.client)
            self._metric_calls = (context.client, calls if calls.targets else None)
        return self._metric_calls[1]

    def _vectorize(self, *args: Any) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor], list[Tensor]]:
        """:func:`vectorized_hook` of ``args``, compiled with ``compile_step``; where torch cannot
        compile it, eagerly from then on, with a one-time warning that says why."""
        if self._vectorized is vectorized_hook:
            return vectorized_hook(*args)
        try:
            return self._vectorized(*args)
        except TorchDynamoException as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            rank_zero_warn(f"compile_step: the batched step could not be compiled, it runs eagerly: {reason}")
            self._vectorized = vectorized_hook
            return vectorized_hook(*args)


class _LockstepBlock:
    """A lock-step group of the batched backend: a block of runs, each step one vectorized call over it."""

    def __init__(self, backend: BatchedBackend, context: ClientContext, block: Block) -> None:
        self.backend, self.context, self.block = backend, context, block

    def next_batches(self) -> Any:
        return next(self.block.plan)

    def share(self, batches: Any, step: int) -> Optional[tuple[Tensor, Tensor]]:
        shares = self.backend._advance(self.context, self.block, batches, step, "share")
        return None if shares is None else (torch.tensor([run.data.num_samples for run in self.block.runs]), shares)

    def step(self, batches: Any, step: int) -> None:
        shared = self.context.lockstep_algorithm().shared
        for run in self.block.runs:
            run.local.shared = shared
        self.backend._advance(self.context, self.block, batches, step, "step")

    def finish(self) -> ClientBlock:
        self.block.unstack()
        self.block.flush_logs(self.context)
        return ClientBlock.of(self.backend._finish_runs(self.context, self.block.runs))


def refusals(context: ClientContext) -> list[str]:
    """Why the batched backend cannot run ``context``'s algorithm in this Trainer (each reason with the way
    out); empty when it can."""
    reasons = []
    if not context.algorithm.batchable:
        reasons.append(f"{type(context.algorithm).__name__} declares batchable = False (its client protocol "
                       "vectorized would differ from its clients' own); use client_backend='sequential'")
    if context.grad_scaler is not None:
        reasons.append("precision '16-mixed' scales each optimizer's loss; the batched client backend runs the "
                       "optimizer as a function: use 'bf16-mixed' or client_backend='sequential'")
    return reasons


def same_optimizer(runs: list[FunctionalRun]) -> list[list[FunctionalRun]]:
    """``runs`` in groups of equal local optimizer functions (a block steps its clients with one), in
    the order of their first run; one group where all runs have the round's (none for no run)."""
    if all(run.local.function is runs[0].local.function for run in runs):  # the round's (the runs share it)
        return [runs] if runs else []
    groups: list[list[FunctionalRun]] = []
    for run in runs:
        group = next((g for g in groups if g[0].local.function == run.local.function), None)
        if group is None:
            groups.append([run])
        else:
            group.append(run)
    return groups


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (a block's round). The per-client
    bookkeeping of a thousand clients allocates enough objects to trigger dozens of collections a
    round, each young one promoting objects towards the full collections that walk every object of the
    process: a quarter of a 1,000-client logistic-regression round on the CPU. Paused, the count goes
    on and the collector runs once, at the first allocation after the block (as training loops that
    collect every N steps do)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def vectorized_hook(hook: Callable[[FunctionalRun, Any], Any], template: FunctionalRun, spec: Any,
                    static: dict[int, Any], phase: str, side: dict[str, Any], tensors: list[Tensor], batch: Any,
                    extras: Any, step: int, round_idx: int
                    ) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor], list[Tensor]]:
    """``hook`` (``client_step``, or ``client_share`` for ``phase="share"``) at local step ``step`` of
    round ``round_idx`` for every client of a stacked carry ``tensors`` (``template``'s fields, structure
    ``spec``/``static``), ``vmap``-ped over the clients: returns the new stacked carry's tensors, the
    hook's outputs, the sums of the clients' ``self.log`` values (value times batch size, per client)
    and the tensors of the calls the step made of the client's metric objects, recorded by
    ``side["recording"]`` where given (:mod:`~fl_lightning.backends.batched.metrics`); ``side`` receives
    the new carry's structure (``"spec"``, ``"static"``), the logged names' options and batch sizes and
    the recorded calls (``"metric_calls"``).

    It is a function of its arguments only, so that ``torch.compile`` can capture it once per
    structure and reuse it over steps, blocks and rounds (:class:`~fl_lightning.backends.batched.compiled.
    CompiledStep`: its guards check the Python values it reads, but for ``step`` and ``round_idx``,
    which reach the hook through ``vmap``'s arguments, where the graph holds them as symbols)."""

    def one_client(tensors: list[Tensor], batch: Any, extras: Any, step: int, round_idx: int
                   ) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor], list[Tensor]]:
        run = FunctionalRun.view(template, tree_unflatten(merge_leaves(tensors, static), spec), step, round_idx, extras)
        run.recording = side.get("recording")
        out = hook(run, batch)
        new_tensors = carried_out(run, side)
        side["options"], side["sizes"], side["metric_calls"] = run.log_options, run.log_sizes, run.metric_calls
        outputs = ({} if out is None else {"share": out}) if phase == "share" else named_outputs(out)
        return new_tensors, outputs, run.logs, run.metric_tensors

    return vmap(one_client, in_dims=(0, 0, 0, None, None), randomness="different")(tensors, batch, extras, step,
                                                                                    round_idx)


def vectorized_plain_step(template: FunctionalRun, spec: Any, static: dict[int, Any], side: dict[str, Any],
                          tensors: list[Tensor], batch: Any, extras: Any, step: int, round_idx: int
                          ) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor], list[Tensor]]:
    """:func:`vectorized_hook` of :func:`~fl_lightning.run.plain_step` (the client's loss, its gradient,
    one step of its optimizer), with the gradient taken outside ``vmap``: one backward of the sum of
    the clients' vmapped losses, whose gradient's rows are each client's own (the clients are
    independent). It gives the same step as ``vmap(grad(loss))`` with one of torch.func's transforms
    fewer, the cost of an eager step of a small model (``benchmarks/grad_transforms.py``)."""
    k = template.layout.num_param_tensors
    carry = tree_unflatten(merge_leaves(tensors, static), spec)
    params = [t.detach().requires_grad_() for t in carry["tensors"][:k]]
    # which stacked leaves are the model's parameters (the carry's other leaves stay as they are)
    is_param = {id(t): i for i, t in enumerate(carry["tensors"][:k])}
    positions = [is_param.get(id(t)) for t in tensors]

    def one_loss(params: list[Tensor], tensors: list[Tensor], batch: Any, extras: Any
                 ) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
        tensors = [t if i is None else params[i] for t, i in zip(tensors, positions)]
        run = FunctionalRun.view(template, tree_unflatten(merge_leaves(tensors, static), spec), step, round_idx, extras)
        run.recording = side.get("recording")
        loss = run.training_loss(batch)
        side["options"], side["sizes"], side["metric_calls"] = run.log_options, run.log_sizes, run.metric_calls
        return loss, run.logs, run.metric_tensors

    with torch.enable_grad():
        losses, logs, metric_tensors = vmap(one_loss, randomness="different")(params, tensors, batch, extras)
        grads = torch.autograd.grad(loss_requiring_grad(losses).sum(), params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    # SGD's update is elementwise with the clients' shared hyperparameters: one call on the stacked tensors
    carry["opt"] = template.local.function.step_(carry["tensors"][:k], grads, carry["opt"])
    new_leaves, side["spec"] = tree_flatten(carry)
    new_tensors, side["static"] = split_leaves(new_leaves)
    logged = {name: total.detach() for name, total in logs.items()}
    return new_tensors, {"loss": losses.detach()}, logged, metric_tensors


def named_outputs(out: Any) -> dict[str, Tensor]:
    """A step's output as named scalars (``{"loss": out}`` for a tensor; none for None)."""
    if out is None:
        return {}
    return dict(out) if isinstance(out, dict) else {"loss": out}
