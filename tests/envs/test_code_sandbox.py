"""The code sandbox against programs that try to escape it (signals through a file's owner,
the folder's quota included): each attempt fails inside the program (or the program is
stopped), costs only its own run, and leaves nothing behind; ordinary programs (stdin,
functions, threads, files in their own directory) still work."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs.host import code_sandbox
from ragen_jax.envs.host.code_sandbox import SandboxLimits, confinement_problem, run_program
from tests.envs.escape_trainer import ESCAPE

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(confinement_problem() is not None,
                                reason=str(confinement_problem()))

STDIN = [{"kind": "stdin", "stdin": ""}]


def run(code: str, tests=STDIN, **limits):
    """One program's runs, its stop reason and the wall time it took."""
    start = time.monotonic()
    runs, stopped = run_program(code, tests, "f", SandboxLimits(**limits))
    return runs, stopped, time.monotonic() - start


def ours():
    """This test process's descendants (the sandbox must leave none)."""
    return psutil.Process().children(recursive=True)


def test_ordinary_programs_run():
    runs, stopped, _ = run("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)",
                           [{"kind": "stdin", "stdin": "2 40"}, {"kind": "stdin", "stdin": "-1 1"}])
    assert stopped is None and [r.output for r in runs] == ["42\n", "0\n"]
    runs, _, _ = run("class Solution:\n    def f(self, xs):\n        return sorted(xs)",
                     [{"kind": "function", "args": [[3, 1, 2]]}])
    assert runs[0].ran and runs[0].value == [1, 2, 3] and runs[0].output == "[1, 2, 3]"
    # Threads, the standard library and files in its own directory are allowed.
    code = ("import threading, collections, heapq, json, math, re\n"
            "out = []\nt = threading.Thread(target=lambda: out.append(math.factorial(5)))\n"
            "t.start(); t.join()\nopen('scratch.txt', 'w').write(json.dumps(out))\n"
            "print(open('scratch.txt').read())")
    runs, stopped, _ = run(code)
    assert stopped is None and runs[0].ran and runs[0].output == "[120]\n", runs[0]


def test_a_syntax_error_fails_every_test():
    runs, stopped, _ = run("def f(:\n", [{"kind": "function", "args": [1]}] * 2)
    assert stopped is None and all(not r.ran and "SyntaxError" in r.error for r in runs)


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\nwhile True:\n    time.sleep(1)"])
def test_an_infinite_loop_is_stopped_at_the_time_limit(code):
    before = {p.pid for p in ours()}
    runs, stopped, took = run("print('first')\n" + code, STDIN * 2, time_limit=1.0)
    assert stopped == "time limit" and took < 5
    assert all(not r.ran for r in runs)
    assert {p.pid for p in ours()} <= before


def test_tests_passed_before_a_time_limit_keep_their_result():
    code = "import sys\nn = int(sys.stdin.read())\nwhile n == 2:\n    pass\nprint(n)"
    runs, stopped, _ = run(code, [{"kind": "stdin", "stdin": str(i)} for i in (1, 2, 3)], time_limit=1.0)
    assert stopped == "time limit"
    assert runs[0].ran and runs[0].output == "1\n" and not runs[1].ran and not runs[2].ran


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",
    "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'echo escaped'])",
    "import os\nassert os.system('echo escaped') == 0",
    "import multiprocessing\np = multiprocessing.Process(target=print)\np.start()",
    "import os\nos.execv('/bin/sh', ['sh', '-c', 'echo escaped'])",
])
def test_no_new_process_or_program(code):
    before = {p.pid for p in ours()}
    count = len(psutil.pids())
    runs, stopped, took = run(code)
    assert not runs[0].ran and "escaped" not in runs[0].output, runs[0]
    assert stopped is None and took < 5
    assert {p.pid for p in ours()} <= before
    assert len(psutil.pids()) < count + 5  # no fork bomb left running anywhere


