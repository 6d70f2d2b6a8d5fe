"""The child side of ``ragen_jax.envs.host.code_sandbox``: confines itself, then runs one program
against its tests' inputs and streams what each test produced to file descriptor 3.

Run as a script (``python -I -S -B sandbox_child.py RESULTS_FD LIBDIR...`` or ``... RESULTS_FD
--unconfined``) by ``code_sandbox`` only, in a
fresh temporary working directory that holds ``job.json`` (the program and the tests' inputs:
never their expected outputs, which stay in the parent). Standard library only, plus
``pyseccomp`` and ``landlock`` from the directories given on the command line; those are
dropped from ``sys.path`` before the program runs.

Order matters: the job is read and deleted; a root child becomes an unused uid where the
interpreter's files are readable by any user (``unprivileged``), so that nobody's files are
its own; the working directory becomes a size-bounded tmpfs of the child's own (a user and
mount namespace: the folder's quota in bytes and files, gone with the process); it takes an
IPC namespace of its own (System V segments, queues and semaphores it could make die with
it); the resource limits are set and every capability dropped; the file-system,
signal-scope and system-call rules are applied (all irreversible, inherited by anything the
program could start); only then is the program's text compiled and run.

The first line on the results descriptor says how the child is confined (``{"setup":
{"uid": the uid it runs as or why it kept root's, "folder": "tmpfs" or why not, "ipc": "own
namespace" or why not, "signals": "landlock" or why not}}``), so the parent can watch the
folder itself and say in its log what this machine lacks. Each later line is one test's
result, in test order, as JSON: ``{"i": test index, "ok": ran without raising, "out": the
test's stdout (stdin tests) or ``str`` of the return value (function tests), "json": the
return value as JSON when it has one, "err": the error}``, at most ``line_bytes(out_cap)``
bytes (``fit_line``: the parent refuses a longer line).
"""

import ctypes
import io
import json
import os
import resource
import sys

JOB = "job.json"


PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 4, 24, 38
CAP_VERSION_3 = 0x20080522
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
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
# What changes a file's metadata: Landlock governs reading, writing, making and removing
# files, not their mode, owner, times or extended attributes, and a root child owns root's
# files (or, as another uid, its own: the kernel cannot tell the program's folder from the
# rest), so each is refused everywhere. The inode-flag ioctls (chattr) and leases likewise.
METADATA_CALLS = ("chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown",
                  "fchownat", "utime", "utimes", "futimesat", "utimensat", "setxattr",
                  "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
                  "setxattrat", "removexattrat")
FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS, FS_IOC_FSSETXATTR = 0x40086602, 0x40046602, 0x401C5820
F_SETLEASE, F_SETPIPE_SZ = 1024, 1031
# What would outlive the program or hold memory its address-space limit does not count:
# System V IPC and POSIX message queues (kept by the kernel after exit; its own IPC
# namespace is the second line), memfds (RAM in files of no folder), and watches that reveal
# other folders' activity.
LASTING_CALLS = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl",
                 "semget", "semop", "semtimedop", "semctl", "ipc", "mq_open", "mq_unlink",
                 "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
                 "memfd_create", "memfd_secret", "inotify_init", "inotify_init1",
                 "inotify_add_watch", "fanotify_init", "fanotify_mark")
# System calls newer than some libseccomp releases know by name: their numbers in the
# generic table every architecture since Linux 5.1 shares (x86-64's and arm64's alike).
NEW_CALL_NUMBERS = {"fchmodat2": 452, "setxattrat": 463, "removexattrat": 466,
                    "memfd_secret": 447}
# A root child's uid outside: far above any allocated range (distributions give users and
# containers uids below 2**31), one per child so that no two programs share an owner.
UNUSED_UID_BASE = 0xF0000000


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


def private_ipc() -> str:
    """An IPC namespace of the child's own: System V segments, queues and semaphores (and
    POSIX message queues) made in it are the kernel's to free when the child exits, and no
    other process's are visible. seccomp refuses those calls too; this holds where a
    program's route around the filter would not. Returns "own namespace", or why not."""
    if _libc().unshare(CLONE_NEWIPC) != 0:
        return _errno_text("no IPC namespace")
    return "own namespace"


def _readable_by_anyone(path: str) -> bool:
    """Whether a user with no relation to ``path``'s owner can reach and read it (every
    folder above it searchable by others, the path itself readable by others)."""
    import stat
    path = os.path.abspath(path)
    try:
        mode = os.stat(path).st_mode
        if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
            return False
        parent = os.path.dirname(path)
        while parent != path:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            path, parent = parent, os.path.dirname(parent)
    except OSError:
        return False
    return True


def readable_dirs(exclude: tuple = ()) -> list:
    """What the program may read: the interpreter's own directories (its import path, less
    ``exclude``: ``landlock``'s and ``pyseccomp``'s, imported before the rules apply) and the
    system's shared libraries."""
    dirs = [p for p in sys.path if p not in exclude and os.path.isdir(p)]
    dirs += [p for p in ("/usr/lib", "/lib", "/lib64", "/usr/lib64") if os.path.isdir(p)]
    return list(dict.fromkeys(dirs))


