"""Run metrics: one dict of scalars per training step, fanned out to metrics sinks, plus a
console progress bar.

Names follow RAGEN (``train/<tag>/success``, ``val-env/<tag>/success``, ``actor/*``,
``critic/*``, ``rollout/*``, ``timing_s/*``; on accelerators ``perf/*`` memory, as veRL).

Sinks (``trainer.logger``, a list of names, as in RAGEN's ``trainer.logger=['console','wandb']``):

* ``tensorboard``: TensorBoard event files under ``<out_dir>/tb`` (tensorboardX); non-finite
  values are skipped there.
* ``jsonl``: ``<out_dir>/metrics.jsonl``, one line ``{"step": s, ...}`` per ``log`` call, flushed
  each call. A resumed run appends after dropping the rows of the steps it plays again (every
  step after the checkpoint it resumes from: ``MetricsLogger.rewind``), so each step has one
  row; :func:`read_jsonl` keeps the last value per step and key all the same.
* ``wandb``: Weights & Biases, an optional dependency (``pip install 'ragen_jax[wandb]'``).
  The usual ``WANDB_*`` environment variables apply: ``WANDB_MODE=offline`` needs no network
  or account (``wandb sync`` uploads later), otherwise log in or set ``WANDB_API_KEY``. The
  run's files go under ``<out_dir>/wandb``; its id is kept in ``<out_dir>/wandb_run_id`` so
  that a resumed run (same output folder) continues the same W&B run. W&B ignores steps below
  the last one it saw, so steps logged after the checkpoint a run resumes from keep their
  first values there (``metrics.jsonl`` has both).
* ``console``: accepted and does nothing: the console progress bar (``trainer.progress``) and
  the trainer's printed lines are always there.

``None`` for the sinks means ``tensorboard`` + ``jsonl``. Only process 0 of a multi-host job
logs (``enabled=False`` elsewhere: nothing is written or created).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ragen_jax.progress import Phase

SINKS = ("tensorboard", "jsonl", "wandb")
NO_OP_SINKS = ("console",)
WANDB_MISSING = ("trainer.logger includes 'wandb' but wandb is not installed: "
                 "pip install 'ragen_jax[wandb]'")
WANDB_RUN_ID_FILE = "wandb_run_id"


class WandbMissingError(ImportError, ValueError):
    """``trainer.logger`` names ``wandb`` but it is not installed (an ``ImportError`` that is
    also a ``ValueError``, so config validation that catches either reports it)."""


@runtime_checkable
class MetricsSink(Protocol):
    """Where a step's scalars go. ``metrics`` holds plain floats (maybe NaN or inf)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """TensorBoard event files under ``<out_dir>/tb``; non-finite values are skipped."""

    def __init__(self, out_dir: str | os.PathLike):
        from tensorboardX import SummaryWriter

        self.dir = Path(out_dir) / "tb"
        self.dir.mkdir(parents=True, exist_ok=True)
        # tensorboardX names files by the second and opens them "wb": a unique suffix keeps a
        # run resumed within the same second from overwriting the previous file.
        self.writer = SummaryWriter(str(self.dir), filename_suffix=f".{time.time_ns()}")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            if math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class JsonlSink:
    """Appends ``{"step": s, ...}`` lines to ``<out_dir>/metrics.jsonl``, flushed each call."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        rec = {"step": int(step), **{k: v for k, v in metrics.items() if k != "step"}}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def rewind(self, step: int) -> None:
        """Drops every row of a step after ``step`` (and any line that is not a JSON row: the
        cut-off last line of a killed process), rewriting the file atomically, then appends
        after the rows kept."""
        self.file.close()
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, TypeError, KeyError):
                continue
            if row_step <= step:
                kept.append(line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(self.path)
        self.file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise WandbMissingError(WANDB_MISSING) from None
    return wandb


def _new_run_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbSink:
    """A Weights & Biases run kept in ``<out_dir>/wandb``, resumed by the id stored in
    ``<out_dir>/wandb_run_id``; logs with ``step=`` the training step. Honours ``WANDB_MODE``
    (``offline``, ``disabled``) and the other ``WANDB_*`` variables."""

    def __init__(self, out_dir: str | os.PathLike, *, project: str, name: str,
                 config: Mapping[str, Any] | None = None):
        wandb = _import_wandb()
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        id_file = self.out / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = _new_run_id()
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(run_id + "\n")
            tmp.replace(id_file)
        self.run_id = run_id
        cfg = json.loads(json.dumps(dict(config or {}), default=str))  # Paths, tuples... -> JSON
        self.run = wandb.init(project=project, name=name, config=cfg, dir=str(self.out),
                              id=run_id, resume="allow")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def make_sinks(names: Sequence[str], out_dir: str | os.PathLike, *, project: str, name: str,
               config: Mapping[str, Any]) -> list[MetricsSink]:
    """The sinks named in ``trainer.logger`` (order kept, duplicates and ``console`` dropped).

    Raises ``ValueError`` for an unknown name and :class:`WandbMissingError` when ``wandb``
    is named but not installed, both before anything is created.
    """
    if isinstance(names, str):
        names = [names]
    wanted: list[str] = []
    for n in names:
        if n not in SINKS and n not in NO_OP_SINKS:
            raise ValueError(f"trainer.logger: unknown sink {n!r}; choose from {', '.join(SINKS)}")
        if n in SINKS and n not in wanted:
            wanted.append(n)
    if "wandb" in wanted:
        _import_wandb()
    sinks: list[MetricsSink] = []
    try:
        for n in wanted:
            if n == "tensorboard":
                sinks.append(TensorBoardSink(out_dir))
            elif n == "jsonl":
                sinks.append(JsonlSink(out_dir))
            else:
                sinks.append(WandbSink(out_dir, project=project, name=name, config=config))
    except BaseException:
        for s in sinks:
            s.close()
        raise
    return sinks


def _scalar(v: Any) -> float | None:
    """``float(v)`` for numbers, bools and 0-d arrays; ``None`` for anything else."""
    if isinstance(v, (str, bytes)) or getattr(v, "ndim", 0) != 0:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class MetricsLogger:
    """Fans each step's scalars out to the sinks and shows a progress bar.

    ``sinks=None`` means TensorBoard + JSONL under ``out_dir``. With ``enabled=False``
    (processes other than 0) nothing is written or created, ``print`` is silent and given sinks
    are never touched (build them on process 0 only). The logger closes its sinks in
    :meth:`close`.
    """

    def __init__(self, out_dir: str | os.PathLike, *, sinks: Sequence[MetricsSink] | None = None,
                 total_steps: int, start_step: int = 0, enabled: bool = True,
                 progress: bool = True):
        self.enabled = enabled
        self.out = Path(out_dir)
        self.sinks: list[MetricsSink] = []
        self.progress = None
        if not enabled:
            return
        self.sinks = list(sinks) if sinks is not None else [TensorBoardSink(self.out),
                                                           JsonlSink(self.out)]
        if progress:
            # One display for the training bar and the long phases' bars (``phase``): rich
            # draws a single live display at a time.
            self.progress = Progress(TextColumn("[bold]{task.description}"), MofNCompleteColumn(),
                                     BarColumn(), TextColumn("{task.fields[info]}"),
                                     TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.progress.add_task("step", total=total_steps, completed=start_step,
                                               info="")
            self.progress.start()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: f for k, v in metrics.items() if (f := _scalar(v)) is not None}
        for sink in self.sinks:
            sink.log(step, clean)

    def rewind(self, step: int) -> None:
        """Forgets the rows an earlier process of this run logged for steps after ``step``:
        a run resumed from the checkpoint of ``step`` (-1: started afresh) plays those steps
        again and logs them anew. Sinks without a ``rewind`` (TensorBoard, W&B) keep theirs."""
        if not self.enabled:
            return
        for sink in self.sinks:
            rewind = getattr(sink, "rewind", None)
            if rewind is not None:
                rewind(step)

    def advance(self, step: int, info: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)

    def phase(self, what: str, total: int | None, start_note: str = "", *,
              lines: bool = True) -> Phase:
        """A long phase's progress (``progress.Phase``): a bar above the training bar on a
        terminal, else a few plain lines (none with ``lines=False``); silent where this
        logger is disabled."""
        loud = self.enabled and lines  # (a terminal's bar does not print lines)
        return Phase(what, total, progress=self.progress,
                     print_fn=self.print if loud else lambda _text: None, start_note=start_note)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            # Unwrapped: a log file's lines stay whole (rich wraps at 80 columns off a terminal).
            self.progress.console.print(text, soft_wrap=True, markup=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        sinks, self.sinks = self.sinks, []
        errors = []
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:  # close the others anyway
                errors.append(e)
        if errors:
            raise errors[0]


def device_memory(devices: Sequence[Any] | None = None) -> dict[str, float]:
    """Accelerator memory as veRL logs it (``perf/max_memory_allocated_gib``: the largest peak
    over this process's devices since start; ``perf/memory_in_use_gib`` now;
    ``perf/memory_limit_gib``). Empty where the backend keeps no statistics (XLA:CPU)."""
    if devices is None:
        import jax
        devices = jax.local_devices()
    stats = [s for s in (d.memory_stats() for d in devices) if s]
    if not stats:
        return {}
    gib = 1024.0 ** 3
    out = {"perf/max_memory_allocated_gib": max(s.get("peak_bytes_in_use", 0) for s in stats) / gib,
           "perf/memory_in_use_gib": max(s.get("bytes_in_use", 0) for s in stats) / gib}
    if all("bytes_limit" in s for s in stats):
        out["perf/memory_limit_gib"] = min(s["bytes_limit"] for s in stats) / gib
    return out


def read_jsonl(path: str | os.PathLike) -> dict[int, dict[str, float]]:
    """``{step: metrics}`` from a ``metrics.jsonl`` (later lines of a step win, merged)."""
    out: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(int(rec.pop("step")), {}).update(rec)
    return out
