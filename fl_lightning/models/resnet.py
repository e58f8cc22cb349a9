"""ResNet20 for 32x32 images (He et al., 2016, the CIFAR variant): 3 stages x 3 basic blocks,
16/32/64 channels, global average pooling, ~0.27 M parameters. FedDRO's CIFAR model."""

from __future__ import annotations

from typing import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.models.classifier import Classifier


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the (1x1 conv + BN when the shape changes) shortcut, then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet_cifar_layers(depth: int, in_channels: int, num_classes: int) -> nn.Sequential:
    """The CIFAR ResNet of ``depth = 6n + 2`` layers (20 -> n = 3)."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth must be 6n + 2 with n >= 1 (20, 32, 44, 56...), got {depth}")
    blocks = (depth - 2) // 6
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    channels = 16
    for stage, width in enumerate((16, 32, 64)):
        for b in range(blocks):
            layers.append(BasicBlock(channels, width, 2 if stage > 0 and b == 0 else 1))
            channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class ResNet20(Classifier):
    """ResNet20 classifier (CIFAR-10/100 sized inputs).

    Args:
        num_classes: number of classes.
        in_channels: image channels.
        depth: ``6n + 2`` (20 by default; 32, 44, 56 give the deeper CIFAR ResNets).
        lr, momentum, weight_decay, lr_milestones, lr_gamma: the local SGD optimizer and its schedule.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        depth: int = 20,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_milestones=lr_milestones, lr_gamma=lr_gamma)
        self.save_hyperparameters()
        self.net = resnet_cifar_layers(depth, in_channels, num_classes)
