"""The child side of ``ragen_jax.envs.host.code_sandbox``: confines itself, then runs one program
against its tests' inputs and streams what each test produced to file descriptor 3.

Run as a script (``python -I -S -B sandbox_child.py RESULTS_FD LIBDIR...`` or ``... RESULTS_FD
--unconfined``) by ``code_sandbox`` only, in a
fresh temporary working directory that holds ``job.json`` (the program and the tests' inputs:
never their expected outputs, which stay in the parent). Standard library only, plus
``pyseccomp`` and ``landlock`` from the directories given on the command line; those are
dropped from ``sys.path`` before the program runs.

Order matters: the job is read and deleted; the working directory becomes a size-bounded
tmpfs of the child's own (a user and mount namespace: the folder's quota in bytes and files,
gone with the process); the resource limits are set and every capability dropped; the
file-system, signal-scope and system-call rules are applied (all irreversible, inherited by
anything the program could start); only then is the program's text compiled and run.

The first line on the results descriptor says how the child is confined (``{"setup":
{"folder": "tmpfs" or why not, "signals": "landlock" or why not}}``), so the parent can
watch the folder itself and say in its log what this kernel lacks. Each later line is JSON:
``{"i": test index, "ok": ran without raising, "out": the test's stdout (stdin tests) or
``str`` of the return value (function tests), "json": the return value as JSON when it has
one, "err": the error}``.
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
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
# Landlock's system calls have one number on every architecture (the generic table).
LANDLOCK_CREATE_RULESET, LANDLOCK_RESTRICT_SELF = 444, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL = 0x1, 0x2
# fcntl commands and ioctl requests that make the kernel signal a chosen process or group
# (a file's owner gets SIGIO, or any signal F_SETSIG names, when the file is ready):
# kill() by another name.
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902


def _capset_number() -> int:
    """The capset system call's number on this architecture (x86-64's when unknown)."""
    import platform
    return {"aarch64": 91, "arm64": 91, "ppc64le": 184, "s390x": 185}.get(platform.machine(), 126)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _errno_text(what: str) -> str:
    err = ctypes.get_errno()
    return f"{what}: {os.strerror(err)} (errno {err})"


def private_folder(size_mb: int, files: int, wanted: bool = True) -> str:
    """Mounts a tmpfs of ``size_mb`` MiB and ``files`` inodes over the working directory, in
    a user and mount namespace of the child's own: the program's folder quota, exact (the
    kernel answers ENOSPC), and nothing it writes reaches the real disk or outlives it.
    Returns "tmpfs", or why not (a kernel or container without unprivileged user
    namespaces): the caller then watches the folder from outside."""
    if not wanted:
        return "not asked for (code_sandbox.PRIVATE_FOLDER is False)"
    libc = _libc()
    here = os.getcwd()
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return _errno_text("no user namespace")
    try:  # this uid and gid as themselves (files it makes stay ours, not "nobody")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    except OSError as e:
        return f"no user namespace: {e}"
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return _errno_text("no private mount namespace")
    options = f"size={int(size_mb)}m,nr_inodes={int(files) + 1},mode=0700".encode()
    if libc.mount(b"ragen_sandbox", here.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  options) != 0:
        return _errno_text("no tmpfs")
    os.chdir(here)  # the new mount, not the directory under it
    return "tmpfs"


def scope_signals() -> str:
    """Landlock's scoping (ABI >= 6, Linux 6.12): no signal leaves this process's domain,
    whether sent by kill or by the kernel on a file's owner's behalf (SIGIO, F_SETSIG), and
    no abstract Unix socket outside it is reached. A second line of defence behind seccomp's
    rules. Returns "landlock", or why not."""
    libc = _libc()
    abi = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 6:
        return f"Landlock ABI {max(abi, 0)} has no signal scoping (it needs ABI 6, Linux >= 6.12)"
    attr = (ctypes.c_uint64 * 3)(0, 0, LANDLOCK_SCOPE_SIGNAL | LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET)
    fd = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), attr, ctypes.c_size_t(ctypes.sizeof(attr)),
                      ctypes.c_uint32(0))
    if fd < 0:
        return _errno_text("Landlock refused a scoped ruleset")
    try:
        if libc.syscall(ctypes.c_long(LANDLOCK_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            return _errno_text("Landlock refused the signal scope")
    finally:
        os.close(fd)
    return "landlock"


def limit(rlimits: dict) -> None:
    """Resource limits (``{name: [soft, hard]}``: none can be raised past its hard value), no
    new privileges, and no capabilities at all: for a root child this makes root powerless."""
    for name, (soft, hard) in rlimits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    libc = _libc()
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


def confine(libdirs: list) -> str:
    """Landlock: read (and import) only the interpreter's own directories and shared
    libraries; read and write only the working directory; signals scoped to itself where the
    kernel can. seccomp: no sockets, no new processes or programs, no signals to other
    processes (nor a file owner that would receive them), no kernel-level escapes. Returns
    what ``scope_signals`` said."""
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
    signals = scope_signals()

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
    # The kernel reads fcntl's command and ioctl's request as 32-bit: the high half is masked
    # off here too, or 1 << 32 | F_SETOWN would pass the filter and still mean F_SETOWN.
    low = 0xFFFFFFFF
    for cmd in (F_SETOWN, F_SETSIG, F_SETOWN_EX):
        f.add_rule(eperm, "fcntl", sc.Arg(1, sc.MASKED_EQ, low, cmd))
    for request in (FIOSETOWN, SIOCSPGRP):
        f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, low, request))
    f.load()
    del sys.path[:len(libdirs)]
    for name in [m for m in sys.modules if m in ("landlock", "pyseccomp") or m.startswith("landlock.")]:
        del sys.modules[name]
    return signals


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
    setup = {"folder": private_folder(*job["folder"]), "signals": "not confined"}
    limit(job["rlimits"])
    if sys.argv[2:] != ["--unconfined"]:
        setup["signals"] = confine(sys.argv[2:])
    results.write(json.dumps({"setup": setup}) + "\n")
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
