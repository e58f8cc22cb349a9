"""FedProxVR's image federations under the class names the shipped configs use.

Each is its torchvision datamodule with the 70,000 images pooled (``pool_test_set=True``) and
split by ``PowerLawPartitioner`` (two labels per client, power-law sizes), which a config can
also write directly::

    data:
      class_path: fl_lightning.datamodules.MNISTFederated
      init_args:
        pool_test_set: true
        test_fraction: 0.25
        partitioner: {class_path: fl_lightning.datamodules.PowerLawPartitioner, init_args: {used_fraction: 0.3}}

The paper (Dinh et al., 2020) gives every client a 75/25 train/test split (``test_fraction=0.25``);
the global test accuracy is then over the union of the clients' test splits.
"""

from __future__ import annotations

from typing import Any

from fl_lightning.datamodules.partitioners import PowerLawPartitioner
from fl_lightning.datamodules.vision import FashionMNISTFederated, MNISTFederated


class PowerLawMNIST(MNISTFederated):
    """MNIST (train and test pooled) over clients with two labels each and power-law sizes.

    Args:
        labels_per_client, min_per_label, sigma, used_fraction: ``PowerLawPartitioner``'s
            ``num_classes_per_partition``, ``min_per_class``, ``sigma``, ``used_fraction``.
        **kwargs: the ``MNISTFederated`` arguments.
    """

    def __init__(self, labels_per_client: int = 2, min_per_label: int = 10, sigma: float = 2.0,
                 used_fraction: float = 1.0, **kwargs: Any) -> None:
        super().__init__(partitioner=PowerLawPartitioner(num_classes_per_partition=labels_per_client,
                                                         min_per_class=min_per_label, sigma=sigma,
                                                         used_fraction=used_fraction),
                         pool_test_set=True, **kwargs)


class PowerLawFashionMNIST(FashionMNISTFederated):
    """Fashion-MNIST (train and test pooled) over clients with two labels each and power-law sizes.

    Args:
        labels_per_client, min_per_label, sigma, used_fraction: ``PowerLawPartitioner``'s
            ``num_classes_per_partition``, ``min_per_class``, ``sigma``, ``used_fraction``.
        **kwargs: the ``FashionMNISTFederated`` arguments.
    """

    def __init__(self, labels_per_client: int = 2, min_per_label: int = 10, sigma: float = 2.0,
                 used_fraction: float = 1.0, **kwargs: Any) -> None:
        super().__init__(partitioner=PowerLawPartitioner(num_classes_per_partition=labels_per_client,
                                                         min_per_class=min_per_label, sigma=sigma,
                                                         used_fraction=used_fraction),
                         pool_test_set=True, **kwargs)
