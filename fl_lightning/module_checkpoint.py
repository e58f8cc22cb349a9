"""What a ``FederatedModule`` checkpoint holds beyond Lightning's, and how a module is rebuilt from one.

Beside Lightning's entries a checkpoint holds a ``"federated"`` entry: the client state store's
index (:meth:`~fl_lightning.client_store.ClientStateStore.state_dict`), the run's fingerprint
(what a resumed run must match) and the client module's recipe (its class path and plain
hyperparameters), from which ``load_from_checkpoint`` rebuilds it. Everything is read with
``weights_only=True`` (:mod:`fl_lightning.checkpoints`), and rebuilding builds nothing of the file's
choosing (:mod:`fl_lightning.file_arguments`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Mapping, Optional, TypeVar

from fl_lightning.checkpoints import (
    CheckpointError,
    check_weights_only,
    check_written_by,
    class_path_of,
    is_plain,
    load_checkpoint,
)
from fl_lightning.client_store import ClientStateStore
from fl_lightning.file_arguments import AllowedClasses, Kind, allowed_class, build_arguments, build_checked
from fl_lightning.lightning_compat import attached_trainer, default_map_location
from fl_lightning.lightning_package import pl, rank_zero_warn


ModuleT = TypeVar("ModuleT", bound="FederatedCheckpointing")


def client_recipe(client: pl.LightningModule) -> dict[str, Any]:
    """The client module's class path and its plain hyperparameters (what rebuilds it)."""
    hparams = {k: v for k, v in dict(getattr(client, "hparams", {})).items() if is_plain(v) and not k.startswith("_")}
    return {"class_path": class_path_of(type(client)), "hparams": hparams}


def build_client(recipe: dict[str, Any], allowed_classes: AllowedClasses = (), where: str = "checkpoint") -> pl.LightningModule:
    """A client module from :func:`client_recipe`'s output: its class called with the hyperparameters
    its constructor takes (built by :func:`~fl_lightning.file_arguments.build_arguments`).

    The class must be one of fl_lightning's models or in ``allowed_classes`` (class paths or
    classes): a file chooses it, and building a class runs its code. Allow your own client's class,
    or pass ``client=``.
    """
    path = recipe["class_path"]
    cls = allowed_class(path, Kind(pl.LightningModule), allowed_classes, f"{where}: the client module",
                        instead="pass client=<the client module>")
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    values = {k: v for k, v in recipe["hparams"].items() if takes_any or k in parameters}
    arguments = build_arguments(cls, values, allowed_classes, f"{where}: the client's hyperparameter")
    try:
        return cls(**arguments)
    except TypeError as error:
        raise CheckpointError(
            f"the client class {path} cannot be rebuilt from the hyperparameters the checkpoint holds ({arguments}): "
            f"{error}; call self.save_hyperparameters() in its __init__, or pass client=<the client module>"
        ) from error


