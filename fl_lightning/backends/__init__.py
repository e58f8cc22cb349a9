"""Client backends: who executes the client protocol for this process's clients of a round.

* :class:`SequentialBackend` (``"sequential"``, the default and the reference): one client after
  another, in the client module itself.
* :class:`BatchedBackend` (``"batched"``): blocks of clients advance one local step together,
  vectorized with ``torch.func``.
"""

from fl_lightning.backends.base import ClientBackend
from fl_lightning.backends.batched import BatchedBackend, FunctionalRun
from fl_lightning.backends.sequential import ModuleRun, SequentialBackend

__all__ = ["BatchedBackend", "ClientBackend", "FunctionalRun", "ModuleRun", "SequentialBackend"]