def test_files_outside_its_directory_cannot_be_read_or_written(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the parent's secret")
    attempts = {
        "read a file elsewhere": f"print(open({str(secret)!r}).read())",
        "read /etc/passwd": "print(open('/etc/passwd').read())",
        "list the root": "import os\nprint(os.listdir('/'))",
        "list the caller's directory": f"import os\nprint(os.listdir({str(tmp_path)!r}))",
        "read its own process's environment": "print(open('/proc/self/environ').read())",
        "follow a symlink out": f"import os\nos.symlink({str(secret)!r}, 'link')\nprint(open('link').read())",
        "hard-link a file in": f"import os\nos.link({str(secret)!r}, 'hard')\nprint(open('hard').read())",
        "write a file elsewhere": f"open({str(tmp_path / 'pwned')!r}, 'w').write('x')",
        "read the trainer's source": f"print(open({os.path.abspath(__file__)!r}).read())",
    }
    for what, code in attempts.items():
        runs, _, _ = run(code)
        assert not runs[0].ran, what
        assert "secret" not in runs[0].output and "root:" not in runs[0].output, what
        assert "PermissionError" in runs[0].error or "Errno" in runs[0].error, (what, runs[0].error)
    assert not (tmp_path / "pwned").exists()


def test_no_network_even_to_a_local_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    for code in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                 "import socket\nsocket.socket(socket.AF_UNIX)",
                 "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
                 # below Python's socket module: the system call itself is refused
                 "import ctypes\nassert ctypes.CDLL(None).socket(2, 1, 0) >= 0"):
        runs, _, _ = run(code)
        assert not runs[0].ran, code
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_printing_without_end_is_stopped():
    runs, stopped, took = run("while True:\n    print('x' * 10000)")
    assert not runs[0].ran and "output limit" in runs[0].error and took < 5
    # Writing to the real stdout below Python's print: the parent stops the process.
    runs, stopped, took = run("import os\nwhile True:\n    os.write(1, b'x' * 65536)")
    assert stopped == "output limit" and not runs[0].ran and took < 5
    # A huge file in its own directory: the file-size limit.
    runs, _, _ = run("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))\n    f.flush()",
                     file_size_mb=4)
    assert not runs[0].ran


def test_memory_is_bounded():
    runs, _, _ = run("x = bytearray(2 ** 33)\nprint(len(x))", memory_mb=256)
    assert not runs[0].ran and "MemoryError" in runs[0].error


def test_it_cannot_signal_its_parent_or_read_the_callers_environment(monkeypatch):
    monkeypatch.setenv("RAGEN_TEST_SECRET", "hunter2")
    runs, _, _ = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert not runs[0].ran and "PermissionError" in runs[0].error
    runs, _, _ = run("import os\nprint(sorted(os.environ.items()))")
    assert runs[0].ran and "hunter2" not in runs[0].output


def test_it_cannot_raise_its_own_limits():
    code = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))"
    runs, _, _ = run(code)
    assert not runs[0].ran


