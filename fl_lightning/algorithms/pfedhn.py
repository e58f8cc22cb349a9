"""pFedHN (Shamsian et al., ICML 2021): a server hypernetwork generates each client's model from a
trainable per-client embedding.

Round, per sampled client i: ``theta_i = h(e_i)``; k local steps give ``dtheta_i``; the server
back-propagates it into ``(deta_h, de_i)``. Unlike PeFLL, the server keeps one embedding per
client (state grows with the number of clients), and a client never seen in training needs
iterative optimisation: a new random embedding is fitted with ``new_client_rounds`` rounds of
client-server communication, the hypernetwork frozen (the procedure of PeFLL's Table 1).

Defaults are the reference code's: one client per server step (``clients_per_round = 1``: a
round is one of its steps), SGD lr 1e-2 with momentum 0.9 and weight decay 1e-3 on the whole
hypernetwork, the embedding table included (``lambda_h = lambda_e = 5e-4``: the penalty
``lambda ||.||^2`` whose gradient ``2 lambda w`` is that decay). With more clients per round the
hypernetwork contributions are averaged (as PeFLL does), while each client's embedding row
receives its own full difference.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from fl_lightning.algorithms.pefll import HypernetworkFederation, ServerOptimizer, vector_jacobian
from fl_lightning.lightning_package import pl
from fl_lightning.models.hypernetwork import HyperNetworkSize
from fl_lightning.run import ClientRun
from fl_lightning.seeding import generator


class PFedHN(HypernetworkFederation):
    """pFedHN with the reference hyper-parameters as defaults.

    Args:
        client: the client model; its optimizer is the local one (reference: SGD lr 5e-3,
            momentum 0.9, weight decay 5e-5, 50 steps).
        embedding_dim: length of each client's embedding (reference: ``int(1 + n / 4)``).
        new_client_rounds: rounds of embedding fitting for a client not seen in training.
        lambda_e: L2 penalty ``lambda_e ||E||^2`` on the client embedding table (reference: weight
            decay 1e-3 = ``lambda_e`` 5e-4, as on the hypernetwork).
        hypernetwork_size, hypernetwork_width, relu_before_head, lambda_h: see ``HypernetworkFederation``
            (reference: weight decay 1e-3 = ``lambda_h`` 5e-4).
        server_optimizer, server_lr, server_momentum, server_clip, client_clip: see ``HypernetworkFederation``
            (reference: SGD lr 1e-2, momentum 0.9).
        **kwargs: the ``FederatedModule`` arguments; ``clients_per_round`` is 1 (the reference's
            one client per server step) unless it or ``clients_fraction`` is given.
    """

    def __init__(
        self,
        client: pl.LightningModule,
        embedding_dim: int = 26,
        new_client_rounds: int = 20,
        lambda_e: float = 5e-4,
        hypernetwork_size: HyperNetworkSize = "M",
        hypernetwork_width: int = 100,
        relu_before_head: bool = False,
        lambda_h: float = 5e-4,
        server_optimizer: ServerOptimizer = "sgd",
        server_lr: float = 1e-2,
        server_momentum: float = 0.9,
        server_clip: Optional[float] = 50.0,
        client_clip: Optional[float] = 50.0,
        **kwargs: Any,
    ) -> None:
        if new_client_rounds < 0:
            raise ValueError(f"new_client_rounds must be >= 0, got {new_client_rounds}")
        if lambda_e < 0:
            raise ValueError(f"lambda_e must be >= 0, got {lambda_e}")
        if kwargs.get("clients_per_round") is None and kwargs.get("clients_fraction") is None:
            kwargs["clients_per_round"] = 1
        super().__init__(
            client,
            hypernetwork_size=hypernetwork_size,
            hypernetwork_width=hypernetwork_width,
            relu_before_head=relu_before_head,
            lambda_h=lambda_h,
            server_optimizer=server_optimizer,
            server_lr=server_lr,
            server_momentum=server_momentum,
            server_clip=server_clip,
            client_clip=client_clip,
            **kwargs,
        )
        self.embedding_dim = embedding_dim
        self.new_client_rounds = new_client_rounds
        self.lambda_e = lambda_e
        self.client_embeddings: Optional[nn.Embedding] = None  # the table, made in setup; a client reads its row
        self.add_broadcast("client_embeddings")
        self.build_hypernetwork(embedding_dim)

    def setup(self, stage: str) -> None:
        n = self.engine.datamodule.num_clients
        if self.client_embeddings is None:
            self.client_embeddings = nn.Embedding(n, self.embedding_dim, device=self.device)
            with torch.no_grad():
                init = torch.randn(n, self.embedding_dim, generator=generator(self.seed, "pfedhn-embeddings"))
                self.client_embeddings.weight.copy_(init)
        elif self.client_embeddings.num_embeddings != n:
            raise ValueError(f"the client embedding table has {self.client_embeddings.num_embeddings} rows, the data {n} clients")
        super().setup(stage)
        # each client's update touches its own row only: the rows of the round add up (no aggregator mixes them)
        self.add_update("codes", self.client_embeddings.weight.numel(), reduction="sum")

    def server_groups(self) -> dict[str, tuple[list[nn.Parameter], float]]:
        assert self.client_embeddings is not None, "client embeddings are created in setup()"
        return {**super().server_groups(), "codes": ([self.client_embeddings.weight], self.lambda_e)}

    def client_code(self, run: ClientRun) -> tuple[Tensor, Tensor]:
        assert self.client_embeddings is not None
        leaf = self.client_embeddings.weight[run.client_id].detach().requires_grad_()
        return leaf, leaf

    def code_update(self, run: ClientRun, code_grad: Tensor) -> dict[str, Tensor]:
        """The embedding table's update: row ``i`` holds ``de_i``, other rows 0 (uploads declared
        ``"sum"``, so that the round gives each client its own difference)."""
        assert self.client_embeddings is not None
        table = torch.zeros_like(self.client_embeddings.weight)
        table[run.client_id] = code_grad
        return {"codes": table.reshape(-1).float()}

    def eval_code(self, client_id: int) -> Tensor:
        """A training client's embedding; for any other client, a fitted new embedding."""
        assert self.client_embeddings is not None
        if client_id in set(self.engine.datamodule.train_clients):
            return self.client_embeddings.weight[client_id].detach()
        return self.fit_new_client(client_id)

    def fit_new_client(self, client_id: int) -> Tensor:
        """A new random embedding fitted by ``new_client_rounds`` rounds (local steps, then an SGD
        step of ``server_lr`` on ``-J_e^T dtheta``), the hypernetwork frozen."""
        code = torch.randn(self.embedding_dim, generator=generator(self.seed, "new-client", client_id)).to(self.device)
        with torch.inference_mode(False), torch.enable_grad():
            for r in range(self.new_client_rounds):
                leaf = code.clone().requires_grad_()
                with torch.autocast(self.device.type, enabled=False):
                    theta = self.hypernetwork(leaf)
                end = self.engine.train_locally(client_id, start=theta.detach(), stream="new-client-batches", round_idx=r)
                (grad,) = vector_jacobian(theta, [leaf], end - theta.detach())
                code = code + self.server_lr * grad.detach()
        return code
