"""A Weights & Biases run: the metrics as W&B charts."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from trainrun import extras
from trainrun.reporting.table import Table


class WandbWriter:
    """A Weights & Biases run; ``mode="offline"`` writes it under the run dir with no network
    (``wandb sync <run dir>/wandb/offline-run-*`` uploads it later). A resumed run logs to the
    same W&B run (its id is kept in ``<run dir>/wandb-id``).

    ``wandb.log`` costs many fast steps a call, so train rows go to W&B at log points
    only (every ``every`` steps and the last); eval and timing rows all go.
    """

    def __init__(self, run_dir: Path, config: dict[str, Any], name: str,
                 mode: Literal["offline", "online"],
                 project: str, every: int = 1, total_steps: int = 0):
        extras.require("wandb", f"metrics.wandb={mode}")
        import wandb

        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow",
                              dir=str(run_dir), mode=mode, config=config,
                              settings=wandb.Settings(console="off", silent=True))
        self.every, self.total = every, total_steps

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        if split == "train" and step % self.every and step != self.total:
            return
        self.run.log({f"{split}/{name}": value for name, value in metrics.items()}, step=step)

    def write_table(self, table: Table, split: str = "train") -> None:
        for step, metrics in table.rows():
            self.write(step, metrics, split)

    def flush(self) -> None:
        """W&B sends and saves rows on its own schedule."""

    def close(self) -> None:
        self.run.finish()
