"""Runs untrusted Python programs (model-written code) against tests, confined.

Each program gets a fresh process (``python -I -S -B``: no site-packages, no environment
variables, no current directory on the import path) in a fresh temporary directory, started
with an empty environment, in its own session (``posix_spawn``: no Python runs between fork
and exec, safe beside JAX's threads). Before the program's text is even compiled the child
confines itself for good (``sandbox_child.py``):

- a uid of its own: a root caller's child becomes an unused uid (``UNUSED_UID_BASE`` + its
  pid), so that root's files are not its own, where every folder the interpreter imports
  from is readable by any user; an interpreter under a private home (``/root``, mode 0700)
  keeps root's uid, said once in the log, and relies on the rules below;
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
  no ptrace, mounts, namespaces, BPF, module loading or uid changes; no change to any file's
  mode, owner, times, extended attributes or inode flags, and no leases (Landlock does not
  govern metadata, so these are refused everywhere, its own folder included); no System V
  IPC, POSIX message queues or memfds (what would outlive it, or hold RAM its address-space
  limit does not count) and no inotify or fanotify watches (which would reveal other
  folders' activity);
- **an IPC namespace** of its own, behind seccomp: whatever IPC object it could make dies
  with it;
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
the tests it passed before. The parent reads one setup line and then one line per test, in
order, each at most ``sandbox_child.line_bytes(output_limit)`` bytes, and nothing more: a
line that is not the next test's well-formed result stops the program (``"results
tampered"``), and every way a program can end (any signal, any exit status, any bytes on any
descriptor) is the program's failure, never an error of the caller. A child that fails before
any program has run (its setup line never came) is the sandbox's own failure and raises. The parent stops the program (SIGKILL to its process group) at
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

from ragen_jax.envs.host.sandbox_child import line_bytes

CHILD = Path(__file__).with_name("sandbox_child.py")
INTERPRETER = sys.executable  # what runs the child (and so the programs)
UNCONFINED = "--unconfined"  # the child's flag for resource limits only
PREFIX = "ragen_sandbox_"  # + the caller's pid + "_": a folder whose caller died is stale
HEAD_BYTES = 4096  # the child's first output kept, to say why it failed before the program ran
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


class _Results:
    """The child's results descriptor, read as it arrives: its setup line, then one line per
    test in test order, each at most ``line_limit`` bytes (what ``sandbox_child.fit_line``
    writes). Whatever else a program writes there ends the reading: ``problem`` says what,
    and the tests not yet reported are not run. Bytes after the last test are ignored."""

    def __init__(self, count: int, line_limit: int):
        self.count, self.line_limit = count, line_limit
        self.setup: dict[str, Any] | None = None
        self.runs: list[TestRun] = []
        self.problem: str | None = None
        self._pending = bytearray()

    @property
    def closed(self) -> bool:
        """Nothing more is read: the last test's line came, or the channel was misused."""
        return self.problem is not None or (self.setup is not None and len(self.runs) == self.count)

    def feed(self, chunk: bytes) -> None:
        if self.closed:
            return
        start = len(self._pending)
        self._pending += chunk
        while not self.closed:
            end = self._pending.find(b"\n", start)
            if end < 0:
                if len(self._pending) > self.line_limit:
                    self.problem = "results tampered (a line past its length)"
                return
            line = bytes(self._pending[:end])
            del self._pending[:end + 1]
            start = 0
            if len(line) > self.line_limit:
                self.problem = "results tampered (a line past its length)"
            else:
                self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            row = None
        if self.setup is None:
            setup = row.get("setup") if isinstance(row, dict) else None
            self.setup = setup if isinstance(setup, dict) else {}
            return
        if not (isinstance(row, dict) and row.get("i") == len(self.runs)
                and isinstance(row.get("ok"), bool) and isinstance(row.get("out"), str)
                and (row.get("err") is None or isinstance(row.get("err"), str))):
            self.problem = f"results tampered (test {len(self.runs)}'s line is not its result)"
            return
        self.runs.append(TestRun(row["ok"], row["out"], row.get("json"), row.get("err")))


def _signal_name(number: int) -> str:
    """SIGKILL, SIGRTMIN+6, ...: any number a process can be killed by, named."""
    try:
        return signal.Signals(number).name
    except ValueError:
        if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
            return f"SIGRTMIN+{number - signal.SIGRTMIN}"
        return f"signal {number}"


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
    """What this machine could not give the sandbox, said once per process."""
    notes = {"folder": "the sandbox's folder quota is watched from outside, not enforced by "
                       "the kernel",
             "signals": "the sandbox's signals are confined by seccomp alone, without "
                        "Landlock's signal scope",
             "ipc": "the sandbox's System V IPC is refused by seccomp alone, without an IPC "
                    "namespace of its own",
             "uid": "the sandbox's programs keep the caller's uid (root's files stay their "
                    "own; seccomp refuses changes to any file's metadata)"}
    fine = {"folder": ("tmpfs",), "signals": ("landlock", "not confined"), "ipc": ("own namespace",)}
    for key, note in notes.items():
        value = str(setup.get(key, ""))
        ok = value.isdigit() if key == "uid" else value in fine[key]
        if not ok and note not in _said:
            _said.add(note)
            log.warning("%s (%s)", note, value or "no report")


def _run_child(workdir: str, count: int, limits: SandboxLimits):
    results_r, results_w = os.pipe()
    argv = [INTERPRETER, "-I", "-S", "-B", str(CHILD)]
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
    results = _Results(count, line_bytes(limits.output_limit))
    stdout_bytes = after_results = 0
    head = bytearray()  # the child's first output: its traceback if it failed before the program
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
                    if results.closed:  # past the last test: drained, not kept
                        after_results += len(chunk)
                        if after_results > results.line_limit:
                            stopped = "output limit"
                        continue
                    had_setup = results.setup is not None
                    results.feed(chunk)
                    if not had_setup and results.setup is not None:
                        _say_setup(results.setup)
                        last_setup.clear()
                        last_setup.update(results.setup)
                        watch = results.setup.get("folder") != "tmpfs"
                    if results.problem:  # never clears a stop already set
                        stopped = results.problem
                else:
                    if stdout_bytes < HEAD_BYTES:
                        head += chunk[:HEAD_BYTES - stdout_bytes]
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
    if results.setup is None and stopped is None:
        # No program has run before the setup line: this is the sandbox failing, not an answer.
        tail = head.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the code sandbox's child failed before any program ran (status "
                           f"{status}): {tail[0][:300]}")
    if stopped is None and status != 0:
        stopped = (f"killed by {_signal_name(-status)}" if status < 0
                   else f"exit status {status}")
        if status == -signal.SIGXCPU:  # the CPU-time limit
            stopped = "time limit"
    runs = results.runs
    return runs + [TestRun(False, error=f"not run ({stopped or 'no result'})")
                   for _ in range(count - len(runs))], stopped
