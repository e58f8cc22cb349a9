"""Hypernetworks and embedding networks of PeFLL (Scott et al., ICLR 2024) and pFedHN.

* :class:`HyperNetwork` maps a descriptor ``v`` (length ``l``) to the full parameter vector of a
  client model: an MLP trunk ``l -> width -> ... -> width`` (ReLU) and one linear head per
  client tensor. Sizes S / M / L have 1 / 3 / 5 hidden ``width x width`` layers after the first
  one (PeFLL Table 5 is M; Table 7 compares the three).
* Embedding networks ``phi(x, y)`` give one vector per labelled sample; a client's descriptor
  is their mean over a batch (:func:`mean_descriptor`):

  - :class:`CNNEmbedding`: PeFLL's LeNet embedding, the label appended as ``C`` constant one-hot
    planes (or no label planes for clients without labels, ``use_labels=False``);
  - :class:`MLPEmbedding`: an MLP on ``[flatten(x), onehot(y)]`` (or on ``x`` alone);
  - :class:`LabelEmbedding`: PeFLL's "linear" embedding of the one-hot label only, so the
    descriptor is ``W hist(y) + b``.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.models.lenet import lenet_layers

HyperNetworkSize = Literal["S", "M", "L"]

#: hidden ``width x width`` layers after the first layer, per PeFLL size name (Table 7).
HYPERNETWORK_DEPTHS: dict[str, int] = {"S": 1, "M": 3, "L": 5}


class HyperNetwork(nn.Module):
    """``h(v)``: descriptor -> flat parameter vector of a client model.

    Args:
        descriptor_dim: length ``l`` of the input descriptor.
        target_shapes: the shapes of the client model's parameters, in ``parameters()`` order;
            the output is their concatenation, flattened, in that order.
        size: ``"S"``, ``"M"`` or ``"L"`` (1, 3 or 5 hidden layers after the first).
        width: width of the hidden layers (100 in the paper).
        relu_before_head: apply ReLU after the last hidden layer (PeFLL Table 5) or not (the
            authors' code).
    """

    def __init__(
        self,
        descriptor_dim: int,
        target_shapes: Sequence[Sequence[int]],
        size: HyperNetworkSize = "M",
        width: int = 100,
        relu_before_head: bool = True,
    ) -> None:
        super().__init__()
        if descriptor_dim < 1:
            raise ValueError(f"descriptor_dim must be >= 1, got {descriptor_dim}")
        if size not in HYPERNETWORK_DEPTHS:
            raise ValueError(f"size must be one of {sorted(HYPERNETWORK_DEPTHS)}, got {size!r}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if not target_shapes:
            raise ValueError("target_shapes must name at least one tensor")
        self.target_shapes = [torch.Size(s) for s in target_shapes]
        layers: list[nn.Module] = [nn.Linear(descriptor_dim, width), nn.ReLU()]
        for i in range(HYPERNETWORK_DEPTHS[size]):
            layers.append(nn.Linear(width, width))
            if i < HYPERNETWORK_DEPTHS[size] - 1 or relu_before_head:
                layers.append(nn.ReLU())
        self.trunk = nn.Sequential(*layers)
        self.heads = nn.ModuleList(nn.Linear(width, s.numel()) for s in self.target_shapes)

    @property
    def output_dim(self) -> int:
        """Length of the generated parameter vector."""
        return sum(s.numel() for s in self.target_shapes)

    def forward(self, descriptor: Tensor) -> Tensor:
        """The flat parameter vector for one descriptor of shape ``[l]``."""
        features = self.trunk(descriptor)
        return torch.cat([head(features) for head in self.heads])


def mean_descriptor(embedding: nn.Module, x: Tensor, y: Optional[Tensor]) -> Tensor:
    """``v = (1/|B|) sum_{(x, y) in B} phi(x, y)``: the mean embedding of a batch, shape ``[l]``."""
    return embedding(x, y).mean(dim=0)


def label_planes(y: Tensor, num_classes: int, height: int, width: int) -> Tensor:
    """``[N, C, H, W]`` constant planes holding the one-hot label of each sample."""
    return F.one_hot(y, num_classes).float().view(-1, num_classes, 1, 1).expand(-1, num_classes, height, width)


class _Embedding(nn.Module):
    """Common checks of the embedding networks: ``forward(x, y) -> [N, out_features]``."""

    out_features: int
    uses_labels: bool
    num_classes: int

    def _check_labels(self, y: Optional[Tensor]) -> Tensor:
        if y is None:
            raise ValueError(f"{type(self).__name__} was built with use_labels=True and needs labels, got y=None")
        return y


class CNNEmbedding(_Embedding):
    """PeFLL's LeNet embedding network (Table 4): the client LeNet with ``3 + C`` input channels
    (image + one-hot label planes) and ``descriptor_dim`` outputs without a final nonlinearity.

    Args:
        in_channels: image channels.
        image_size: image height = width.
        num_classes: number of classes ``C``.
        descriptor_dim: output length ``l``.
        use_labels: append the label planes (False: ``phi(x)`` for clients without labels).
        conv_channels, hidden: the LeNet sizes (PeFLL: ``(16, 32)`` and ``(120, 84)``).
    """

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        num_classes: int = 10,
        descriptor_dim: int = 26,
        use_labels: bool = True,
        conv_channels: Sequence[int] = (16, 32),
        hidden: Sequence[int] = (120, 84),
    ) -> None:
        super().__init__()
        if num_classes < 1 or descriptor_dim < 1:
            raise ValueError(f"num_classes and descriptor_dim must be >= 1, got {num_classes}, {descriptor_dim}")
        self.num_classes = num_classes
        self.out_features = descriptor_dim
        self.uses_labels = use_labels
        channels = in_channels + (num_classes if use_labels else 0)
        self.net = lenet_layers(channels, image_size, conv_channels, hidden, descriptor_dim)

    def forward(self, x: Tensor, y: Optional[Tensor] = None) -> Tensor:
        if self.uses_labels:
            planes = label_planes(self._check_labels(y), self.num_classes, x.shape[-2], x.shape[-1])
            x = torch.cat([x, planes.to(x.dtype)], dim=1)
        return self.net(x)


class MLPEmbedding(_Embedding):
    """An MLP embedding on ``[flatten(x), onehot(y)]`` (or on ``flatten(x)`` without labels).

    Args:
        in_features: flattened input size.
        num_classes: number of classes ``C``.
        descriptor_dim: output length ``l``.
        hidden: hidden widths (PeFLL Table 9's "MLP": one hidden layer).
        use_labels: append the one-hot label to the input.
    """

    def __init__(
        self,
        in_features: int = 784,
        num_classes: int = 10,
        descriptor_dim: int = 26,
        hidden: Sequence[int] = (100,),
        use_labels: bool = True,
    ) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 1 or descriptor_dim < 1:
            raise ValueError(
                f"in_features, num_classes and descriptor_dim must be >= 1, got {in_features}, {num_classes}, "
                f"{descriptor_dim}"
            )
        self.num_classes = num_classes
        self.out_features = descriptor_dim
        self.uses_labels = use_labels
        layers: list[nn.Module] = []
        width = in_features + (num_classes if use_labels else 0)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, descriptor_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor, y: Optional[Tensor] = None) -> Tensor:
        x = x.flatten(1)
        if self.uses_labels:
            x = torch.cat([x, F.one_hot(self._check_labels(y), self.num_classes).to(x.dtype)], dim=1)
        return self.net(x)


class LabelEmbedding(_Embedding):
    """PeFLL's "linear" embedding: ``phi(x, y) = W onehot(y) + b``; the image is not used.

    Args:
        num_classes: number of classes ``C``.
        descriptor_dim: output length ``l``.
    """

    uses_labels = True

    def __init__(self, num_classes: int = 100, descriptor_dim: int = 26) -> None:
        super().__init__()
        if num_classes < 1 or descriptor_dim < 1:
            raise ValueError(f"num_classes and descriptor_dim must be >= 1, got {num_classes}, {descriptor_dim}")
        self.num_classes = num_classes
        self.out_features = descriptor_dim
        self.linear = nn.Linear(num_classes, descriptor_dim)

    def forward(self, x: Optional[Tensor], y: Optional[Tensor] = None) -> Tensor:
        return self.linear(F.one_hot(self._check_labels(y), self.num_classes).float())
