"""The code in the docs runs as written."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import synthetic, tiny_client, trainer

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file, in order."""
    return python_blocks_of(path.read_text())


def python_blocks_of(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_engine_guide_algorithm_runs_and_keeps_its_invariant(tmp_path, monkeypatch):
    definition, usage, check = [block for block in python_blocks(DOCS / "engine.md") if "FedDyn" in block]
    namespace: dict = {}
    exec(compile(definition, "docs/engine.md", "exec"), namespace)
    FedDyn = namespace["FedDyn"]
    module = FedDyn(tiny_client(hidden=(8,)), alpha=0.1, clients_per_round=3, local_steps=3)
    dm = synthetic(6)
    t = trainer(4)
    before = t.validate(module, dm, verbose=False)[0]["val_acc"]
    t.fit(module, dm)
    assert t.validate(module, dm, verbose=False)[0]["val_acc"] > before
    # h accumulates alpha/N of every client's drift, the clients' linear terms alpha of their own
    linear = sum(module.engine.store.get(c, "linear") for c in module.engine.store.clients())
    assert module.h.norm() > 0 and torch.allclose(module.h, linear / 6, atol=1e-6)
    monkeypatch.chdir(tmp_path)  # the usage example writes lightning_logs/ where it runs
    exec(compile(usage, "docs/engine.md", "exec"), namespace)
    exec(compile(check, "docs/engine.md", "exec"), namespace)  # check_algorithm(FedDyn): every check passes


def test_the_engine_guide_client_round_runs():
    (block,) = [block for block in python_blocks(DOCS / "engine.md") if "run_client(" in block]
    namespace: dict = {}
    exec(compile(block, "docs/engine.md", "exec"), namespace)
    result = namespace["result"]
    assert sorted(result.uploads) == ["control", "delta"] and result.metrics["steps"] == 10


def test_the_partitioners_guide_runs():
    blocks = python_blocks(DOCS / "partitioners.md")
    namespace: dict = {}
    exec(compile(blocks[0], "docs/partitioners.md", "exec"), namespace)
    pytest.importorskip("datasets")
    exec(compile(blocks[1], "docs/partitioners.md", "exec"), namespace)
    pytest.importorskip("flwr_datasets")
    exec(compile(blocks[2], "docs/partitioners.md", "exec"), namespace)


def test_the_partitioners_guide_configs_parse(tmp_path, monkeypatch):
    from fl_lightning.cli import FederatedCLI

    quickstart = DOCS.parent / "configs" / "quickstart.yaml"
    monkeypatch.setattr(sys, "argv", ["fl-lightning"])
    parser = FederatedCLI(args=["--config", str(quickstart), "--trainer.logger", "false"], run=False).parser
    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "partitioners.md").read_text(), flags=re.S)
    assert len(blocks) == 3
    for i, block in enumerate(blocks):
        config = {**yaml.safe_load(quickstart.read_text()), **yaml.safe_load(block)}
        path = tmp_path / f"block{i}.yaml"
        path.write_text(yaml.safe_dump(config))
        assert parser.parse_args(["--config", str(path)]).data.init_args


def test_the_guides_regression_federates_through_the_cli(tmp_path, monkeypatch):
    """The dataset tutorial's regression.py and regression.yaml, written to a folder, run as it says
    (``PYTHONPATH=. fl-lightning fit --config regression.yaml``): the client's own validation and
    training metrics, FederatedEvaluation's per-client figures, and a partition.json that says what
    the targets are (``fl-lightning plot`` of such a run: tests/test_history.py)."""
    from fl_lightning.callbacks.history import read_history
    from fl_lightning.cli import main

    page = (DOCS / "tutorials" / "your_dataset.md").read_text()
    section = page.split("## Regression and other targets", 1)[1].split("\n## ", 1)[0]
    (tmp_path / "regression.py").write_text(python_blocks_of(section)[0])
    (tmp_path / "regression.yaml").write_text(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
    assert commands == ["PYTHONPATH=. fl-lightning fit --config regression.yaml", "fl-lightning plot runs/regression"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=.
    monkeypatch.setattr(sys, "argv", ["fl-lightning"])
    try:
        main(["fit", "--config", "regression.yaml", "--trainer.enable_progress_bar", "false"])
    finally:
        sys.modules.pop("regression", None)
    folder = tmp_path / "runs" / "regression" / "lightning_logs" / "version_0"
    last = read_history(folder)[-1]
    assert last["round"] == 3 and last["clients_val/num_clients"] == 10.0
    assert {"val/mse", "val/mae", "train/mse", "clients_val/mse_mean", "clients_val/mae_worst"} <= set(last)
    assert json.loads((folder / "partition.json").read_text())["targets"]["kind"] == "numbers"
