"""Every private Lightning (and torch) API fl_lightning relies on, in one place.

One Trainer runs the whole federation, so a few things Lightning does for one training step
must be done for the inner loop of a round: counting the server update as an optimizer step,
routing the client module's ``self.log`` during its local work, telling Lightning which hook a
client's call comes from, and synchronizing the initial model over processes without a DDP
wrapper. Lightning offers no public API for these; each use is a small function here, and
``tests/test_lightning_compat.py`` exercises every one against the installed Lightning, so an
upgrade that changes them fails in one place. ``pyproject.toml`` caps pytorch-lightning (and
lightning) at the versions these were checked against (:data:`TESTED_LIGHTNING`). They are taken from
the package fl_lightning is built on (:mod:`fl_lightning.lightning_package`). torch's private names used
(``torch.utils._pytree``, the BatchNorm base class, Dynamo's code context and compilation callbacks)
and torchmetrics' (a ``Metric``'s accumulated state, which a client's evaluation sets aside) are here
too, for the same reason.
"""

from __future__ import annotations

import collections
import functools
import logging
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch._dynamo.callback import callback_handler
from torch._dynamo.code_context import code_context
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401  (no public pytree module yet)
from torchmetrics import Metric

from fl_lightning.lightning_package import pl, pl_module

LightningOptimizer = pl_module("core.optimizer").LightningOptimizer
_default_map_location = pl_module("core.saving")._default_map_location
_load_state = pl_module("core.saving")._load_state
UnrepeatedDistributedSampler = pl_module("overrides.distributed").UnrepeatedDistributedSampler
_sync_module_states = pl_module("overrides.distributed")._sync_module_states
lightning_results = pl_module("trainer.connectors.logger_connector.result")
_ResultCollection = lightning_results._ResultCollection
_ResultMetric = lightning_results._ResultMetric
_update_dataloader = pl_module("utilities.data")._update_dataloader
PossibleUserWarning = pl_module("utilities.warnings").PossibleUserWarning

#: the pytorch-lightning (and lightning) releases whose private APIs this module was checked against
TESTED_LIGHTNING = (">=2.4", "<2.7")

#: private methods of Lightning classes that fl_lightning's subclasses override (``FederatedDDPStrategy``
#: drops DDP's wrapper and its communication hooks; ``RichRoundProgressBar`` names the round; ``FederatedCLI``
#: checks ``--ckpt_path`` itself and runs a subcommand without advice that does not apply); an
#: override of a method that a release renamed would be silently ignored, so the test checks they exist
OVERRIDDEN_PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    f"{pl.__name__}.strategies.DDPStrategy": ("_setup_model", "_register_ddp_hooks"),
    f"{pl.__name__}.callbacks.RichProgressBar": ("_get_train_description", "_stop_progress"),
    f"{pl.__name__}.cli.LightningCLI": ("_run_subcommand", "_parse_ckpt_path", "_prepare_subcommand_kwargs"),
}


def set_logger_step(trainer: pl.Trainer, step: int) -> None:
    """Make ``step`` the count of training batches Lightning gives loggers as their step (what
    ``LearningRateMonitor`` and metrics logged without a ``step`` use); the engine keeps it at the
    rounds done, so every logged curve has rounds on its x-axis."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def set_logger_version(logger: Any, version: int | str) -> bool:
    """Make a logger that writes into a version folder (``TensorBoardLogger``, ``CSVLogger``)
    write into ``<root_dir>/version_<version>`` (an int) or ``<root_dir>/<version>`` (a string, a
    path inside ``root_dir``), as its ``version=`` argument would have, before it wrote anything;
    False (nothing done) for a logger of another kind. The folder may be an earlier run's (a resumed
    run continues in it)."""
    if not isinstance(logger, (pl.loggers.TensorBoardLogger, pl.loggers.CSVLogger)):
        return False
    if getattr(logger, "_experiment", None) is not None:
        raise RuntimeError(f"{type(logger).__name__} writes into {logger.log_dir} already")
    logger._version = version
    return True


def quiet_progress_bar_notice() -> None:
    """Drop Lightning's notice that a progress bar from ``configure_callbacks`` replaces the
    Trainer's: the engine puts its round-counting bar in place of the Trainer's on every run."""

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("configure_callbacks` will override existing callbacks" in message
                    and message.rstrip().endswith(("TQDMProgressBar", "RichProgressBar")))

    # Lightning's rank_zero_info logs through lightning_utilities' one logger, named for whichever of the two
    # packages' rank_zero modules was imported last: filter both names
    for package in ("pytorch_lightning", "lightning.pytorch"):
        logger = logging.getLogger(f"{package}.utilities.rank_zero")
        if not any(getattr(f, "__name__", "") == "keep" and f.__module__ == __name__ for f in logger.filters):
            logger.addFilter(keep)


#: the start of Lightning's notice that ``trainer.validate``/``trainer.test`` on several processes repeat samples
PADDING_NOTICE = "Using `DistributedSampler` with the dataloaders."


def quiet_padding_notice() -> None:
    """Drop Lightning's notice that an evaluation on several processes repeats samples to give them
    equal shards: ``fl_ddp``'s evaluation loaders repeat none (:func:`unpadded_shards`)."""
    warnings.filterwarnings("ignore", message=PADDING_NOTICE, category=PossibleUserWarning)