def unprivileged(libdirs: list) -> str:
    """A root child becomes an unused uid and gid (``UNUSED_UID_BASE`` + its pid), so that
    root's files are not its own: their mode, owner and times are not its to change, and
    nothing a capability would override is left to it. Its working directory is given to
    that uid first. Done only where every folder the interpreter imports from is readable
    by any user (an interpreter under a private home stays root, with no capabilities and
    its metadata calls refused: said once in the parent's log). Returns the uid it runs as,
    or why it kept root's."""
    if os.geteuid() != 0:
        return str(os.geteuid())
    closed = [p for p in readable_dirs() + list(libdirs) if not _readable_by_anyone(p)]
    if closed:
        return f"kept root's, without capabilities: {closed[0]} is not readable by other users"
    uid = UNUSED_UID_BASE + os.getpid()
    try:
        os.chown(".", uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as e:  # a root without CAP_SETUID (some containers): the folder back to root
        os.chown(".", 0, 0)
        return f"kept root's, without capabilities: {e}"
    # A change of uid makes the process undumpable, which gives /proc/self to root and so
    # keeps it from writing its own user namespace's maps (private_folder).
    _libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    return str(uid)


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
    processes (nor a file owner that would receive them), no change to any file's metadata,
    nothing that outlives it or holds memory outside its limit (``METADATA_CALLS``,
    ``LASTING_CALLS``), no kernel-level escapes. Returns what ``scope_signals`` said."""
    sys.path[:0] = libdirs
    import landlock
    import pyseccomp as sc

    here = os.getcwd()
    readable = readable_dirs(exclude=tuple(libdirs))  # sys.path starts with libdirs here
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
    for name in METADATA_CALLS + LASTING_CALLS:
        number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if number < 0:  # unknown to this libseccomp (or absent on this architecture)
            number = NEW_CALL_NUMBERS.get(name, -1)
        if number >= 0:
            f.add_rule(eperm, number)
    clone_thread = 0x00010000
    f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, clone_thread, 0))
    f.add_rule(sc.ERRNO(38), "clone3")
    for name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add_rule(eperm, name, sc.Arg(0, sc.NE, pid))
    # The kernel reads fcntl's command and ioctl's request as 32-bit: the high half is masked
    # off here too, or 1 << 32 | F_SETOWN would pass the filter and still mean F_SETOWN.
    low = 0xFFFFFFFF
    for cmd in (F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE, F_SETPIPE_SZ):
        f.add_rule(eperm, "fcntl", sc.Arg(1, sc.MASKED_EQ, low, cmd))
    for request in (FIOSETOWN, SIOCSPGRP, FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS, FS_IOC_FSSETXATTR):
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


def line_bytes(out_cap: int) -> int:
    """The longest result line a child writes (``fit_line``) and its parent reads: an output
    of ``out_cap`` characters of ASCII text (JSON escapes newlines, quotes and tabs as two
    bytes), a JSON value of ``out_cap`` bytes and the error's 500 characters."""
    return 3 * int(out_cap) + (1 << 14)


def fit_line(result: dict, out_cap: int) -> str:
    """``result`` as one JSON line (ASCII: JSON's escapes) within ``line_bytes(out_cap)``: a
    return value whose JSON is longer than ``out_cap`` bytes is left out (``str`` of it is
    in "out"), and an output whose escaped form would not fit (control characters and text
    outside ASCII take 6 to 12 bytes a character) is cut to what does."""
    if result.get("json") is not None and len(json.dumps(result["json"])) > out_cap:
        result["json"] = None
    limit = line_bytes(out_cap)
    line = json.dumps(result)
    while len(line) >= limit and result["out"]:
        out = result["out"]
        result["out"] = out[:len(out) * (limit - (1 << 14)) // len(line)]
        line = json.dumps(result)
    return line


def main() -> None:
    with open(JOB, encoding="utf-8") as fh:
        job = json.load(fh)
    os.unlink(JOB)
    results = os.fdopen(int(sys.argv[1]), "w", buffering=1, encoding="ascii")
    libdirs = [] if sys.argv[2:] == ["--unconfined"] else sys.argv[2:]
    setup = {"uid": unprivileged(libdirs), "folder": private_folder(*job["folder"]),
             "ipc": private_ipc(), "signals": "not confined"}
    limit(job["rlimits"])
    if sys.argv[2:] != ["--unconfined"]:
        setup["signals"] = confine(libdirs)
    results.write(json.dumps({"setup": setup}) + "\n")
    out_cap = job["out_cap"]
    try:
        code = compile(job["code"], "<solution>", "exec")
    except (SyntaxError, ValueError) as e:
        for test in job["tests"]:
            results.write(fit_line({"i": test["i"], "ok": False, "out": "", "json": None,
                                    "err": f"SyntaxError: {e}"[:500]}, out_cap) + "\n")
        return
    for test in job["tests"]:
        results.write(fit_line(run_test(code, test, job["func_name"], out_cap), out_cap) + "\n")


if __name__ == "__main__":
    main()