def federated_entry(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``"federated"`` entry (CheckpointError if a ``FederatedModule`` did not write it)."""
    saved = checkpoint.get("federated")
    if saved is None:
        raise CheckpointError("the checkpoint was not written by a FederatedModule (no 'federated' entry)")
    return saved


def check_fingerprint(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse to resume a checkpoint of another configuration (algorithm, model size, clients, data, seed)."""
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        lines = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(
            f"the checkpoint comes from another configuration ({lines}); resume it with the configuration "
            "that wrote it, or start a new run without ckpt_path"
        )


def warn_changed_settings(checkpoint: Mapping[str, Any], hparams: Mapping[str, Any], client: pl.LightningModule,
                          data_hparams: Mapping[str, Any]) -> None:
    """Warn about hyperparameters of the module, the client and the data that differ from the
    checkpoint's (the run uses the new values: a flag the user typed is never ignored)."""
    saved = federated_entry(checkpoint)
    recipe = client_recipe(client)
    changes = []
    groups = [
        ("model", checkpoint.get("hyper_parameters", {}), dict(hparams)),
        ("client", saved.get("client", {}).get("hparams", {}), recipe["hparams"]),
        ("data", checkpoint.get("datamodule_hyper_parameters", {}), dict(data_hparams)),
    ]
    for group, before, now in groups:
        for key in sorted(set(before) | set(now)):
            if key.startswith("_") or before.get(key) == now.get(key):
                continue
            changes.append(f"{group}.{key}: checkpoint {before.get(key)!r}, now {now.get(key)!r}")
    before_class = saved.get("client", {}).get("class_path")
    if before_class is not None and before_class != recipe["class_path"]:
        changes.append(f"client class: checkpoint {before_class}, now {recipe['class_path']}")
    if changes:
        warnings.warn("resuming with changed settings; the run uses the new values: " + "; ".join(changes),
                      UserWarning, stacklevel=3)


def restore_store(saved: Mapping[str, Any], current: ClientStateStore, resuming: bool,
                  checkpoint_path: Optional[str]) -> ClientStateStore:
    """The client state store of a checkpoint's index ``saved``, with ``current``'s settings.

    Resuming a fit takes the run's own link of every file the index names and checks them all
    against the sizes and checksums it recorded before training starts (CheckpointError naming the
    missing and damaged ones: :meth:`~fl_lightning.client_store.ClientStateStore.load_state_dict`);
    validate/test/predict and ``load_from_checkpoint`` need the global model only, so there a
    store whose folder is gone is replaced by an empty one, with a warning.
    """
    def empty() -> ClientStateStore:
        return ClientStateStore(current.memory_budget, current.directory, current.keep_checkpoints)

    store = empty()
    try:
        # reads (and checks) the entries that fit in RAM; finds the files beside the checkpoint if they moved with it
        store.load_state_dict(saved, checkpoint_path=checkpoint_path, resuming=resuming)
    except FileNotFoundError as error:
        if resuming:
            raise CheckpointError(f"the checkpoint's client state cannot be resumed: {error}") from error
        rank_zero_warn(f"the checkpoint's client state is not loaded ({error}); the global model is")
        return empty()
    except ValueError as error:
        raise CheckpointError(f"the checkpoint's client state cannot be resumed: {error}") from error
    return store


def logged_hparams(hparams: dict[str, Any], client: pl.LightningModule, datamodule: Any) -> dict[str, Any]:
    """What the loggers record as a run's hyperparameters: the module's ``hparams``, the client
    module's under ``client`` and the datamodule's under ``data``, each as ``class_path`` +
    ``init_args``, tuples as lists (so that the file reads with ``yaml.safe_load``)."""
    recipe = client_recipe(client)
    hparams["client"] = {"class_path": recipe["class_path"], "init_args": recipe["hparams"]}
    if datamodule is not None:
        data = {k: v for k, v in dict(datamodule.hparams).items() if not k.startswith("_")}
        hparams["data"] = {"class_path": class_path_of(type(datamodule)), "init_args": data}
    for key, value in hparams.items():
        hparams[key] = _tuples_as_lists(value)
    return hparams


def _tuples_as_lists(value: Any) -> Any:
    """``value`` with every tuple inside it (dict values, list items) turned into a list."""
    if isinstance(value, dict):
        return {k: _tuples_as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tuples_as_lists(v) for v in value]
    return value


class FederatedCheckpointing(pl.LightningModule):
    """The checkpoint hooks of a ``FederatedModule``: the ``"federated"`` entry written and checked,
    ``load_from_checkpoint`` reading with ``weights_only=True`` and rebuilding the client, and the
    hyperparameters the loggers record."""

    client: pl.LightningModule
    #: the run's machinery (:class:`~fl_lightning.engine.FederationEngine`; not imported: it imports this module)
    engine: Any

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls: type[ModuleT], checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
        strict: Optional[bool] = None, allowed_classes: AllowedClasses = (), weights_only: Optional[bool] = None,
        allow_unverified: bool = False, **kwargs: Any,
    ) -> ModuleT:
        """The module of a checkpoint this algorithm wrote, read with ``weights_only=True``; building
        it runs nothing of the file's choosing.

        The client module is rebuilt from the class path and hyperparameters the checkpoint holds
        (its weights come from the checkpoint) unless given as ``client=...``; other constructor
        arguments that are objects are rebuilt where the checkpoint records them as ``class_path``
        entries (``fl-lightning fit`` does), else they must be given. A file builds only this
        class, fl_lightning's own classes for an argument of their kind (its models, partitioners,
        optimizers and ``torch.optim``'s) and the classes in ``allowed_classes``, with plain
        keyword arguments (:mod:`fl_lightning.file_arguments`): a client module of your own needs
        ``allowed_classes=[MyNet]`` or ``client=MyNet(...)``.

        Args:
            checkpoint_path, map_location, hparams_file, strict, kwargs: as Lightning's
                (``hparams_file`` is read as plain YAML); ``kwargs`` are taken as given.
            allowed_classes: further classes the checkpoint may name: class paths
                (``"my_package.models.Net"``, imported here: you trust them) or the classes.
            weights_only: True or None: checkpoints are always read with ``weights_only=True``.
            allow_unverified: accept a checkpoint without a checksum (one you trust; see
                :func:`~fl_lightning.checkpoints.load_checkpoint`).

        Raises:
            CheckpointError: the file cannot be used (see :func:`~fl_lightning.checkpoints.load_checkpoint`),
                another algorithm wrote it, or it names a class it may not build.
        """
        check_weights_only(weights_only)
        allowed_classes = list(allowed_classes)
        checkpoint = load_checkpoint(checkpoint_path, default_map_location(map_location), name="checkpoint_path",
                                     allow_unverified=allow_unverified)
        where = f"checkpoint_path {str(checkpoint_path)!r}"
        check_written_by(checkpoint, cls, checkpoint_path)
        if "client" not in kwargs:
            recipe = checkpoint.get("federated", {}).get("client")
            if recipe is None:
                raise CheckpointError(f"{checkpoint_path} holds no client recipe (written before it was saved): "
                                      "pass client=<the client module>")
            kwargs["client"] = build_client(recipe, allowed_classes, where)
        return build_checked(cls, checkpoint, hparams_file, strict, allowed_classes, where, **kwargs)

    @property
    def hparams_initial(self) -> Any:
        """What the loggers record as the run's hyperparameters (TensorBoard's ``hparams.yaml``):
        the module's, the client module's under ``client`` and the datamodule's under ``data``
        (:func:`~fl_lightning.module_checkpoint.logged_hparams`). Checkpoints keep the module's own ``hparams``."""
        return logged_hparams(super().hparams_initial, self.client, getattr(attached_trainer(self), "datamodule", None))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["federated"] = {
            "store": self.engine.store.state_dict(),
            "fingerprint": self.engine.fingerprint(),
            "client": client_recipe(self.client),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another configuration (algorithm, model size, clients, data,
        seed) or with non-finite state; warn about every other setting that changed (the run
        uses the new value: a flag the user typed is never ignored)."""
        saved = federated_entry(checkpoint)
        trainer = attached_trainer(self)
        if trainer is not None and getattr(trainer, "datamodule", None) is not None:
            check_fingerprint(saved["fingerprint"], self.engine.fingerprint())
            warn_changed_settings(checkpoint, self.hparams, self.client, getattr(self.engine.datamodule, "hparams", {}))
        resuming = trainer is not None and trainer.state.fn == "fit"
        self.engine.store = restore_store(saved["store"], self.engine.store, resuming, getattr(trainer, "ckpt_path", None))
