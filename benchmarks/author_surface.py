"""The names an algorithm author meets: what ``FederatedModule`` (and a ``ClientRun``) add to Lightning's.

Counts the public names a subclass of ``FederatedModule`` sees beyond ``pl.LightningModule``'s (class
attributes, methods, properties, and the attributes ``__init__`` sets): the constructor's arguments set
apart, the others (the author's surface) split into hooks and declarations and the rest; and the public
names of ``ClientRun`` and of its two groups, ``run.data`` and ``run.local``; and the methods of the client
backend protocol, ``ClientBackend`` (the abstract ones apart). Run it in two trees to compare (``PYTHONPATH=<tree> python benchmarks/author_surface.py``).
"""

from __future__ import annotations

import inspect
import re
import textwrap

import pytorch_lightning as pl
import torch

import fl_lightning
from fl_lightning.algorithms import FedAvg
from fl_lightning.module import FederatedModule
from fl_lightning.backends import ClientBackend
from fl_lightning import run as run_module


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def public(names: set[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("_"))


def instance_names(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` sets on ``self`` (read from its source: no instance is built, so that the
    count runs on trees whose constructors take other arguments), and the class's own names."""
    source = textwrap.dedent(inspect.getsource(cls.__init__)) if "__init__" in vars(cls) else ""
    return set(dir(cls)) | set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", source))


def surface() -> dict[str, list[str]]:
    """The names an author meets, by where: ``"module"`` (a ``FederatedModule``'s beyond Lightning's, its
    constructor's arguments among them), ``"arguments"``, ``"hooks"`` (hooks and declarations), ``"run"`` (a
    ``ClientRun``'s), ``"run.data"`` and ``"run.local"`` (its groups, where the tree has them), ``"backend"``
    (``ClientBackend``'s public methods) and ``"abstract"`` (those a backend must write)."""
    lightning = set(dir(pl.LightningModule)) | set(vars(pl.LightningModule()))
    module = FedAvg(_Tiny())
    every = public((set(dir(type(module))) | set(vars(module))) - lightning)
    arguments = set(inspect.signature(FederatedModule.__init__).parameters) - {"self", "client"}
    names = [n for n in every if n not in arguments]
    out = {
        "module": every,
        "arguments": [n for n in every if n in arguments],
        "author": names,
        "hooks": [n for n in names if inspect.isfunction(getattr(FederatedModule, n, None))
                  and n.startswith(("client_", "server_", "local_lr_scheduler", "configure_server", "add_", "remove_"))],
        "run": public(instance_names(run_module.ClientRun)),
        "backend": [n for n in public(set(dir(ClientBackend))) if callable(getattr(ClientBackend, n))],
        "abstract": sorted(ClientBackend.__abstractmethods__),
    }
    for group, cls_name in (("run.data", "RunData"), ("run.local", "LocalWork")):
        cls = getattr(run_module, cls_name, None)
        if cls is not None:
            out[group] = public(instance_names(cls) | set(getattr(cls, "__slots__", ())))
    return out


def main() -> None:
    names = surface()
    print(f"fl_lightning at {fl_lightning.__file__}")
    print(f"FederatedModule: {len(names['module'])} public names beyond LightningModule's: {len(names['arguments'])} "
          f"constructor arguments ({', '.join(names['arguments'])}) and {len(names['author'])} others (the author's "
          "surface)")
    hooks = names["hooks"]
    print(f"  hooks and declarations ({len(hooks)}): {', '.join(hooks)}")
    print(f"  the rest ({len(names['author']) - len(hooks)}): {', '.join(n for n in names['author'] if n not in hooks)}")
    print(f"ClientRun: {len(names['run'])} public names: {', '.join(names['run'])}")
    for group in ("run.data", "run.local"):
        if group in names:
            print(f"  {group}: {len(names[group])} names: {', '.join(names[group])}")
    print(f"ClientBackend: {len(names['backend'])} public methods ({', '.join(names['backend'])}), "
          f"{len(names['abstract'])} abstract ({', '.join(names['abstract'])})")


if __name__ == "__main__":
    main()
