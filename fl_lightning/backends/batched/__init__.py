"""The batched backend: a block of clients advances one local step together, vectorized with ``torch.func``.

Every client of a block runs ``client_init`` on its own (eagerly); then the block's runs are
stacked along a new client dimension (parameters, floating buffers, optimizer state, state
entries, scratch tensors) and ``client_step`` runs once per local step under ``torch.func.vmap``:
the client module's ``training_step`` (or forward) is evaluated with ``functional_call`` at each
client's tensors, gradients come from ``torch.func.grad``, and the local optimizer is a pure
function (:class:`~fl_lightning.optim.sgd_function.FunctionalSGD`). The plain step (the client's
loss and SGD: the default ``client_step``, and finetuning) is taken with its gradient outside
``vmap``, one backward of the block's summed losses, and its update on the stacked tensors, with
the same result (``vectorized_plain_step``). After the last step the runs
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
  step at a time, so all their blocks are stacked at once. The default block
  (``clients_per_block=None``) is the process's whole round, or as many of its clients as a quarter
  of the device's free memory holds (:mod:`~fl_lightning.backends.batched.sizing`), beside the runs
  of all the round's clients in lock-step rounds.

What it refuses, with the reason and the way out: local optimizers other than
``torch.optim.SGD``; ``16-mixed`` (its loss scaler steps one optimizer); a ``training_step`` that
changes Python state of the client module (a counter, a list it appends to, a tensor kept on
``self``); one that reads a tensor's value in Python (``.item()``, an ``if`` on a tensor), which
``vmap`` cannot run; and an algorithm whose own first step of a round it cannot run: a torch optimizer
of its own (``ProxSGD`` it runs as a function), clients whose runs hold different Python values
(ByrdSAGA's minibatch index), a step that reads the client's id or sample count (PDSGD's). All are
found at setup, by one vectorized trial of the ``training_step`` and one of the algorithm's
``client_init`` and first ``client_step`` (:mod:`~fl_lightning.backends.batched.step_trial`), and
checked again at the first step of every block; the algorithm declares none of it. A graph that
``client_final`` back-propagates through waits in ``run.held``, outside the steps. The one opt-out,
``batchable = False``, is for a client protocol whose vectorized form would silently differ in a way
the backend cannot see (a Python effect outside the module, such as a draw from Python's ``random``).

``client_final`` runs once for a block, ``vmap``-ped over its clients, where that gives each client its
own result, and once per client, with a one-time warning that says why, where it does not
(:mod:`~fl_lightning.backends.batched.final`); the default, ``end - start``, is computed for a block at once.

The client's torchmetrics objects (``Metric``, ``MetricCollection``) that its ``training_step`` updates
and logs work as in the sequential backend: their calls are recorded in the vectorized step and made
for every client after it, on the real objects (:mod:`~fl_lightning.backends.batched.metrics`).
"""

from fl_lightning.backends.batched.backend import BatchedBackend
from fl_lightning.backends.batched.run import FunctionalRun

__all__ = ["BatchedBackend", "FunctionalRun"]
