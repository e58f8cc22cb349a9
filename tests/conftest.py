"""Test session settings: one intra-op thread per test process (tiny models; pytest-xdist
runs several processes), and quiet Lightning info logs."""

import logging

import torch

torch.set_num_threads(1)
logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
