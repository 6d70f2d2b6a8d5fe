"""Progress of a run's long phases (building the warm-start prior, SFT, validation): what
runs, how far it is and about how long it has left, so a first run never sits silent.

On a terminal a phase is a task of the run's rich progress display (``MetricsLogger``'s),
shown above the training bar and removed when it ends. Elsewhere (a log file, a pipe) it
prints a few plain lines instead: one when it starts and one at each fifth of the way, each
with the time so far and the time left, which a redrawn bar cannot give a log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

MILESTONES = 5  # plain-line mode: a line at each fifth of the phase


def format_seconds(seconds: float) -> str:
    """``seconds`` as ``1h02m``, ``3m05s`` or ``12s``."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Phase:
    """One long phase of ``total`` units (``None``: unknown, e.g. a validation's turns).

    ``update(done, info)`` after each unit; ``close()`` at the end (also as a context
    manager). The first unit is timed apart: it usually compiles, so the time left is
    estimated from the units after it.
    """

    def __init__(self, what: str, total: int | None, *, progress: Any = None,
                 print_fn: Callable[[str], None] = print, start_note: str = ""):
        self.what, self.total, self.print_fn = what, total, print_fn
        self.started = time.perf_counter()
        self.first_done: float | None = None  # when the first (compiling) unit finished
        self.done = 0
        self.next_milestone = 1
        self.progress = progress if progress is not None and progress.console.is_terminal else None
        self.task = None
        if self.progress is not None:
            self.task = self.progress.add_task(what, total=total, info=start_note)
        else:
            self.print_fn(f"{what}: {start_note}" if start_note else f"{what} ...")

    def eta(self) -> float | None:
        """Seconds left, from the rate of the units after the first; None before two."""
        if self.total is None or self.first_done is None or self.done < 2:
            return None
        rate = (time.perf_counter() - self.first_done) / (self.done - 1)
        return rate * (self.total - self.done)

    def update(self, done: int, info: str = "") -> None:
        """``done`` units of ``total`` are finished; ``info`` (e.g. the loss) is shown."""
        self.done = done
        if self.first_done is None and done >= 1:
            self.first_done = time.perf_counter()
        if self.progress is not None:
            self.progress.update(self.task, completed=done, info=info)
            return
        if not self.total:
            return
        if done * MILESTONES >= self.next_milestone * self.total:
            self.next_milestone = done * MILESTONES // self.total + 1
            elapsed = format_seconds(time.perf_counter() - self.started)
            left = self.eta()
            eta = f", ~{format_seconds(left)} left" if left is not None and done < self.total else ""
            self.print_fn(f"{self.what}: {done}/{self.total}" + (f", {info}" if info else "")
                          + f" ({elapsed}{eta})")

    def close(self) -> None:
        """Removes the phase's task from the display (plain lines need no ending)."""
        if self.progress is not None and self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
