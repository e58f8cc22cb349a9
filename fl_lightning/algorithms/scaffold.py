"""SCAFFOLD (Karimireddy et al., 2020) with option II control variates.

Client i keeps a control variate ``c_i`` (in the client state store, zeros before its first
round); the server keeps ``c``. Each local step uses the corrected gradient
``g(y) - c_i + c``. After K steps of learning rate eta::

    c_i+ = c_i - c + (x - y) / (K eta)         (option II)
    uploads: delta = y - x,  control = c_i+ - c_i

and the server applies (Algorithm 1, with ``eta_g = server_lr``)::

    x <- x + (eta_g / |S|) sum_{i in S} delta_i         (uniform over the round's clients S)
    c <- c + (1 / N) sum_{i in S} control_i             (= (|S| / N) * uniform mean)

The control deltas are always averaged uniformly, which keeps ``c = mean over all N clients of
c_i``; ``weighting="num_samples"`` weighs the model deltas by sample count instead.
Option II's control formula assumes plain SGD local steps: a client optimizer with momentum,
weight decay, dampening or Nesterov is refused, and its trainable parameters need one rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.paper import PaperDefaults
from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.run import ClientRun


def scaffold_control_delta(start: Tensor, end: Tensor, server_control: Tensor, steps: int, lr: float) -> Tensor:
    """Option II: ``c_i+ - c_i = -c + (x - y) / (K lr)`` for parameter vectors ``x=start``, ``y=end``."""
    return (start - end) / (steps * lr) - server_control


class SCAFFOLD(FederatedModule):
    """Stochastic controlled averaging with plain SGD local optimizers (as in the paper).

    Default aggregation (Algorithm 1): the uniform mean of the model deltas,
    ``x <- x + (eta_g / |S|) sum_i delta_i``; ``weighting="num_samples"`` gives
    ``x <- x + eta_g sum_i n_i delta_i / sum_i n_i``. The control deltas are averaged uniformly
    in both cases.

    Args:
        **kwargs: the ``FederatedModule`` arguments (``weighting``, ``server_lr`` = ``eta_g``...).
    """

    paper = PaperDefaults(weighting="uniform")

    def __init__(self, client: pl.LightningModule, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        p = self.global_model.num_params
        self.add_broadcast("server_control", torch.zeros(p))  # c: the clients' steps read it
        self.add_update("control", p, reduction="mean")
        self.add_client_state("control", torch.zeros(p))

    def setup(self, stage: str) -> None:
        super().setup(stage)
        require_plain_sgd(self.engine.local_optimizer(), "SCAFFOLD (option II)")

    def client_init(self, run: ClientRun) -> None:
        run.scratch["correction"] = run.layout.split_params(self.server_control - run.state["control"])

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """``y <- opt(y, g(y) - c_i + c)``."""
        loss, grads = run.loss_and_grad(batch)
        run.step([g + c for g, c in zip(grads, run.scratch["correction"])])
        return loss

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        end, params, local = run.end(), run.layout.params_of, run.local  # c lives on the parameters' entries
        control = scaffold_control_delta(params(run.start), params(end), self.server_control, local.steps_taken, local.lr)
        run.state["control"] = run.state["control"] + control
        return {"delta": end - run.start, "control": control}

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        super().server_update(aggregate)
        fraction = self.engine.round_num_updates / len(self.engine.datamodule.train_clients)
        self.server_control += fraction * aggregate["control"].to(self.device)
