"""The code sandbox against programs that try to escape it: each attempt fails inside the
program (or the program is stopped), costs only its own run, and leaves nothing behind;
ordinary programs (stdin, functions, threads, files in their own directory) still work."""

from __future__ import annotations

import os
import socket
import threading
import time

import psutil
import pytest

from ragen_jax.envs.code_sandbox import SandboxLimits, confinement_problem, run_program

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
