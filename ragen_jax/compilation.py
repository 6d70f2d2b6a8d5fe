"""XLA compilation: how much a run compiled, and the persistent cache that makes a repeated
run's compiles file reads.

**Counting.** From ``jax.monitoring``'s backend-compile events: a run reports
``compile/count`` and ``compile/seconds`` per step, so a program that compiles again (a new
shape, a new static argument) shows where it happened instead of hiding in a slow step.

Every event JAX records for a backend compile counts, whether XLA compiled the program or the
persistent compilation cache gave it back (``compile/cache_hits`` counts those): a program
whose shapes the run has not fixed still costs a lookup and an executable's load each time.
Compiles of JAX's own small eager ops count too; after a run's first steps there are none.

**The persistent cache** (``enable_persistent_cache``, called by every run and evaluation):
JAX's compilation cache in ``$RAGEN_JAX_CACHE/xla`` (default ``~/.cache/ragen_jax/xla``),
bounded to ``RAGEN_JAX_XLA_CACHE_GB`` GiB (default 4; least recently used entries go first).
The size bound also turns on the cache's file locking, so several processes (a multi-process
job on one host, two runs at once, the test suite's workers) read and write it safely; an
entry is keyed by the program, its compile options, the devices, the XLA flags and the
jax/XLA version, so a stale entry is never used. On by default on every backend;
``RAGEN_JAX_XLA_CACHE=0`` turns it off.

**Memory mappings.** XLA:CPU keeps each compiled program's machine code in its own small
memory mappings (about six per program) for as long as JAX keeps the program, and the kernel
caps a process's mappings (``vm.max_map_count``, 65,530 by default). A run compiles a few
hundred programs; a process that compiles many thousands without letting them go (a long
notebook session, the test suite's workers) reaches the cap, and its next compile, load or
cache write fails ("LLVM compilation error: Cannot allocate memory") and crashes the process
with a segmentation fault or an abort. ``jax.clear_caches()`` unmaps them
(``docs/troubleshooting.md``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from pathlib import Path

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class _Tally:
    count: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    names: collections.Counter = dataclasses.field(default_factory=collections.Counter)


_tally = _Tally()
_lock = threading.Lock()
_registered = False


def _on_duration(event: str, duration: float, **kw) -> None:
    if event == BACKEND_COMPILE:
        with _lock:
            _tally.count += 1
            _tally.seconds += float(duration)
            _tally.names[str(kw.get("fun_name", "?"))] += 1


def _on_event(event: str, **kw) -> None:
    if event == CACHE_HIT:
        with _lock:
            _tally.cache_hits += 1


def listen() -> None:
    """Starts counting (once per process; later calls do nothing)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


class CompileWatch:
    """Compiles since the last ``take()``: ``take()`` returns them as metrics and starts a
    new interval. ``names`` of the last interval say which programs compiled."""

    def __init__(self):
        listen()
        self._start = self._last = self._now()
        self.names: dict[str, int] = {}

    @staticmethod
    def _now() -> _Tally:
        with _lock:
            return _Tally(_tally.count, _tally.seconds, _tally.cache_hits,
                          collections.Counter(_tally.names))

    @staticmethod
    def _since(then: _Tally, now: _Tally) -> dict[str, float]:
        return {"compile/count": float(now.count - then.count),
                "compile/seconds": now.seconds - then.seconds,
                "compile/cache_hits": float(now.cache_hits - then.cache_hits)}

    def take(self) -> dict[str, float]:
        now = self._now()
        last, self._last = self._last, now
        self.names = dict(now.names - last.names)
        return self._since(last, now)

    def totals(self) -> dict[str, float]:
        """Everything since this watch was made."""
        return self._since(self._start, self._now())


def progress_note(metrics: dict[str, float]) -> str:
    """The progress line's note for a step that compiled ("" when none did)."""
    count = int(metrics.get("compile/count", 0))
    if not count:
        return ""
    return f"compiled {count} program{'s' if count > 1 else ''} ({metrics['compile/seconds']:.1f}s)"


def cache_dir() -> Path | None:
    """Where the persistent compilation cache lives, or None when it is off
    (``RAGEN_JAX_XLA_CACHE=0``)."""
    setting = os.environ.get("RAGEN_JAX_XLA_CACHE", "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return None
    root = os.environ.get("RAGEN_JAX_CACHE") or Path.home() / ".cache" / "ragen_jax"
    return Path(root) / "xla"


def enable_persistent_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache (see the module docstring) unless it is
    off or the process already set one (``jax_compilation_cache_dir``: a user's, the test
    suite's); returns the folder in use, or None."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    folder = cache_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: compile as before
        return None
    size_gb = float(os.environ.get("RAGEN_JAX_XLA_CACHE_GB", "4"))
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", int(size_gb * (1 << 30)))
    # Programs that compile faster than this are not worth a file (jax's default: 1 s).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder
