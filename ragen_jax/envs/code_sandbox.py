"""Runs untrusted Python programs (model-written code) against tests, confined.

Each program gets a fresh process (``python -I -S -B``: no site-packages, no environment
variables, no current directory on the import path) in a fresh temporary directory, started
with an empty environment, in its own session (``posix_spawn``: no Python runs between fork
and exec, safe beside JAX's threads). Before the program's text is even compiled the child
confines itself for good (``sandbox_child.py``):

- resource limits (CPU seconds, address space, file size, open files, no core dumps) it can
  no longer raise, ``no_new_privs``, and no capabilities (a root caller's child drops them
  all, bounding set included: a root without powers);
- **Landlock** (Linux >= 5.13): it may read only the interpreter's standard library and the
  system's shared libraries, and read/write only its own directory; everything else
  (``/etc``, ``/proc``, home directories, the caller's files, other programs' directories)
  fails with ``PermissionError``, symbolic links included;
- **seccomp** (libseccomp through ``pyseccomp``): no sockets (so no network, not even
  loopback), no ``fork``/``vfork``/process-creating ``clone``, no ``execve``, no signals to
  other processes, no ptrace, mounts, namespaces, BPF, module loading or uid changes.

The parent gives the child only the tests' inputs; it keeps the expected outputs and judges
each test itself, so a program that forges result lines gains nothing it did not compute. A
test's result reaches the parent as soon as the test ends: a program that times out keeps
the tests it passed before. The parent stops the program (SIGKILL to its process group) at
its wall-clock limit or when it writes more than ``output_limit`` bytes to its real stdout;
inside, each test's captured output is capped too, and the CPU-time limit stops a busy loop
even where wall-clock time is generous.

``require_confinement()`` says in one line what is missing on a machine without Landlock or
seccomp; ``SandboxLimits(confine=False)`` runs with the resource limits only (no file or
network isolation) and is an explicit, documented choice for such machines.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("sandbox_child.py")
UNCONFINED = "--unconfined"  # the child's flag for resource limits only


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. ``time_limit`` (seconds of wall clock for all its tests; the
    CPU limit is the same, rounded up) is RAGEN's 3 s by default."""

    time_limit: float = 3.0
    memory_mb: int = 512  # address space
    output_limit: int = 1 << 20  # bytes: captured per test, and written to the real stdout
    file_size_mb: int = 8  # the largest file it may write in its directory
    open_files: int = 64
    confine: bool = True  # Landlock + seccomp; False: resource limits only

    def __post_init__(self):
        for field in ("time_limit", "memory_mb", "output_limit", "file_size_mb", "open_files"):
            if not getattr(self, field) > 0:
                raise ValueError(f"sandbox {field} must be > 0, got {getattr(self, field)!r}")


@dataclasses.dataclass(frozen=True)
class TestRun:
    """What one test produced: ``ran`` (finished without raising), its stdout or the return
    value's ``str`` (``output``), the value as JSON (``value``, function tests) and the error
    text (``error``; "not run" when the program was stopped before it)."""

    ran: bool
    output: str = ""
    value: Any = None
    error: str | None = None


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where ``landlock`` and ``pyseccomp`` live (the child imports them with ``-S``)."""
    dirs = []
    for name in ("landlock", "pyseccomp"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"the code sandbox needs the '{name}' package (pip install {name})")
        origin = Path(spec.origin)
        dirs.append(str(origin.parent.parent if origin.name == "__init__.py" else origin.parent))
    return tuple(dict.fromkeys(dirs))


@functools.cache
def confinement_problem() -> str | None:
    """Why Landlock + seccomp cannot confine programs on this machine, or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"the code sandbox's confinement needs Linux (Landlock, seccomp); this is {sys.platform}"
    try:
        _library_dirs()
        import landlock
        import pyseccomp  # noqa: F401 - loading it finds libseccomp
    except (RuntimeError, ImportError, OSError) as e:
        return f"the code sandbox's confinement is unavailable: {e}"
    try:
        abi = landlock.landlock_abi_version()
    except Exception as e:  # noqa: BLE001 - any failure means no Landlock
        return f"the kernel has no Landlock ({e}); it needs Linux >= 5.13 with Landlock enabled"
    if abi < 1:
        return "the kernel has no Landlock; it needs Linux >= 5.13 with Landlock enabled"
    return None


