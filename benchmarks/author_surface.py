"""The names an algorithm author meets: what ``FederatedModule`` (and a ``ClientRun``) add to Lightning's.

Counts the public names a subclass of ``FederatedModule`` sees beyond ``pl.LightningModule``'s (class
attributes, methods, properties, and the attributes ``__init__`` sets): the constructor's arguments set
apart, the others (the author's surface) split into hooks and declarations and the rest; and the public
names of ``ClientRun`` and of its two groups, ``run.data`` and ``run.local``; and the methods of the client
backend protocol, ``ClientBackend`` (the abstract ones apart). Run it in two trees to compare (``PYTHONPATH=<tree> python benchmarks/author_surface.py``).
"""

from __future__ import annotations

import inspect

import pytorch_lightning as pl
import torch

import fl_lightning
from fl_lightning.algorithms import FedAvg
from fl_lightning.module import FederatedModule
from fl_lightning.backends import ClientBackend
from fl_lightning.run import ClientRun, LocalWork, RunData


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def public(names: set[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("_"))


def main() -> None:
    lightning = set(dir(pl.LightningModule)) | set(vars(pl.LightningModule()))
    module = FedAvg(_Tiny())
    every = public((set(dir(type(module))) | set(vars(module))) - lightning)
    arguments = set(inspect.signature(FederatedModule.__init__).parameters) - {"self", "client"}
    names = [n for n in every if n not in arguments]
    hooks = [n for n in names if inspect.isfunction(getattr(FederatedModule, n, None))
             and n.startswith(("client_", "server_", "local_lr_scheduler", "configure_server", "add_", "remove_"))]
    run = ClientRun(0, 0, None, torch.zeros(1), {}, RunData(1, 1), LocalWork(1))  # type: ignore[arg-type]
    run_names = public(set(dir(ClientRun)) | set(vars(run)))
    groups = {name: public(set(dir(type(value))) | set(getattr(value, "__dict__", {}))
                           | set(getattr(type(value), "__slots__", ())))
              for name, value in (("data", run.data), ("local", run.local))}
    print(f"fl_lightning at {fl_lightning.__file__}")
    print(f"FederatedModule: {len(every)} public names beyond LightningModule's: {len(every) - len(names)} constructor "
          f"arguments ({', '.join(n for n in every if n in arguments)}) and {len(names)} others (the author's surface)")
    print(f"  hooks and declarations ({len(hooks)}): {', '.join(hooks)}")
    print(f"  the rest ({len(names) - len(hooks)}): {', '.join(n for n in names if n not in hooks)}")
    print(f"ClientRun: {len(run_names)} public names: {', '.join(run_names)}")
    for name, members in groups.items():
        print(f"  run.{name}: {len(members)} names: {', '.join(members)}")
    protocol = [n for n in public(set(dir(ClientBackend))) if callable(getattr(ClientBackend, n))]
    abstract = sorted(ClientBackend.__abstractmethods__)
    print(f"ClientBackend: {len(protocol)} public methods ({', '.join(protocol)}), {len(abstract)} abstract "
          f"({', '.join(abstract)})")


if __name__ == "__main__":
    main()
