"""The CNN of FedProxVR's MNIST experiment (Dinh et al., 2020; the CNN of McMahan et al., 2017).

conv 5x5 (32, 'same') -> ReLU -> max-pool 2 -> conv 5x5 (64, 'same') -> ReLU -> max-pool 2 ->
FC 512 -> ReLU -> FC ``num_classes``: 1,663,370 parameters on 1x28x28 inputs. The authors'
code declares dropout layers that are never active, so there is none here. The layers are
``fl_lightning.models.cnn.cnn_layers`` with these settings.
"""

from __future__ import annotations

from typing import Sequence

from fl_lightning.models.classifier import Classifier
from fl_lightning.models.cnn import cnn_layers


class FedProxVRCNN(Classifier):
    """FedProxVR's MNIST CNN.

    Args:
        in_channels: image channels.
        image_size: input height = width.
        num_classes: number of classes.
        lr, momentum, weight_decay, lr_milestones, lr_gamma: the local SGD optimizer and its schedule (FedAvg's step size; FedProxVR reads ``lr``
            unless it is given its own).
    """

    def __init__(
        self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, lr: float = 0.01,
        momentum: float = 0.0, weight_decay: float = 0.0,
        lr_milestones: Sequence[int] = (), lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_milestones=lr_milestones, lr_gamma=lr_gamma)
        self.save_hyperparameters()
        self.net = cnn_layers(in_channels, image_size, (32, 64), kernel_size=5, padding=2, hidden=(512,),
                              out_features=num_classes)
