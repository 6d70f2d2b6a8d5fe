"""Run metrics: TensorBoard (tensorboardX), ``metrics.jsonl`` and a console progress bar.

Names follow RAGEN (``train/<tag>/success``, ``val-env/<tag>/success``, ``actor/*``,
``critic/*``, ``rollout/*``, ``timing_s/*``). Only process 0 writes. A resumed run appends to
the same files; ``metrics.jsonl`` lines carry the step, so readers keep the last line per step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


class MetricsLogger:
    """Writes one dict of scalars per step to TensorBoard and JSONL; shows progress."""

    def __init__(self, out_dir: str | os.PathLike, *, total_steps: int, start_step: int = 0,
                 enabled: bool = True, progress: bool = True):
        self.enabled = enabled
        self.out = Path(out_dir)
        self.writer = None
        self.progress = None
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        self.out.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.out / "tb"))
        self.jsonl = open(self.out / "metrics.jsonl", "a", encoding="utf-8")
        if progress:
            self.progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn())
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               info="")
            self.progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: f for k, v in metrics.items() if (f := _scalar(v)) is not None}
        for k, v in clean.items():
            if math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        self.writer.flush()

    def advance(self, step: int, info: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
            self.jsonl.close()


def read_jsonl(path: str | os.PathLike) -> dict[int, dict[str, float]]:
    """``{step: metrics}`` from a ``metrics.jsonl`` (later lines of a step win, merged)."""
    out: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(int(rec.pop("step")), {}).update(rec)
    return out
