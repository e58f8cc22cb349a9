"""Convolutional classifiers of FedDeper's experiments: [conv -> ReLU -> maxpool2] blocks, then FC layers.

* ``CNN()`` (the defaults): FedDeper's MNIST CNN, conv 3x3 (padding 1) with 32 and 64 filters,
  FC 1024-512, 10 outputs (3,761,034 parameters);
* ``CNN.cifar10()``: FedDeper's CIFAR-10 CNN, conv 5x5 (no padding) with 64 and 128 filters,
  FC 1024-512-256, 10 outputs (4,146,314 parameters).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from fl_lightning.models.classifier import Classifier
from fl_lightning.models.pooling import MaxPool2d


def conv_output_size(size: int, kernel_size: int, padding: int) -> int:
    """Side of a square feature map after a stride-1 convolution and a 2x2 max-pool."""
    return (size + 2 * padding - kernel_size + 1) // 2


def cnn_layers(
    in_channels: int,
    image_size: int,
    conv_channels: Sequence[int],
    kernel_size: int,
    padding: int,
    hidden: Sequence[int],
    out_features: int,
) -> nn.Sequential:
    """[conv(kernel_size, padding) -> ReLU -> maxpool2] per conv channel, flatten, [FC -> ReLU] per hidden, FC.

    The max-pools are :class:`~fl_lightning.models.pooling.MaxPool2d`: ``nn.MaxPool2d``'s results, faster on a CPU."""
    if kernel_size < 1 or padding < 0:
        raise ValueError(f"kernel_size must be >= 1 and padding >= 0, got kernel_size={kernel_size}, padding={padding}")
    layers: list[nn.Module] = []
    channels, size = in_channels, image_size
    for c in conv_channels:
        layers += [nn.Conv2d(channels, c, kernel_size, padding=padding), nn.ReLU(), MaxPool2d(2)]
        channels, size = c, conv_output_size(size, kernel_size, padding)
        if size < 1:
            raise ValueError(f"image_size={image_size} is too small for {len(conv_channels)} conv layers of kernel {kernel_size}")
    layers.append(nn.Flatten())
    width = channels * size * size
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


class CNN(Classifier):
    """A plain CNN classifier; the defaults are FedDeper's MNIST CNN (1x28x28 inputs).

    Args:
        in_channels: image channels (1 for MNIST, 3 for CIFAR).
        image_size: input height = width.
        conv_channels: output channels of the conv layers.
        kernel_size: side of the square conv kernels.
        padding: zero padding of each conv.
        hidden: widths of the hidden fully connected layers.
        num_classes: number of classes.
        lr, momentum, weight_decay, lr_milestones, lr_gamma: the local SGD optimizer and its schedule.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        conv_channels: Sequence[int] = (32, 64),
        kernel_size: int = 3,
        padding: int = 1,
        hidden: Sequence[int] = (1024, 512),
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
        self.net = cnn_layers(in_channels, image_size, conv_channels, kernel_size, padding, hidden, num_classes)

    @classmethod
    def cifar10(cls, **kwargs: Any) -> "CNN":
        """FedDeper's CIFAR-10 CNN (3x32x32, conv 5x5 64-128, FC 1024-512-256); ``kwargs`` override."""
        args: dict[str, Any] = dict(
            in_channels=3, image_size=32, conv_channels=(64, 128), kernel_size=5, padding=0, hidden=(1024, 512, 256)
        )
        return cls(**{**args, **kwargs})
