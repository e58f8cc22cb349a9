"""Client backends: who executes the client protocol for this process's clients of a round.

* :class:`SequentialBackend` (``"sequential"``, the default and the reference): one client after
  another, in the client module itself.
"""

from fl_lightning.backends.base import ClientBackend
from fl_lightning.backends.sequential import ModuleRun, SequentialBackend

__all__ = ["ClientBackend", "ModuleRun", "SequentialBackend"]
