"""The ``>>>`` examples of the docstrings print what they show.

Every module of ``fl_lightning`` is searched (its functions, classes and methods), and each module
with examples is a test. An example sees its module's names, and ``torch`` and ``np`` (numpy) as
torch's and torchmetrics' docstrings assume them.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import numpy as np
import pytest
import torch

import fl_lightning

MODULES = ["fl_lightning", *(m.name for m in pkgutil.walk_packages(fl_lightning.__path__, "fl_lightning."))]


def examples_of(name: str) -> list[doctest.DocTest]:
    """The docstring tests of module ``name`` that hold at least one example."""
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name, extraglobs={"torch": torch, "np": np})
    return [test for test in tests if test.examples and test.name.startswith(name)]


WITH_EXAMPLES = [name for name in MODULES if examples_of(name)]


def test_the_public_api_has_examples():
    expected = {"fl_lightning.functional.client_summaries", "fl_lightning.functional.robust",
                "fl_lightning.functional.privacy", "fl_lightning.functional.prox", "fl_lightning.functional.partition",
                "fl_lightning.datamodules.targets", "fl_lightning.callbacks.metric_direction",
                "fl_lightning.backends.batched.sizing"}
    assert expected <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_the_examples_of_a_module_print_what_they_show(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples_of(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (printed above)"
