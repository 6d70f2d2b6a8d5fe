"""One training process per run folder: an exclusive ``fcntl.flock`` on ``<run folder>/run.lock``.

Rerunning the same command resumes a run, so the same command started again while the first
still runs points two trainers at one folder, and they break each other: a starting run's
checkpoint store deletes the temporary folders of unfinished saves (orbax's clean-up of a
crashed save), which may be the live run's save in progress. The trainer takes this lock
before it writes or deletes anything in the folder and holds it until its training loop ends
(``Trainer.train``) or the process dies; a second start is refused in one line naming the
holder's pid, host, start time and command.

``flock`` belongs to the open file, so the kernel drops the lock when the holding process
dies, however it dies (``kill -9`` included): a stale ``run.lock`` never blocks a rerun, and
the file is never deleted (deleting a lock file lets two processes lock two different files).
Its content, a JSON line about the holder, is only what a refusal quotes.

In a multi-process job every process locks its own file (``run.lock`` for process 0,
``run.<i>.lock`` for process ``i``): every process writes into the run folder (its shards of
each checkpoint), and a job's processes may or may not share that folder's disk. Process 0's
file is the one a single-process run takes, so a run and a job on the same folder exclude each
other too. Within one process the lock is taken once per file: a second trainer built in the
same process (a notebook, the tests) shares it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = "run.lock"

_HELD: dict[Path, int] = {}  # this process's locks: lock file -> its descriptor


class RunFolderInUseError(RuntimeError):
    """Another live process holds the run folder's lock; the message names it."""


def lock_path(folder: str | os.PathLike, process: int = 0) -> Path:
    """The lock file of process ``process`` of a run in ``folder``."""
    name = LOCK_FILE if process == 0 else f"run.{process}.lock"
    return Path(folder).absolute() / name


def lock_run_folder(folder: str | os.PathLike, process: int = 0, *,
                    field: str = "trainer.output_dir") -> Path:
    """Takes the lock of ``folder`` (which must exist) for this process and returns the lock
    file; raises ``RunFolderInUseError`` at once, without waiting, when another process holds
    it. A file system that cannot lock (some network mounts) is a warning, not a refusal: the
    run goes on unprotected, as it did before the lock existed."""
    path = lock_path(folder, process)
    held = _HELD.pop(path, None)
    if held is not None:
        if _same_file(held, path):
            _HELD[path] = held
            return path
        os.close(held)  # the folder was deleted (and made again) under this process's lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunFolderInUseError(
            f"{field}: run folder {path.parent} is in use by {holder}; wait for it to finish "
            f"(or stop it), or choose another {field}") from None
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        print(f"warning: {path}: this file system cannot lock files ({e.strerror}); nothing "
              f"stops a second run from using {path.parent} at the same time",
              file=sys.stderr, flush=True)
        return path
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _HELD[path] = fd
    return path


def release_run_folder(folder: str | os.PathLike, process: int = 0) -> None:
    """Gives this process's lock of ``folder`` back (nothing if it holds none). The file
    stays: see the module docstring."""
    fd = _HELD.pop(lock_path(folder, process), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file drops its flock


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path``."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """The words for the process that holds the lock, from what it wrote in the file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        pid = int(info["pid"])
    except (OSError, ValueError, TypeError, KeyError):
        return "another process (it has not written its pid yet)"
    here = info.get("host") == socket.gethostname()
    where = "" if here else f" on host {info.get('host')}"
    return (f"pid {pid}{where} (started {info.get('started')}, command: "
            f"{info.get('command') or '?'})")
