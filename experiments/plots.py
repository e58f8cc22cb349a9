"""Figures of the result documents: small PNGs (a 64-colour palette), drawn without a display."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from experiments.seed_stats import EXTRA

try:
    import matplotlib
except ModuleNotFoundError as missing:
    raise ModuleNotFoundError(f"the experiments' figures are drawn with matplotlib, which fl-lightning does not "
                              f"install: install {EXTRA}") from missing

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plt", "save"]


def save(fig: Any, path: str | Path, dpi: int = 90) -> None:
    """Write ``fig`` to ``path`` as a palette PNG and close it."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    image.save(path, optimize=True)
