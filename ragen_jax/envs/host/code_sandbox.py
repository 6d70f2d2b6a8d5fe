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
  other processes, and no file owner that the kernel would signal for it (``fcntl``'s
  ``F_SETOWN``, ``F_SETOWN_EX``, ``F_SETSIG``; the ``FIOSETOWN`` and ``SIOCSPGRP`` ioctls),
  no ptrace, mounts, namespaces, BPF, module loading or uid changes;
- **Landlock's signal scope** (ABI 6, Linux >= 6.12) behind seccomp: no signal, by any route,
  reaches a process outside the program's own domain; an older kernel is said once in the log;
- **a folder quota**: its directory is a tmpfs of its own (``folder_mb`` bytes,
  ``folder_files`` files, in a user and mount namespace: ENOSPC past either), gone when it
  exits. Where user namespaces are not allowed (said once in the log) the parent watches the
  directory every ``WATCH_S`` seconds and stops the program past either bound (so it may
  overshoot by what it writes in that time).

The parent gives the child only the tests' inputs; it keeps the expected outputs and judges
each test itself, so a program that forges result lines gains nothing it did not compute. A
test's result reaches the parent as soon as the test ends: a program that times out keeps
the tests it passed before. The parent stops the program (SIGKILL to its process group) at
its wall-clock limit or when it writes more than ``output_limit`` bytes to its real stdout;
inside, each test's captured output is capped too, and the CPU-time limit stops a busy loop
even where wall-clock time is generous. The directory is removed whatever the program left
in it (unreadable folders included); one a killed caller left behind is removed by the next
caller on the machine.

``require_confinement()`` says in one line what is missing on a machine without Landlock or
seccomp; ``SandboxLimits(confine=False)`` runs with the resource limits only (no file or
network isolation) and is an explicit, documented choice for such machines.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import re
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
PREFIX = "ragen_sandbox_"  # + the caller's pid + "_": a folder whose caller died is stale
WATCH_S = 0.02  # how often the parent measures the folder where the kernel cannot bound it
# The child's own tmpfs as its folder where the kernel allows it; False: the parent watches a
# folder on the real disk (the fallback on kernels without user namespaces; tests use it).
PRIVATE_FOLDER = True
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. ``time_limit`` (seconds of wall clock for all its tests; the
    CPU limit is the same, rounded up) is RAGEN's 3 s by default."""

    time_limit: float = 3.0
    memory_mb: int = 512  # address space
    output_limit: int = 1 << 20  # bytes: captured per test, and written to the real stdout
    file_size_mb: int = 8  # the largest file it may write in its directory
    folder_mb: int = 32  # everything in its directory together
    folder_files: int = 256  # files and folders in its directory
    open_files: int = 64
    confine: bool = True  # Landlock + seccomp; False: resource limits only

    def __post_init__(self):
        for field in ("time_limit", "memory_mb", "output_limit", "file_size_mb", "folder_mb",
                      "folder_files", "open_files"):
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


def _parse_setup(data: bytes) -> dict[str, Any] | None:
    """The child's first line (how it is confined), once it has arrived; {} when the first
    line is something else."""
    if b"\n" not in data:
        return None
    try:
        setup = json.loads(data.split(b"\n", 1)[0])["setup"]
    except (ValueError, TypeError, KeyError):
        return {}
    return setup if isinstance(setup, dict) else {}


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
    ``"output limit"``, ``"folder limit"``, ``"exit status N"``, ``"killed by SIGNAME"``) or None.
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
           "folder": [limits.folder_mb, limits.folder_files, PRIVATE_FOLDER],
           "tests": [dict(t, i=i) for i, t in enumerate(tests)]}
    _remove_stale_folders()
    workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_")
    try:
        Path(workdir, "job.json").write_text(json.dumps(job), encoding="utf-8")
        return _run_child(workdir, len(tests), limits)
    finally:
        remove_folder(workdir)


def remove_folder(path: str) -> None:
    """Removes ``path`` whatever a program did to it: folders it made unreadable or
    unwritable are opened up first (a non-root caller could not delete inside them)."""
    def reopen(_func, failed, _exc):
        for target in {os.path.dirname(failed), failed}:
            try:
                os.chmod(target, 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
        try:
            if os.path.isdir(failed) and not os.path.islink(failed):
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=reopen)
    else:
        shutil.rmtree(path, onerror=reopen)


@functools.cache
def _remove_stale_folders() -> None:
    """Once per process: folders whose caller was killed before it could remove them."""
    pattern = re.compile(re.escape(PREFIX) + r"(\d+)_")
    for entry in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        m = pattern.match(entry.name)
        if m is None or int(m[1]) == os.getpid():
            continue
        try:
            os.kill(int(m[1]), 0)
        except ProcessLookupError:  # its caller is gone
            remove_folder(str(entry))
        except OSError:  # alive (another user's): not ours to touch
            pass


def folder_usage(path: str, stop_after: int) -> tuple[int, int]:
    """(bytes, entries) under ``path``, counting stopped once past ``stop_after`` entries (a
    program that makes folders without end cannot make the count itself slow)."""
    size = count = 0
    stack = [path]
    while stack and count <= stop_after:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    count += 1
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            size += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        pass
                    if count > stop_after:
                        break
        except OSError:
            pass
    return size, count


_said: set[str] = set()
# How the last program was confined, as its child said ({"folder": "tmpfs" or why not,
# "signals": "landlock" or why not}): what this machine's kernel gives the sandbox.
last_setup: dict[str, Any] = {}


def _say_setup(setup: dict[str, Any]) -> None:
    """What this machine's kernel could not give the sandbox, said once per process."""
    notes = {"folder": "the sandbox's folder quota is watched from outside, not enforced by "
                       "the kernel",
             "signals": "the sandbox's signals are confined by seccomp alone, without "
                        "Landlock's signal scope"}
    for key, note in notes.items():
        value = str(setup.get(key, ""))
        if value not in ("tmpfs", "landlock", "not confined") and note not in _said:
            _said.add(note)
            log.warning("%s (%s)", note, value or "no report")


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
    setup = None
    # Until the child says its folder is a tmpfs of its own, the parent measures it.
    watch = True
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
            if watch:
                size, files = folder_usage(workdir, limits.folder_files)
                if size > limits.folder_mb << 20 or files > limits.folder_files:
                    stopped = "folder limit"
                    break
            for key, _ in selector.select(timeout=min(left, WATCH_S) if watch else left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.data == "results":
                    got_results += chunk
                    if setup is None and (setup := _parse_setup(bytes(got_results))) is not None:
                        _say_setup(setup)
                        last_setup.clear()
                        last_setup.update(setup)
                        watch = setup.get("folder") != "tmpfs"
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

