"""Which way a metric improves, told by the words of its name (``val/mse``: lower is better), for
summaries that pick a best or a worst value when nothing else says it."""

from __future__ import annotations

import re
from typing import Optional

#: words of a metric's name that tell its direction
HIGHER_IS_BETTER_WORDS = frozenset({"acc", "accuracy", "f1", "auc", "auroc", "precision", "recall", "iou", "dice",
                                    "r2"})
LOWER_IS_BETTER_WORDS = frozenset({"loss", "mse", "mae", "rmse", "error", "err", "perplexity", "nll"})


def direction_from_name(name: str) -> Optional[bool]:
    """The direction the words of ``name`` tell (``top1_acc``: higher is better; ``val/mse``:
    lower), or None when no word is known or the words disagree.

    >>> direction_from_name("val/acc"), direction_from_name("train/mse"), direction_from_name("lr")
    (True, False, None)
    """
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    higher, lower = bool(words & HIGHER_IS_BETTER_WORDS), bool(words & LOWER_IS_BETTER_WORDS)
    return higher if higher != lower else None
