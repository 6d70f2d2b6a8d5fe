"""The child side of ``ragen_jax.envs.code_sandbox``: confines itself, then runs one program
against its tests' inputs and streams what each test produced to file descriptor 3.

Run as a script (``python -I -S -B sandbox_child.py RESULTS_FD LIBDIR...`` or ``... RESULTS_FD
--unconfined``) by ``code_sandbox`` only, in a
fresh temporary working directory that holds ``job.json`` (the program and the tests' inputs:
never their expected outputs, which stay in the parent). Standard library only, plus
``pyseccomp`` and ``landlock`` from the directories given on the command line; those are
dropped from ``sys.path`` before the program runs.

Order matters: the job is read and deleted, the resource limits set and every capability
dropped, the file-system and system-call rules are applied (both irreversible, inherited by anything the program could start), and only then
is the program's text compiled and run. Each result line is JSON: ``{"i": test index,
"ok": ran without raising, "out": the test's stdout (stdin tests) or ``str`` of the return
value (function tests), "json": the return value as JSON when it has one, "err": the error}``.
"""

import ctypes
import io
import json
import os
import resource
import sys

JOB = "job.json"


PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
CAP_VERSION_3 = 0x20080522


def _capset_number() -> int:
    """The capset system call's number on this architecture (x86-64's when unknown)."""
    import platform
    return {"aarch64": 91, "arm64": 91, "ppc64le": 184, "s390x": 185}.get(platform.machine(), 126)


def limit(rlimits: dict) -> None:
    """Resource limits (``{name: [soft, hard]}``: none can be raised past its hard value), no
    new privileges, and no capabilities at all: for a root child this makes root powerless."""
    for name, (soft, hard) in rlimits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0:
        try:
            last = int(open("/proc/sys/kernel/cap_last_cap").read())
        except (OSError, ValueError):
            last = 40
        for cap in range(last + 1):
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all empty
    if libc.syscall(_capset_number(), header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset: could not drop capabilities")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl: could not set no_new_privs")


def confine(libdirs: list) -> None:
    """Landlock: read (and import) only the interpreter's own directories and shared
    libraries; read and write only the working directory. seccomp: no sockets, no new
    processes or programs, no signals to other processes, no kernel-level escapes."""
    sys.path[:0] = libdirs
    import landlock
    import pyseccomp as sc

    here = os.getcwd()
    readable = [p for p in sys.path[len(libdirs):] if os.path.isdir(p)]
    readable += [p for p in ("/usr/lib", "/lib", "/lib64", "/usr/lib64") if os.path.isdir(p)]
    fs = landlock.FSAccess
    ruleset = landlock.Ruleset()
    ruleset.allow(*readable, rules=fs.READ_FILE | fs.READ_DIR | fs.EXECUTE)
    # Everything in its own directory but device nodes.
    ruleset.allow(here, rules=ruleset.restrict_rules & ~(fs.MAKE_CHAR | fs.MAKE_BLOCK))
    ruleset.apply()

    pid = os.getpid()
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(1)
    for name in ("socket", "socketpair", "fork", "vfork", "execve", "execveat", "ptrace",
                 "process_vm_readv", "process_vm_writev", "io_uring_setup", "mount", "umount2",
                 "unshare", "setns", "chroot", "pivot_root", "bpf", "perf_event_open", "keyctl",
                 "add_key", "request_key", "init_module", "finit_module", "delete_module",
                 "kexec_load", "reboot", "swapon", "swapoff", "open_by_handle_at",
                 "name_to_handle_at", "userfaultfd", "pidfd_open", "pidfd_send_signal",
                 "pidfd_getfd", "setuid", "setgid", "setreuid", "setregid", "setresuid",
                 "setresgid", "setgroups", "sethostname", "setdomainname", "settimeofday",
                 "clock_settime", "adjtimex", "acct", "quotactl", "personality", "mknod", "mknodat",
                 "iopl", "ioperm", "capset", "setrlimit", "prlimit64", "fsopen", "fsmount",
                 "fsconfig", "move_mount", "open_tree", "fspick", "mount_setattr",
                 "kexec_file_load", "syslog", "modify_ldt", "uselib", "sched_setscheduler",
                 "sched_setattr", "setpriority"):
        f.add_rule(eperm, name)
    # Threads stay possible (clone with CLONE_THREAD); a new process is not. clone3 hides
    # its flags in memory a filter cannot read, so it answers ENOSYS and libc falls back to
    # clone, where the flags are checked.
    clone_thread = 0x00010000
    f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, clone_thread, 0))
    f.add_rule(sc.ERRNO(38), "clone3")
    for name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add_rule(eperm, name, sc.Arg(0, sc.NE, pid))
    f.load()
    del sys.path[:len(libdirs)]
    for name in [m for m in sys.modules if m in ("landlock", "pyseccomp") or m.startswith("landlock.")]:
        del sys.modules[name]


class CappedText(io.StringIO):
    """A stdout that refuses to hold more than ``cap`` characters (a program printing without
    end fails its test instead of filling memory)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def write(self, s):
        if self.tell() + len(s) > self.cap:
            raise OSError(f"output limit: more than {self.cap} characters")
        return super().write(s)


def run_test(code, test: dict, func_name, out_cap: int) -> dict:
    """Runs the program once for one test in a fresh namespace."""
    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    buf = CappedText(out_cap)
    sys.stdin = io.StringIO(test.get("stdin", ""))
    sys.stdout, sys.stderr = buf, CappedText(out_cap)
    result = {"i": test["i"], "ok": True, "out": "", "json": None, "err": None}
    try:
        scope = {"__name__": "__main__" if test["kind"] == "stdin" else "solution"}
        exec(code, scope, scope)
        if test["kind"] == "function":
            if "Solution" in scope and func_name:
                target = getattr(scope["Solution"](), func_name)
            elif func_name in scope:
                target = scope[func_name]
            else:
                raise NameError(f"function {func_name!r} not found")
            value = target(*test["args"])
            result["out"] = str(value)[:out_cap]
            try:
                result["json"] = json.loads(json.dumps(value))
            except (TypeError, ValueError):
                pass
        else:
            result["out"] = buf.getvalue()
    except BaseException as e:  # noqa: BLE001 - the program's own errors are its result
        result.update(ok=False, out=buf.getvalue()[:out_cap], err=f"{type(e).__name__}: {e}"[:500])
    finally:
        sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
    return result


def main() -> None:
    with open(JOB, encoding="utf-8") as fh:
        job = json.load(fh)
    os.unlink(JOB)
    results = os.fdopen(int(sys.argv[1]), "w", buffering=1, encoding="utf-8")
    limit(job["rlimits"])
    if sys.argv[2:] != ["--unconfined"]:
        confine(sys.argv[2:])
    try:
        code = compile(job["code"], "<solution>", "exec")
    except (SyntaxError, ValueError) as e:
        for test in job["tests"]:
            results.write(json.dumps({"i": test["i"], "ok": False, "out": "", "json": None,
                                      "err": f"SyntaxError: {e}"[:500]}) + "\n")
        return
    for test in job["tests"]:
        results.write(json.dumps(run_test(code, test, job["func_name"], job["out_cap"])) + "\n")


if __name__ == "__main__":
    main()