def test_runs_in_parallel_threads_stay_apart():
    """Two callers at once (the env's parallel episodes): each gets its own program's output."""
    results = {}

    def one(n):
        results[n] = run(f"print({n} * 2)")[0][0].output

    threads = [threading.Thread(target=one, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {n: f"{n * 2}\n" for n in range(6)}


# -- signals through a file's owner ------------------------------------------------------------

# fcntl's system call number, for a call with the command's high half set (the kernel reads the
# command as 32-bit, so a filter comparing 64 bits would let it through).
FCNTL_NR = {"x86_64": 72, "aarch64": 25}.get(platform.machine())
OWNER_ROUTES = {
    "F_SETOWN + F_SETSIG to the caller's group": ESCAPE.format(target="-os.getpgid(os.getppid())"),
    "F_SETOWN + F_SETSIG to a stranger": ESCAPE.format(target="{stranger}"),
    "F_SETOWN_EX to the caller's group": (
        "import fcntl, os, struct\nr, w = os.pipe()\n"
        "fcntl.fcntl(r, 15, struct.pack('ii', 2, os.getpgid(os.getppid())))"),
    "F_SETSIG alone": "import fcntl, os\nr, w = os.pipe()\nfcntl.fcntl(r, 10, 9)",
    "ioctl FIOSETOWN": "import fcntl, os, struct\nr, w = os.pipe()\nfcntl.ioctl(r, 0x8901, struct.pack('i', {stranger}))",
    "ioctl SIOCSPGRP": "import fcntl, os, struct\nr, w = os.pipe()\nfcntl.ioctl(r, 0x8902, struct.pack('i', {stranger}))",
    "F_SETOWN with the command's high bits set": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nr, w = os.pipe()\n"
        f"rc = libc.syscall({FCNTL_NR}, r, ctypes.c_uint64((1 << 32) | 8), {{stranger}})\n"
        "if rc != 0:\n    raise PermissionError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))"),
}


@pytest.fixture
def stranger():
    """An unrelated process in a session of its own, that nothing here may signal."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _as_a_trainer(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``script`` run by a stand-in trainer: a Python process leading a process group of its
    own (the one the programs aim at), never this test process's."""
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


def test_no_file_owner_can_be_set_to_signal_another_process(stranger):
    """The adversarial pass's reproduction and its variants: each program fails with EPERM at
    the call that names an owner, the stand-in trainer's group and the stranger live on."""
    if FCNTL_NR is None:
        pytest.skip(f"fcntl's system call number on {platform.machine()} is not in this test")
    codes = {what: code.replace("{stranger}", str(stranger.pid)) for what, code in OWNER_ROUTES.items()}
    script = ("import json\nfrom ragen_jax.envs.host.code_sandbox import run_program\n"
              f"codes = {codes!r}\nout = {{}}\n"
              "for what, code in codes.items():\n"
              "    runs, stopped = run_program(code, [{'kind': 'stdin', 'stdin': ''}])\n"
              "    out[what] = [runs[0].ran, runs[0].error, stopped]\n"
              "print(json.dumps(out))")
    done = _as_a_trainer(script)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for what, (ran, error, stopped) in results.items():
        assert not ran and stopped is None, (what, error)
        assert error.startswith("PermissionError") and "Errno 1]" in error, (what, error)
    assert stranger.poll() is None


def _landlock_abi() -> int:
    import landlock

    return landlock.landlock_abi_version()


def test_landlocks_signal_scope_alone_stops_the_file_owner_route(stranger):
    """The second line of defence by itself (no seccomp rules): F_SETOWN is allowed but the
    kernel delivers no signal outside the program's Landlock domain."""
    if _landlock_abi() < 6:
        pytest.skip("the kernel's Landlock has no signal scoping (ABI < 6, Linux < 6.12)")
    program = (
        "import ctypes, fcntl, os, time\n"
        "from ragen_jax.envs.host import sandbox_child\n"
        "assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0  # no_new_privs\n"
        "assert sandbox_child.scope_signals() == 'landlock'\n"
        f"for target in (-os.getpgid(os.getppid()), {stranger.pid}):\n"
        "    r, w = os.pipe()\n"
        "    fcntl.fcntl(r, fcntl.F_SETOWN, target)\n"
        "    fcntl.fcntl(r, 10, 9)\n"
        "    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)\n"
        "    os.write(w, b'x')\n"
        "time.sleep(0.2)\nprint('wrote')")
    script = ("import subprocess, sys\n"
              f"done = subprocess.run([sys.executable, '-c', {program!r}], capture_output=True, text=True, start_new_session=True)\n"
              "print(done.returncode, done.stdout.strip(), done.stderr[-500:])")
    done = _as_a_trainer(script, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("0 wrote"), done.stdout
    assert stranger.poll() is None


def test_a_deepcoder_run_whose_answers_are_the_escape_lives(tmp_path, stranger):
    """Acceptance: a DeepCoder run's trainer (the env in its worker processes, the micro
    model) whose every answer is the reproduction, aimed at the trainer's group or at a
    stranger, plays two steps' rollouts and lives on; the programs fail their tests; nothing
    is left under the temp dir. (The update never sees the programs: the training step itself
    is tests/test_train.py's, DeepCoder's preset in the data-env mix.)"""
    before = set(Path(tempfile.gettempdir()).glob(code_sandbox.PREFIX + "*"))
    done = subprocess.run([sys.executable, "-m", "tests.envs.escape_trainer", str(tmp_path),
                           str(stranger.pid)], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, start_new_session=True)
    assert done.returncode == 0, (done.returncode, done.stdout[-1000:], done.stderr[-2000:])
    train = [json.loads(line) for line in done.stdout.strip().splitlines()
             if line.startswith('{"step"')]
    assert [m["step"] for m in train] == [1, 2]
    assert all(m["train/DeepCoder/success"] == 0 for m in train)
    assert all(m["rollout/num_trajectories"] == 8 for m in train)  # 2 groups x 4, all played
    assert all(m["rollout/env_errors"] == 0 for m in train)  # played, not crashed
    assert stranger.poll() is None
    assert set(Path(tempfile.gettempdir()).glob(code_sandbox.PREFIX + "*")) <= before


# -- the program's folder --------------------------------------------------------------------


@pytest.fixture(params=["tmpfs", "watched"])
def folder_mode(request, monkeypatch):
    """Both ways a folder is bounded: the child's own tmpfs (the kernel's ENOSPC) and the
    fallback where the parent watches a folder on the real disk and stops the program."""
    if request.param == "watched":
        monkeypatch.setattr(code_sandbox, "PRIVATE_FOLDER", False)
    else:
        run("print(1)")
        if code_sandbox.last_setup.get("folder") != "tmpfs":
            pytest.skip(f"no private tmpfs here: {code_sandbox.last_setup.get('folder')}")
    return request.param


def _folders() -> set[Path]:
    return {p for p in Path(tempfile.gettempdir()).glob(f"{code_sandbox.PREFIX}{os.getpid()}_*")}


@pytest.mark.parametrize("code", [
    # bytes: many files, each under the file-size limit, past the folder's total
    "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))",
    # files: empty files without end
    "i = 0\nwhile True:\n    open(f'f{i}', 'w').close()\n    i += 1",
    # folders without end
    "import os\ni = 0\nwhile True:\n    os.mkdir(f'd{i}')\n    i += 1",
])
def test_the_folder_has_a_quota(folder_mode, code):
    runs, stopped, took = run(code, folder_mb=8, folder_files=64)
    assert not runs[0].ran and took < 5
    if folder_mode == "tmpfs":
        assert stopped is None and "No space left on device" in runs[0].error, runs[0].error
    else:
        assert stopped == "folder limit", (stopped, runs[0].error)
    assert not _folders()


def test_the_folder_is_removed_whatever_the_program_did(folder_mode):
    # Folders it cannot list and files it cannot read, made with their modes at once (chmod
    # is refused: test_no_file_outside_its_folder_changes_its_metadata).
    code = ("import os\nos.mkdir('a', 0o300)\nos.makedirs('a/b/c')\nopen('a/b/c/f', 'w').write('x')\n"
            "os.close(os.open('a/g', os.O_CREAT | os.O_WRONLY, 0))\nos.mkdir('a/b/d', 0)\n"
            "os.symlink('/etc', 'etc')")
    runs, stopped, _ = run(code)
    assert runs[0].ran and stopped is None, runs[0].error
    assert not _folders() and os.path.isdir("/etc")


def test_the_kernels_missing_pieces_are_said_once(monkeypatch, caplog):
    monkeypatch.setattr(code_sandbox, "PRIVATE_FOLDER", False)
    monkeypatch.setattr(code_sandbox, "_said", set())
    with caplog.at_level(logging.WARNING, logger=code_sandbox.__name__):
        run("print(1)")
        run("print(2)")
    notes = [r.getMessage() for r in caplog.records if "folder quota" in r.getMessage()]
    assert len(notes) == 1 and "not asked for" in notes[0], notes


def test_a_killed_callers_folders_are_removed_by_the_next_caller(tmp_path, monkeypatch, stranger):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{code_sandbox.PREFIX}{dead.pid}_abc"
    (stale / "d").mkdir(parents=True)
    (stale / "d" / "f").write_text("x")
    live = tmp_path / f"{code_sandbox.PREFIX}{stranger.pid}_abc"
    live.mkdir()
    other = tmp_path / "unrelated"
    other.mkdir()
    code_sandbox._remove_stale_folders.__wrapped__()
    assert not stale.exists() and live.exists() and other.exists()


# -- what outlives a program or escapes its rules, and how a program ends ---------------------

def test_no_file_outside_its_folder_changes_its_metadata(tmp_path):
    """Landlock governs no metadata and a root child owns root's files: mode (setuid
    included), owner, times and extended attributes of a file elsewhere stay as they were;
    inside its own folder the same calls are refused too (the kernel cannot tell them apart)."""
    target = tmp_path / "interpreter"
    target.write_bytes(b"\x7fELF")
    target.chmod(0o755)
    try:
        os.setxattr(target, "user.before", b"1")
        xattrs = True
    except OSError:  # a file system without user xattrs: that route is closed anyway
        xattrs = False
    before = os.stat(target)
    attempts = {
        "setuid bit": f"import os\nos.chmod({str(target)!r}, 0o4755)",
        "unreadable interpreter": f"import os\nos.chmod({str(target)!r}, 0o644)",
        "chown to itself (clears setuid bits)": f"import os\nos.chown({str(target)!r}, 0, 0)",
        "times": f"import os\nos.utime({str(target)!r}, (0, 0))",
        "xattr": f"import os\nos.setxattr({str(target)!r}, 'user.pwned', b'1')",
        "xattr removed": f"import os\nos.removexattr({str(target)!r}, 'user.before')",
        "its own file's mode": "import os\nopen('f', 'w').close()\nos.chmod('f', 0o4755)",
    }
    for what, code in attempts.items():
        runs, stopped, _ = run(code)
        assert not runs[0].ran and stopped is None, (what, runs[0])
        assert runs[0].error.startswith("PermissionError"), (what, runs[0].error)
    after = os.stat(target)
    assert (after.st_mode, after.st_uid, after.st_gid, after.st_mtime_ns) == \
        (before.st_mode, before.st_uid, before.st_gid, before.st_mtime_ns)
    if xattrs:
        assert os.listxattr(target) == ["user.before"]


def test_no_watch_reveals_another_folders_activity():
    for code in ("import ctypes\nassert ctypes.CDLL(None).inotify_init1(0) >= 0",
                 "import ctypes\nassert ctypes.CDLL(None).inotify_init() >= 0",
                 "import ctypes\nassert ctypes.CDLL(None).fanotify_init(0, 0) >= 0"):
        runs, _, _ = run(code)
        assert not runs[0].ran and "AssertionError" in runs[0].error, (code, runs[0].error)


SHM_KEY = 0x52414745  # "RAGE": a System V key of this test's own


def _segments(key: int) -> list[str]:
    """The host IPC namespace's shared-memory segments under ``key``."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [row for row in rows if int(row.split()[0]) == key]


def _remove_segments(key: int) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    while (shmid := libc.shmget(key, 0, 0)) >= 0:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


@pytest.mark.skipif(not Path("/proc/sysvipc/shm").exists(), reason="no System V IPC here")
def test_no_ipc_object_outlives_the_program_or_reaches_anothers():
    """seccomp refuses System V IPC, POSIX queues and memfds; and without seccomp (resource
    limits only) the program's IPC namespace is its own: what it makes dies with it, and a
    segment of this process's is out of its sight."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ours_id = libc.shmget(SHM_KEY + 1, 4096, 0o1600)  # IPC_CREAT | 0600
    assert ours_id >= 0
    make = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"shmid = libc.shmget({SHM_KEY}, 8 << 20, 0o1600)\nassert shmid >= 0, ctypes.get_errno()\n"
            "print('made')\n")
    theirs = (f"import ctypes\nassert ctypes.CDLL(None).shmget({SHM_KEY + 1}, 0, 0) >= 0, 'not found'\n")
    try:
        for code in (make, theirs, "import ctypes\nassert ctypes.CDLL(None).msgget(0, 0o1600) >= 0",
                     "import ctypes\nassert ctypes.CDLL(None).semget(0, 1, 0o1600) >= 0",
                     "import os\nos.memfd_create('ram')",
                     "import ctypes\nassert ctypes.CDLL(None).mq_open(b'/q', 0o100 | 2, 0o600, None) >= 0"):
            runs, _, _ = run(code)
            assert not runs[0].ran, (code, runs[0])
        assert not _segments(SHM_KEY)
        runs, _, _ = run(make, confine=False)
        assert runs[0].ran and runs[0].output == "made\n", runs[0]
        assert code_sandbox.last_setup.get("ipc") == "own namespace", code_sandbox.last_setup
        assert not _segments(SHM_KEY)  # gone with the program's namespace
        runs, _, _ = run(theirs, confine=False)
        assert not runs[0].ran and "not found" in runs[0].error
        assert libc.shmctl(ours_id, 2, ctypes.create_string_buffer(256)) == 0  # IPC_STAT: intact
    finally:
        _remove_segments(SHM_KEY)
        _remove_segments(SHM_KEY + 1)


def test_memfds_do_not_hold_memory_past_the_limit():
    code = ("import os\nfds = [os.memfd_create(f'm{i}') for i in range(50)]\n"
            "for fd in fds:\n    os.write(fd, b'x' * (8 << 20))")
    runs, _, _ = run(code)
    assert not runs[0].ran and runs[0].error.startswith("PermissionError"), runs[0].error


RESULTS = "import os, sys\nfd = int(sys.argv[1])  # the results descriptor\n"


@pytest.mark.parametrize("code, stop", [
    ("import os\nos.kill(os.getpid(), 40)", "killed by SIGRTMIN+"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGRTMAX - 1)", "killed by SIGRTMIN+"),
    ("import ctypes\nctypes.string_at(0)", "killed by SIGSEGV"),
    ("import os\nos.abort()", "killed by SIGABRT"),
    ("import os\nos._exit(77)", "exit status 77"),
    (RESULTS + "os.write(fd, b'[' * 100000 + b'\\n')", "results tampered"),
    (RESULTS + "os.write(fd, b'[' * 100000)", "results tampered"),  # the child's line joins it
    (RESULTS + "os.write(fd, os.urandom(50000) + b'\\n')", "results tampered"),
    (RESULTS + "os.write(fd, b'{\"i\": 1, \"ok\": true, \"out\": \"4\\\\n\"}\\n')", "results tampered"),
    (RESULTS + "os.close(fd)\nprint(4)", "exit status 1"),  # the child cannot report
])
def test_every_way_a_program_ends_is_its_own_failure(code, stop):
    """A wrong answer cannot make itself the caller's error (an env error is left out of the
    update instead of scoring 0): any signal, exit status or bytes on any descriptor end as
    this program's failed tests, with the reason said, never as an exception here."""
    runs, stopped, _ = run(code, [{"kind": "stdin", "stdin": "2"}] * 2)
    assert len(runs) == 2 and not runs[0].ran and not runs[1].ran, runs
    assert stopped is not None and stopped.startswith(stop), stopped
    assert stop in runs[0].error, runs[0].error


def test_a_flood_of_result_lines_costs_the_caller_little():
    """Lines that are not results stop the reading at the first, so a flood costs the parent
    neither its CPU nor its memory (it read 109 MiB and spent 4.3 s parsing before)."""
    flood = RESULTS + "chunk = b'12\\n' * (1 << 20)\nfor _ in range(40):\n    os.write(fd, chunk)"
    start = time.thread_time()
    runs, stopped, _ = run(flood, STDIN * 3, time_limit=20.0)
    assert stopped.startswith("results tampered") and not any(r.ran for r in runs)
    assert time.thread_time() - start < 1.0
    endless_line = RESULTS + "chunk = b'x' * (1 << 20)\nos.write(fd, b'\"')\nfor _ in range(200):\n    os.write(fd, chunk)"
    start = time.thread_time()
    runs, stopped, _ = run(endless_line, STDIN * 3, time_limit=20.0, output_limit=4096)
    assert stopped == "results tampered (a line past its length)" and not any(r.ran for r in runs)
    assert time.thread_time() - start < 1.0


def test_results_after_the_last_test_are_ignored_and_outputs_fit_their_line():
    """The child writes each result within ``line_bytes``: an output of control characters
    is cut to fit, a large ASCII output is kept whole; the parent reads nothing after the
    last test's line."""
    runs, stopped, _ = run("print('\\x01' * 8000)", output_limit=8192)
    assert runs[0].ran and stopped is None and 0 < len(runs[0].output) < 8001
    runs, stopped, _ = run("print('ab\\n' * 2000, end='')", output_limit=6000)
    assert runs[0].ran and runs[0].output == "ab\n" * 2000, len(runs[0].output)
    code = (RESULTS + "import atexit\natexit.register(lambda: os.write(fd, b'junk\\n' * 1000))\n"
            "print(int(input()) * 2)")
    runs, stopped, _ = run(code, [{"kind": "stdin", "stdin": "21"}])
    assert runs[0].ran and runs[0].output == "42\n" and stopped is None


@pytest.mark.parametrize("data", [b"", b"\n", b"{}\n", b"[[[[", b"\xff\xfe\n" * 3,
                                  b'{"setup": {}}\n{"i": 0, "ok": true, "out": "1"}\n' * 4])
def test_the_results_reader_takes_any_bytes(data):
    """Whatever arrives, in any chunks: at most one result per test, in order, no exception."""
    @settings(max_examples=60, deadline=None)
    @given(st.binary(max_size=400), st.lists(st.integers(1, 50), max_size=20))
    def check(noise, cuts):
        stream = data + noise
        reader = code_sandbox._Results(2, 200)
        at = 0
        for cut in cuts + [len(stream)]:
            reader.feed(stream[at:at + cut])
            at += cut
        assert len(reader.runs) <= 2
        assert all(isinstance(r, code_sandbox.TestRun) for r in reader.runs)

    check()


def _world_readable_interpreter() -> str | None:
    """A system interpreter whose standard library any user can read (the uid switch needs
    one), with the sandbox's libraries also readable by any user; None when there is none."""
    from ragen_jax.envs.host.sandbox_child import _readable_by_anyone

    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(path, os.X_OK):
            continue
        probe = subprocess.run([path, "-I", "-S", "-c", "import sys; print(sys.version_info[:2] >= (3, 10)); print('\\n'.join(sys.path))"],
                               capture_output=True, text=True)
        lines = probe.stdout.splitlines()
        if probe.returncode or lines[:1] != ["True"]:
            continue
        dirs = [p for p in lines[1:] if os.path.isdir(p)] + list(code_sandbox._library_dirs())
        if all(_readable_by_anyone(p) for p in dirs):
            return path
    return None


def test_a_root_callers_program_runs_as_an_unused_uid(tmp_path, monkeypatch):
    """Where the interpreter is readable by any user, a root caller's child becomes a uid of
    its own: root's files are not its own even with seccomp's metadata rules off (resource
    limits only), and its own folder, the standard library and its tests still work."""
    if os.geteuid() != 0:
        pytest.skip("the uid switch is a root caller's")
    interpreter = _world_readable_interpreter()
    if interpreter is None:
        pytest.skip("no interpreter here whose library any user can read")
    monkeypatch.setattr(code_sandbox, "INTERPRETER", interpreter)
    target = tmp_path / "roots"
    target.write_text("x")
    target.chmod(0o644)
    tmp_path.chmod(0o755)
    ordinary = ("import os, json, heapq\nopen('scratch', 'w').write('7')\n"
                "print(os.getuid() - os.getpid(), open('scratch').read())")
    for confine in (True, False):
        runs, stopped, _ = run(ordinary, confine=confine)
        assert runs[0].ran and stopped is None, runs[0]
        assert runs[0].output == f"{0xF0000000} 7\n", runs[0].output
        assert code_sandbox.last_setup["uid"].isdigit(), code_sandbox.last_setup
    runs, _, _ = run(f"import os\nos.chmod({str(target)!r}, 0o4777)", confine=False)
    assert not runs[0].ran and runs[0].error.startswith("PermissionError"), runs[0]
    assert target.stat().st_mode & 0o7777 == 0o644


def test_a_child_that_fails_before_the_program_is_the_sandboxs_error(tmp_path, monkeypatch):
    """Scored as the answer's failure it would hide a broken sandbox behind zero rewards."""
    child = tmp_path / "child.py"
    child.write_text("raise SystemExit('no confinement for you')\n")
    monkeypatch.setattr(code_sandbox, "CHILD", child)
    with pytest.raises(RuntimeError, match="failed before any program ran.*no confinement for you"):
        run("print(1)")