def require_confinement() -> None:
    """Raises a one-line error when programs cannot be confined here."""
    problem = confinement_problem()
    if problem:
        raise RuntimeError(problem + " (or run with sandbox confinement off: resource limits only, "
                                     "no file or network isolation: env.params.confine=False)")


def _parse_results(data: bytes, count: int) -> dict[int, TestRun]:
    """The first well-formed line for each test index; anything else is ignored."""
    runs: dict[int, TestRun] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
            i = row["i"]
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(i, int) and 0 <= i < count and i not in runs:
            runs[i] = TestRun(bool(row.get("ok")), str(row.get("out") or ""), row.get("json"),
                              None if row.get("err") is None else str(row.get("err")))
    return runs


def run_program(code: str, tests: list[dict[str, Any]], func_name: str | None = None,
                limits: SandboxLimits = SandboxLimits()) -> tuple[list[TestRun], str | None]:
    """Runs ``code`` once per test, confined, in one fresh process.

    ``tests``: ``{"kind": "stdin", "stdin": text}`` (the program runs as ``__main__`` reading
    that stdin) or ``{"kind": "function", "args": [...]}`` (``func_name`` is called with the
    JSON ``args``, on a ``Solution()`` instance when the program defines that class).
    Returns one ``TestRun`` per test and what stopped the program early (``"time limit"``,
    ``"output limit"``, ``"exit status N"``, ``"killed by SIGNAME"``) or None.
    """
    if limits.confine:
        require_confinement()
    job = {"code": code, "func_name": func_name, "out_cap": limits.output_limit,
           # [soft, hard]: the CPU soft limit's SIGXCPU (read as "time limit") comes a second
           # before the hard limit's SIGKILL; the others are equal.
           "rlimits": {"RLIMIT_CPU": [int(limits.time_limit) + 1, int(limits.time_limit) + 2],
                       "RLIMIT_AS": [limits.memory_mb << 20] * 2,
                       "RLIMIT_FSIZE": [limits.file_size_mb << 20] * 2,
                       "RLIMIT_NOFILE": [limits.open_files] * 2, "RLIMIT_CORE": [0, 0]},
           "tests": [dict(t, i=i) for i, t in enumerate(tests)]}
    workdir = tempfile.mkdtemp(prefix="ragen_sandbox_")
    try:
        Path(workdir, "job.json").write_text(json.dumps(job), encoding="utf-8")
        return _run_child(workdir, len(tests), limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_child(workdir: str, count: int, limits: SandboxLimits):
    results_r, results_w = os.pipe()
    argv = [sys.executable, "-I", "-S", "-B", str(CHILD)]
    argv += [str(results_w)] + (list(_library_dirs()) if limits.confine else [UNCONFINED])
    try:
        proc = subprocess.Popen(
            argv, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=(results_w,), start_new_session=True, close_fds=True)
    except BaseException:
        os.close(results_r)
        os.close(results_w)
        raise
    os.close(results_w)
    stopped = None
    got_results, stdout_bytes = bytearray(), 0
    deadline = time.monotonic() + limits.time_limit + 1.0  # + the interpreter's start-up
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
    selector.register(results_r, selectors.EVENT_READ, "results")
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "time limit"
                break
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.data == "results":
                    got_results += chunk
                    if len(got_results) > 4 * limits.output_limit * max(count, 1):
                        stopped = "output limit"
                else:
                    stdout_bytes += len(chunk)
                    if stdout_bytes > limits.output_limit:
                        stopped = "output limit"
            if stopped:
                break
    finally:
        selector.close()
        os.close(results_r)
        if stopped or proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdout.close()
        status = proc.wait()
    if stopped is None and status != 0:
        stopped = (f"killed by {signal.Signals(-status).name}" if status < 0
                   else f"exit status {status}")
        if status == -signal.SIGXCPU:  # the CPU-time limit
            stopped = "time limit"
    runs = _parse_results(bytes(got_results), count)
    return [runs.get(i, TestRun(False, error=f"not run ({stopped or 'no result'})"))
            for i in range(count)], stopped

