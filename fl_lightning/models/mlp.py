"""Fully connected reference models: an MLP and multinomial logistic regression."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from fl_lightning.models.classifier import Classifier


class MLP(Classifier):
    """``in_features -> hidden... -> num_classes`` with ReLU; inputs are flattened.

    The default (784, 512-256, 10) is FedDeper's MNIST MLP; (784, 200-200, 10) is FedAvg's.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (512, 256),
        num_classes: int = 10,
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_milestones=lr_milestones, lr_gamma=lr_gamma)
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)


class LogisticRegression(MLP):
    """Multinomial logistic regression: one linear layer on flattened inputs."""

    def __init__(
        self, in_features: int = 60, num_classes: int = 10, lr: float = 0.01, momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(in_features, (), num_classes, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_milestones=lr_milestones, lr_gamma=lr_gamma)
