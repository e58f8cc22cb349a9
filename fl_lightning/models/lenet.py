"""LeNet-style convolutional classifiers (5x5 convolutions without padding, 2x2 max-pooling).

One class covers the variants the papers use:

* RAGA's LeNet: ``conv_channels=(6, 16)``, ``hidden=()`` (two conv, two pool, one FC);
* PeFLL's client LeNet: ``conv_channels=(16, 32)``, ``hidden=(120, 84)``;
* the classic LeNet-5 head: ``conv_channels=(6, 16)``, ``hidden=(120, 84)``.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from fl_lightning.models.classifier import Classifier
from fl_lightning.models.cnn import cnn_layers


def lenet_layers(
    in_channels: int, image_size: int, conv_channels: Sequence[int], hidden: Sequence[int], out_features: int
) -> nn.Sequential:
    """The LeNet stack: :func:`~fl_lightning.models.cnn.cnn_layers` with 5x5 kernels and no padding."""
    return cnn_layers(in_channels, image_size, conv_channels, 5, 0, hidden, out_features)


class LeNet(Classifier):
    """A LeNet classifier; defaults: MNIST-sized RAGA LeNet (1x28x28, conv 6-16, one FC).

    Args:
        in_channels: image channels (1 for MNIST, 3 for CIFAR).
        image_size: input height = width (28 or 32).
        conv_channels: output channels of the 5x5 conv layers.
        hidden: widths of the hidden fully connected layers.
        num_classes: number of classes.
        lr, momentum, weight_decay, lr_milestones, lr_gamma: the local SGD optimizer and its schedule.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        conv_channels: Sequence[int] = (6, 16),
        hidden: Sequence[int] = (),
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
        self.net = lenet_layers(in_channels, image_size, conv_channels, hidden, num_classes)
