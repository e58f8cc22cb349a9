"""Client backends: who executes the client protocol for this process's clients of a round.

* :class:`SequentialBackend` (``"sequential"``, the default and the reference): one client after
  another, in the client module itself.
* :class:`BatchedBackend` (``"batched"``): blocks of clients advance one local step together,
  vectorized with ``torch.func``.

Both implement :class:`ClientBackend` (:mod:`fl_lightning.backends.base`) and read the engine only
through a :class:`ClientContext`; :data:`BACKENDS` maps the names ``client_backend`` takes to them.
"""

from fl_lightning.backends.base import ClientBackend
from fl_lightning.backends.batched import BatchedBackend, FunctionalRun
from fl_lightning.backends.block import ClientBlock
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.client_round import ClientRoundResult, LocalSettings, ModuleRun, run_client
from fl_lightning.backends.sequential import SequentialBackend, train_plainly

#: the client backends by the name ``FederatedModule(client_backend=...)`` takes
BACKENDS: dict[str, type[ClientBackend]] = {"sequential": SequentialBackend, "batched": BatchedBackend}

__all__ = ["BACKENDS", "BatchedBackend", "ClientBackend", "ClientBlock", "ClientContext", "ClientRoundResult",
           "FunctionalRun", "LocalSettings", "ModuleRun", "SequentialBackend", "run_client", "train_plainly"]