def attached_trainer(module: pl.LightningModule) -> Optional[pl.Trainer]:
    """The Trainer ``module`` is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


def count_optimizer_step(optimizer: LightningOptimizer) -> None:
    """Count one step of ``optimizer`` (``trainer.global_step`` += 1) without stepping it.

    The server optimizer is stepped directly (the precision plugin's loss scaler must not
    touch pseudo-gradients); these are the two hooks ``LightningOptimizer.step`` calls around a
    manual-optimization step. ``ModelCheckpoint`` and step-based loggers rely on them.
    """
    optimizer._on_before_step()
    optimizer._on_after_step()


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


@contextmanager
def current_hook(module: pl.LightningModule, name: str) -> Iterator[None]:
    """Run the block as if Lightning were inside ``module``'s hook ``name``.

    ``self.log`` checks the hook it is called from (``_current_fx_name``) to choose its
    defaults (``on_step``/``on_epoch``) and to refuse calls from hooks that cannot log.
    """
    saved = module._current_fx_name
    module._current_fx_name = name
    try:
        yield
    finally:
        module._current_fx_name = saved


def set_current_hook(module: pl.LightningModule, name: str) -> None:
    """Mark ``module`` as being inside its hook ``name`` (for the client hooks the
    ``FederatedModule`` forwards: ``validation_step``, ``test_step``...)."""
    module._current_fx_name = name


class _LogRoute:
    """A module's ``self.log`` while it is routed: calls the innermost routing's ``log``.

    A routing nested in another (the batched step's inside the local work's) sets :attr:`inner` on
    this object rather than the module's attribute. The nested routing runs inside the compiled step
    (``compile_step=True``), and ``torch.compile`` must replay every attribute it changes; before
    torch 2.14 it cannot replay the module's attribute set back to a bound method (a graph break that
    left the whole step eager), while ``inner`` goes back to ``None``."""

    __slots__ = ("log", "inner")

    def __init__(self, log: Callable[..., None]) -> None:
        self.log = log
        self.inner: Optional[Callable[..., None]] = None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        (self.log if self.inner is None else self.inner)(*args, **kwargs)


@contextmanager
def routed_log(module: pl.LightningModule, log: Callable[..., None]) -> Iterator[None]:
    """Replace ``module.log`` by ``log`` for the block (an instance attribute shadows the method);
    nested routings restore the outer one."""
    route = module.__dict__.get("log")
    if isinstance(route, _LogRoute):
        previous, route.inner = route.inner, log
        try:
            yield
        finally:
            route.inner = previous
        return
    object.__setattr__(module, "log", _LogRoute(log))
    try:
        yield
    finally:
        if route is None:
            object.__delattr__(module, "log")
        else:
            object.__setattr__(module, "log", route)


def lightning_log(module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
    """Lightning's own ``self.log`` of ``module``, even while :func:`routed_log` replaces it."""
    type(module).log(module, *args, **kwargs)


#: Lightning's advice, given once per name, to reduce a value logged on epoch level across processes
_SYNC_DIST_ADVICE = ("It is recommended to use `self.log({name!r}, ..., sync_dist=True)` when logging on epoch level"
                    " in distributed setting to accumulate the metric across devices.")


