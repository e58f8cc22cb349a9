"""The optional Hugging Face ``datasets`` package, imported when a datamodule or partitioner needs it.

Its own module, importing nothing of fl_lightning, so that ``huggingface.py`` (a datamodule)
and ``partitioners.py`` (``FlowerPartitioner``, which hands its values to flwr-datasets as a
``datasets.Dataset``) both use it without importing each other.
"""

from __future__ import annotations

from types import ModuleType


def import_datasets() -> ModuleType:
    """The ``datasets`` package, or an ImportError that says how to install it."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("Hugging Face datasets are not installed: pip install 'fl-lightning[hf]' (or "
                          "pip install datasets)") from error
    return datasets
