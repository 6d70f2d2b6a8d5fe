"""What every experiment script shares: the repository's paths, best-of-n timing, printing and
writing a Markdown report, and child Python processes that import this checkout.

Scripts run from the repository root as modules (``python -m experiments.benchmarks.bench_envs``),
so ``ragen_jax``, ``configs`` and ``experiments`` import from the checkout without editing
``sys.path``; a child process gets the same through ``PYTHONPATH`` (``child_env``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Best wall seconds of ``repeats`` calls of ``fn`` (which blocks on its result)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def report(lines: list[str], out: str | None) -> None:
    """Prints a Markdown report and, when ``out`` names a file, writes it there too."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)


def child_env(root: Path = ROOT, **extra: str) -> dict[str, str]:
    """This process's environment with ``root`` first on ``PYTHONPATH`` (a child imports that
    tree's ``ragen_jax`` and ``experiments``, not an installed copy), plus ``extra``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(root) + (os.pathsep + path if path else ""), **extra}


def subprocess_results(code: str, env: dict[str, str], timeout: float) -> tuple[list[dict], str | None]:
    """Runs ``code`` in a fresh Python (its own ``XLA_FLAGS``/device count) and returns the
    JSON of its ``RESULT {...}`` stdout lines, plus a one-line note of its exit status and
    stderr tail when it failed (the results printed before the failure are kept)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    error = None if proc.returncode == 0 else (
        f"(subprocess exited {proc.returncode}: {proc.stderr[-500:]!r})")
    return results, error