def log_agreed(module: pl.LightningModule, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
    """``module.log(name, value, *args, **kwargs)`` of a value that is the same on every process: merged
    across processes by fl_lightning (the round's client losses, federated evaluation's summaries)
    or the same by construction (the aggregate's norm, the privacy budget).

    Lightning's ``sync_dist=True`` would reduce it again, a collective per name and round for
    nothing (and a hang where processes log different names), so it is logged without, and
    Lightning's advice to add one under DDP is dropped for this name: it is meant for values
    each process holds its own of (a client module's own ``self.log`` still gets it)."""
    lightning_results.warning_cache.add(_SYNC_DIST_ADVICE.format(name=name))
    lightning_log(module, name, value, *args, **kwargs)


def unlogged_training_metrics(trainer: pl.Trainer) -> set[str]:
    """The names of training metrics logged in an earlier epoch but not in the current one, whose
    earlier values ``trainer.callback_metrics`` still holds (Lightning keeps a metric's last value
    until it is logged again). Meant for ``on_train_epoch_end``: the training loop's results are reset
    after it, and a result not logged since the last reset is marked so (``has_reset``)."""
    stale: set[str] = set()
    fresh: set[str] = set()
    for result in trainer.fit_loop.epoch_loop._results.values():
        meta = result.meta
        (stale if result.has_reset else fresh).update({meta.name, meta.forked_name(True), meta.forked_name(False)})
    return stale - fresh


@contextmanager
def results_batch(trainer: pl.Trainer, batch: Optional[Any]) -> Iterator[None]:
    """Make ``batch`` the batch Lightning infers logged batch sizes from, for the block."""
    results = trainer._results
    if results is None or batch is None:
        yield
        return
    saved = results.batch
    results.batch = batch
    try:
        yield
    finally:
        results.batch = saved


def dataloader_suffix(trainer: pl.Trainer) -> str:
    """What Lightning appends now to a name logged with ``add_dataloader_idx=True``: ``/dataloader_idx_N`` in a
    batch of the evaluation loader ``N`` of several, else nothing."""
    results = trainer._results
    index = None if results is None else results.dataloader_idx
    return "" if index is None else _ResultCollection.DATALOADER_SUFFIX.format(index)


def unpadded_shards(dataloader: DataLoader, sampler: DistributedSampler) -> DataLoader:
    """``dataloader`` rebuilt (its other arguments kept, as Lightning rebuilds a loader to give it a
    sampler) with the shards of ``sampler`` without padding: process ``r`` of ``N`` gets the samples ``r,
    r + N, ...`` of the set, each sample once (Lightning's sampler of ``trainer.predict``), where a
    ``DistributedSampler`` repeats samples to give every process as many."""
    return _update_dataloader(dataloader, UnrepeatedDistributedSampler(
        sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
        seed=sampler.seed))


def is_unpadded(sampler: Sampler) -> bool:
    """Whether ``sampler`` is the sampler of :func:`unpadded_shards` (or of Lightning's ``trainer.predict``)."""
    return isinstance(sampler, UnrepeatedDistributedSampler)


@contextmanager
def light_result_moves() -> Iterator[None]:
    """Make the block's ``self.log`` calls skip Lightning's move of a stored result that is where
    the value is already.

    Every ``self.log`` call moves the result it accumulates into to the value's device
    (``_ResultMetric.to``): ``apply_to_collection`` over all of the result's attributes (it is a
    torchmetrics ``Metric``), which copies every collection among them and deep-copies its metadata
    dataclass, whether or not a tensor moves. That is about 0.6 of a call's 0.75 ms on this CPU (a
    call 0.75 -> 0.13 ms without it), paid by each value the round's end logs. In the block, a move
    to a device where each of the result's tensors is already leaves the result as it is, as the
    move would, without the copies; any other call (a tensor elsewhere, a logged ``Metric``, a dtype)
    is Lightning's."""
    original = _ResultMetric.to

    def to(self: _ResultMetric, *args: Any, **kwargs: Any) -> _ResultMetric:
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.device) and \
                all(_placed(value, args[0]) for value in self.__dict__.values()):
            return self
        return original(self, *args, **kwargs)

    _ResultMetric.to = to
    try:
        yield
    finally:
        _ResultMetric.to = original


def _placed(value: Any, device: torch.device) -> bool:
    """Whether every tensor in ``value`` (nested in lists, tuples, dicts and deques, as a pytree
    nests them) is on ``device``, and no ``Metric`` is among them: a walk of the collections, where
    ``tree_flatten`` of a result's attributes builds a spec of each (on this CPU 29-33 against
    66-72 us a check, of a result's ``log`` of about 60 us after)."""
    if isinstance(value, torch.Tensor):
        return value.device == device
    if isinstance(value, Metric):
        return False
    if isinstance(value, dict):
        return all(_placed(v, device) for v in value.values())
    if isinstance(value, (list, tuple, collections.deque)):
        return all(_placed(v, device) for v in value)
    return True


def sync_module_states(module: nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers to every process (DDP's start, without its wrapper)."""
    _sync_module_states(module)


def progress_bar_leave(bar: Any) -> bool:
    """Whether a Lightning progress bar leaves its finished bars on screen (its ``leave`` argument)."""
    return bool(bar._leave)


def stop_rich_progress(bar: Any) -> None:
    """Stop a ``RichProgressBar``'s live display now (Lightning stops it only at teardown), leaving
    its last state on screen, so that what is printed next comes below it."""
    bar._stop_progress()


def rich_train_description(bar: Any, description: str) -> str:
    """``description`` padded as ``RichProgressBar._get_train_description`` pads its own (the bar
    calls that method, which ``RichRoundProgressBar`` overrides, for each training epoch)."""
    width = len(bar.validation_description)
    return f"{description:{width}}" if width > len(description) else description


def default_map_location(map_location: Any) -> Any:
    """``map_location`` of ``load_from_checkpoint``, Lightning's default when None: every tensor on
    the device it was saved from, or on the CPU when that device is not available."""
    return _default_map_location if map_location is None else map_location


def dump_checkpoint(trainer: pl.Trainer, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would write, as a dict, without writing it
    (every process calls it: the state's hooks may communicate)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only)


def build_from_checkpoint(cls: type, checkpoint: dict[str, Any], strict: Optional[bool] = None, **kwargs: Any) -> Any:
    """What Lightning's ``load_from_checkpoint`` does once the file is read: ``cls`` (a
    ``LightningModule`` or ``LightningDataModule``) built from the checkpoint's hyperparameters
    (``kwargs`` take precedence), its state loaded, a module moved to its state's device."""
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
    built = _load_state(cls, checkpoint, strict=strict, **kwargs)
    if isinstance(built, pl.LightningModule):
        state = checkpoint.get("state_dict") or {}
        tensor = next((t for t in state.values() if isinstance(t, torch.Tensor)), None)
        if tensor is not None:
            built = built.to(tensor.device)
    return built


def dynamic_int_arguments(function: Callable[..., Any], names: tuple[str, ...]) -> None:
    """Make ``torch.compile`` trace the integer arguments ``names`` of ``function`` as symbols from its
    first compile, so that a new value reuses the graph (Dynamo's default is a constant at the first
    compile and a symbol from the first recompile on: one compile more for each such argument).

    It sets, for ``function``'s code object, what ``torch.compiler.set_stance("eager_then_compile")``
    records of arguments that changed between its two eager calls (torch's private code context); give
    ``function`` a code object of its own (:func:`~fl_lightning.backends.batched.compiled.own_copy`)."""
    code_context.get_context(function.__code__)["dynamism"] = {name: {f"L['{name}']": (True,)} for name in names}


@contextmanager
def compile_started(callback: Callable[[], None]) -> Iterator[None]:
    """``callback()`` whenever ``torch.compile`` starts compiling a graph inside the block (torch's
    private compilation callbacks)."""

    def started(_: Any) -> None:
        callback()

    callback_handler.register_start_callback(started)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(started)


def batch_norm_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s BatchNorm layers of any dimension, with their names (torch's private ``_BatchNorm`` base)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@functools.cache
def lightning_module_attributes() -> frozenset[str]:
    """The instance attributes every ``LightningModule`` has (those its constructor sets)."""
    return frozenset(vars(pl.LightningModule()))


#: the private fields of a torchmetrics ``Metric`` besides its states that an update, a ``compute`` or a
#: sync changes (the update count, the cached results, the sync settings)
_METRIC_FIELDS = ("_update_count", "_computed", "_forward_cache", "_cache", "_is_synced", "_to_sync",
                  "dist_sync_on_step", "sync_on_compute")


def metric_snapshot(metric: Metric) -> dict[str, Any]:
    """A copy of everything ``metric`` has accumulated (its states, update count, cached results
    and sync settings), for :func:`restore_metric`."""
    return {"states": metric._copy_state_dict(), **{name: getattr(metric, name) for name in _METRIC_FIELDS}}


def restore_metric(metric: Metric, snapshot: dict[str, Any]) -> None:
    """Put ``metric`` back as :func:`metric_snapshot` found it."""
    for name, value in snapshot["states"].items():
        setattr(metric, name, value)
    for name in _METRIC_FIELDS:
        setattr(metric, name, snapshot[name])


def unsync_metric(metric: Metric) -> None:
    """Make ``metric`` update and ``compute`` on this process's states only (no all-gather between
    processes, which evaluate different clients). ``sync_on_compute`` too: the Metric's ``forward``
    sets ``_to_sync`` back from it after every call."""
    metric._to_sync = False
    metric.sync_on_compute = False
    metric.dist_sync_on_step = False
