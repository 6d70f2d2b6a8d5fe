"""Host env instances in worker processes: a hang or a crash costs one call, never the run.

A ``ProcessPool`` owns ``size`` worker processes (``forkserver``: each is forked from a small
server process that has this module, and with it numpy, already imported and nothing else, so a
fresh worker is ready in milliseconds and never inherits the trainer's threads, JAX or
accelerator state). A worker holds the env instances of the rows homed on it (row ``b`` lives
on worker ``b % size``) and runs one call at a time: build an instance, ``reset``, the actions
of a turn, ``random_action``. Before each env call it tells the parent, which restarts that
call's clock; so the parent, in its own process, sees every deadline whatever the env does:

* a call past ``timeout`` seconds (sleeping, blocked on I/O, or spinning in C with the GIL
  held) gets its worker killed (``SIGKILL``);
* a worker that dies (a segfault, ``os.abort()``, the kernel's OOM killer, a ``MemoryError``
  under ``memory_limit_mb``) costs the call it was running;
* either way the call's error is returned for its row and a fresh worker takes the slot.

The other rows homed on a killed worker lose their instances with it, not their episodes: the
parent keeps every live row's seed and actions, and the fresh worker rebuilds such a row's
instance by replaying them (``reset(seed)`` then each action, the host-env contract's "the same
seed, the same episode"; a replay that does not end on the row's last observation text is that
row's error, not a silent divergence).

Workers are ended by ``close()``, when the pool is garbage collected, at interpreter exit, and,
if the parent dies without any of those (``SIGKILL``), by the kernel: every worker asks for
``SIGKILL`` when its parent, the fork server, exits, which it does when the trainer's process
goes (Linux's ``PR_SET_PDEATHSIG``).

The factory is pickled to the workers with cloudpickle (``pickle_factory``), so a lambda or a
closure works as well as a class; whatever it refers to by module must be importable there.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import math
import multiprocessing
import pickle
import resource
import signal
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from ragen_jax.envs.host.env import HostEnv, reset_keys

MAX_ERROR_CHARS = 500  # an error text is cut to this many characters
START_TIMEOUT = 60.0  # seconds a job may wait for its worker to start and take it
_PR_SET_PDEATHSIG = 1


def describe(e: BaseException) -> str:
    """``"Type: message"``, cut to ``MAX_ERROR_CHARS``."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text[:MAX_ERROR_CHARS]


def pickle_factory(factory: Callable[[], HostEnv], name: str) -> bytes:
    """``factory`` as bytes for the workers (cloudpickle: a lambda or a closure travels by
    value, what it names from a module by reference, so that module must be importable in the
    worker); a one-line ``ValueError`` when it cannot be pickled."""
    import cloudpickle

    try:
        return cloudpickle.dumps(factory)
    except Exception as e:  # noqa: BLE001 - pickling raises PicklingError, AttributeError, TypeError
        raise ValueError(
            f"env {name}: isolation='process' sends the env's factory to worker processes, and it "
            f"cannot be pickled ({describe(e)}); set env.params.isolation='thread'") from None


# -- the worker side ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Asks the kernel for SIGKILL when this process's parent exits (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _vm_size() -> int:
    """This process's virtual memory size in bytes (0 where /proc is missing)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    return 0


def _limit_memory(megabytes: float) -> None:
    """Lets this process's address space grow by at most ``megabytes`` from now on (an
    allocation past it fails: ``MemoryError`` in Python, a crash in some C code)."""
    limit = _vm_size() + int(megabytes * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class _Worker:
    """The worker process's state: its instances by row, and the messages it sends."""

    def __init__(self, conn: Connection, factory: bytes):
        self.conn, self._factory = conn, factory
        self.instances: dict[int, HostEnv] = {}

    @property
    def factory(self) -> Callable[[], HostEnv]:
        """The unpickled factory (here, so that a module missing in the worker is the call's
        error, not a silent exit)."""
        if isinstance(self._factory, bytes):
            self._factory = pickle.loads(self._factory)
        return self._factory

    def mark(self) -> None:
        """An env call starts now (the parent restarts its clock)."""
        self.conn.send(("mark",))

    def build(self) -> HostEnv:
        self.mark()
        env = self.factory()
        if not isinstance(env, HostEnv):
            raise TypeError(f"the env factory built a {type(env).__name__}, not a HostEnv")
        return env

    def reset(self, row: int, seed: int) -> tuple[str, tuple[str, ...], tuple[str, str]]:
        env = self.instances.pop(row, None)
        if env is None:
            env = self.build()
        self.mark()
        text = env.reset(seed)
        if not isinstance(text, str):
            raise TypeError(f"reset returned a {type(text).__name__}, not a str")
        names = names_of(env)
        self.instances[row] = env
        return text, names, reset_keys(env, text)

    def step(self, row: int, actions: Sequence[str],
             replay: tuple[int, Sequence[str], str] | None) -> tuple[str, ...]:
        if replay is not None:
            self.instances.pop(row, None)
            self._replay(row, *replay)
        env = self.instances.pop(row)  # back once the turn succeeded: an error drops it
        progress = TurnProgress()
        for action in actions:
            self.mark()
            progress.add(checked_step(env.step(action)))
            self.conn.send(("progress", progress))
            if progress.done:
                break
        names = names_of(env)
        self.instances[row] = env
        return names

    def _replay(self, row: int, seed: int, actions: Sequence[str], text: str) -> None:
        """Rebuilds ``row``'s instance after its worker was replaced: its reset and actions."""
        env = self.build()
        self.mark()
        last = env.reset(seed)
        for action in actions:
            self.mark()
            last = checked_step(env.step(action))[0]
        if last != text:
            raise RuntimeError("replaying the episode after its worker process was replaced "
                               "gave another observation (the env is not deterministic given "
                               "its seed and actions)")
        self.instances[row] = env

    def random_action(self, row: int, rng: Any,
                      replay: tuple[int, Sequence[str], str] | None) -> tuple[str, Any]:
        if replay is not None:
            self.instances.pop(row, None)
            self._replay(row, *replay)
        self.mark()
        return str(self.instances[row].random_action(rng)), rng.bit_generator.state

    def info(self) -> dict[str, Any]:
        env = self.build()
        return {"name": env.name, "instruction": str(env.instruction),
                "action_names": names_of(env), "parallel_friendly": bool(env.parallel_friendly),
                "max_workers": int(env.max_workers), "step_timeout": float(env.step_timeout)}

    def serve(self) -> None:
        handlers = {"reset": self.reset, "step": self.step, "random_action": self.random_action,
                    "drop": lambda row: self.instances.pop(row, None) and None,
                    "info": lambda row: self.info()}
        while True:
            try:
                job = self.conn.recv()
            except (EOFError, OSError):  # the parent closed its end: nothing more to do
                return
            if job is None:
                return
            kind, row, args = job
            try:
                reply = ("ok", handlers[kind](row, *args))
            except BaseException as e:  # noqa: BLE001 - an env may raise anything, even SystemExit
                self.instances.pop(row, None)
                reply = ("err", describe(e), _config_error(e))
            if not self._send(row, reply):
                return

    def _send(self, row: int, reply: tuple) -> bool:
        """Sends ``reply`` (an error in its place when it cannot be pickled); False when the
        parent is gone (a broken pipe: nobody to answer)."""
        try:
            self.conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            self.instances.pop(row, None)
            return self._send(row, ("err", f"its result cannot be sent back: {describe(e)}"))
        except OSError:
            return False
        return True


def _config_error(e: BaseException) -> tuple[str, str] | None:
    """``(builtin type name, message)`` of a ``ValueError`` or ``TypeError`` (what a
    constructor raises for bad parameters: ``describe_env`` raises it again as such)."""
    for kind in (ValueError, TypeError):
        if isinstance(e, kind):
            return kind.__name__, str(e)[:MAX_ERROR_CHARS]
    return None


def _worker_main(conn: Connection, factory: bytes, memory_limit_mb: float | None) -> None:
    """A worker process's entry point."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if memory_limit_mb:
        _limit_memory(memory_limit_mb)
    _Worker(conn, factory).serve()


# -- results shared by both sides --------------------------------------------------------------


@dataclasses.dataclass
class TurnProgress:
    """A turn's results so far (kept when a later action of the turn fails)."""

    text: str = ""
    reward: float = 0.0
    executed: int = 0
    effective: int = 0
    last_effective: bool = False  # the last executed action was effective (RAGEN's turn keeps its last info)
    done: bool = False
    truncated: bool = False
    success: bool = False

    def add(self, out: tuple[str, float, bool, Mapping[str, Any]]) -> None:
        """Counts one checked step's ``(text, reward, done, info)``."""
        text, reward, done, info = out
        self.text, self.executed = text, self.executed + 1
        self.reward += reward
        self.last_effective = bool(info.get("action_is_effective", True))
        self.effective += self.last_effective
        if done:
            self.done, self.success = True, bool(info.get("success", False))
            self.truncated = bool(info.get("truncated", False))


def checked_step(out: Any) -> tuple[str, float, bool, Mapping[str, Any]]:
    """A step's return value, checked: ``(str, finite float, bool, mapping)``."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise TypeError(f"step must return (text, reward, done, info), got {type(out).__name__}")
    text, reward, done, info = out
    if not isinstance(text, str):
        raise TypeError(f"step returned a {type(text).__name__} observation, not a str")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step returned a non-finite reward {reward}")
    if not isinstance(info, Mapping):
        raise TypeError(f"step returned a {type(info).__name__} info, not a dict")
    return text, reward, bool(done), info


def names_of(env: HostEnv) -> tuple[str, ...]:
    """The env's action names in force, as strings."""
    return tuple(str(n) for n in (env.action_names or ()))


# -- the parent side ---------------------------------------------------------------------------


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context (spawn where there is none), its server preloading this module."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


@dataclasses.dataclass(eq=False)
class Job:
    """One call for one row: what to run, and (once run) its reply."""

    kind: str
    row: int
    args: tuple
    # The row's instance history (seed, actions, last text) and the worker generation that
    # holds its instance: sent along when the row's worker is another one by the time the
    # job is sent (a kill earlier in the same batch counts), so the worker can rebuild it.
    replay: tuple | None = None
    generation: int = -1
    ran_on: int = -1  # the generation of the worker that ran the job
    done: bool = False
    value: Any = None
    error: str = ""
    raised: tuple[str, str] | None = None  # a ValueError or TypeError the env raised: type, message
    progress: TurnProgress | None = None  # a step's results so far


@dataclasses.dataclass(eq=False)
class _Slot:
    """One worker process of the pool (``process`` None: none running)."""

    process: Any = None
    conn: Connection | None = None
    generation: int = 0  # how many processes this slot has started
    job: Job | None = None
    deadline: float = 0.0
    marked: bool = False  # the job's first env call has started (its clock is the timeout)
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)


class ProcessPool:
    """Worker processes running env calls (see the module docstring).

    ``run(jobs)`` runs a batch of calls, each on its row's home worker, at most one per worker
    at a time, and returns when every call has a reply or an error. A job that carries a
    ``replay`` sends it when its row's worker was replaced since ``job.generation``.
    """

    def __init__(self, factory: Callable[[], HostEnv], size: int, timeout: float, *,
                 memory_limit_mb: float | None = None):
        self.timeout, self.memory_limit_mb = float(timeout), memory_limit_mb
        self.factory = pickle_factory(factory, getattr(factory, "__name__", repr(factory)))
        self.ctx = _context()
        self.slots = [_Slot() for _ in range(max(1, int(size)))]
        self.restarts = 0  # workers replaced after a timeout or a crash
        self._finalizer = weakref.finalize(self, _end_all, self.slots)

    def home(self, row: int) -> _Slot:
        return self.slots[row % len(self.slots)]

    def live_processes(self) -> int:
        return sum(s.process is not None and s.process.is_alive() for s in self.slots)

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None]

    def run(self, jobs: Sequence[Job]) -> list[Job]:
        """Runs every job on its row's home worker; each ends with ``value`` or ``error``."""
        self.submit(jobs)
        while not all(job.done for job in jobs):
            self.pump()
        return list(jobs)

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queues ``jobs`` on their rows' home workers (``pump`` runs them)."""
        for job in jobs:
            self.home(job.row).queue.append(job)

    def pump(self, wake: Sequence[Any] = ()) -> None:
        """One round: sends queued jobs to idle workers, waits for a message, a worker's exit,
        the earliest deadline or one of ``wake`` (file descriptors or connections; with no job
        running, only for those), then reads what came and ends the jobs past their
        deadline."""
        for slot in self.slots:
            while slot.job is None and slot.queue:  # a send that fails ends its job at once
                self._send(slot, slot.queue.popleft())
        busy = [s for s in self.slots if s.job is not None]
        if not busy and not wake:
            return
        timeout = max(0.0, min(s.deadline for s in busy) - time.monotonic()) if busy else None
        ready = wait([s.conn for s in busy] + [s.process.sentinel for s in busy] + list(wake),
                     timeout=timeout)
        for slot in busy:
            if slot.conn in ready or slot.process.sentinel in ready:
                self._receive(slot)
        now = time.monotonic()
        for slot in busy:
            if slot.job is not None and now > slot.deadline:
                self._fail(slot, f"timed out: an env call took over {self.timeout:g} s "
                                 f"(its worker process was killed)" if slot.marked else
                           f"timed out: its worker process took no call in {START_TIMEOUT:g} s")

    def _send(self, slot: _Slot, job: Job) -> None:
        if slot.process is not None and not slot.process.is_alive():
            # It died while idle (the OOM killer, or an env's own thread): the job has not run
            # and its row can be replayed, so a fresh worker runs it instead of it failing.
            _end(slot)
            self.restarts += 1
        if slot.process is None:
            self._start(slot)
        slot.job, slot.deadline, slot.marked = job, time.monotonic() + START_TIMEOUT, False
        job.ran_on = slot.generation
        args = job.args
        if job.kind in ("step", "random_action"):
            args += (job.replay if job.generation != slot.generation else None,)
        try:
            slot.conn.send((job.kind, job.row, args))
        except (OSError, ValueError) as e:  # the worker died between two jobs
            self._fail(slot, f"its worker process was gone ({describe(e)})")

    def _start(self, slot: _Slot) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(target=_worker_main, name="ragen_jax-host-env", daemon=True,
                                   args=(child, self.factory, self.memory_limit_mb))
        process.start()
        child.close()
        slot.process, slot.conn, slot.generation = process, parent, slot.generation + 1

    def _receive(self, slot: _Slot) -> None:
        """Reads the slot's messages: marks restart the clock; a reply ends the job."""
        job = slot.job
        try:
            while slot.conn.poll():
                message = slot.conn.recv()
                if message[0] == "mark":
                    slot.deadline, slot.marked = time.monotonic() + self.timeout, True
                elif message[0] == "progress":
                    job.progress = message[1]
                else:
                    job.done = True
                    job.value, job.error = (message[1], "") if message[0] == "ok" else (None, message[1])
                    job.raised = message[2] if message[0] == "err" else None
                    slot.job = None
                    return
        except (EOFError, OSError):
            pass
        if not slot.process.is_alive():
            slot.process.join(timeout=1.0)
            self._fail(slot, f"its worker process died ({_exit_reason(slot.process.exitcode)})")

    def _fail(self, slot: _Slot, error: str) -> None:
        """Ends the slot's job with ``error`` and kills its worker (a fresh one comes with the
        next job)."""
        job = slot.job
        if job is not None:
            job.done, job.value, job.error = True, None, error
        slot.job = None
        _end(slot)
        self.restarts += 1

    def close(self) -> None:
        """Ends every worker (idempotent)."""
        self._finalizer()


@dataclasses.dataclass
class History:
    """What rebuilds a row's instance on a fresh worker: its reset's seed, the actions played
    since, the last observation, and the worker generation that holds the instance."""

    seed: int
    actions: list[str]
    text: str
    generation: int


class Histories:
    """The live rows' histories, kept from each call's outcome, and the jobs that carry them.

    A row has a history from a successful reset until a call on it fails (the worker drops a
    failed instance) or it is dropped; a job on a row without one carries no replay. A replay
    repeats the reset and the steps, not ``random_action`` calls: those must leave the episode
    as it was (the host-env contract's "a random well-formed action in the current state")."""

    def __init__(self) -> None:
        self.rows: dict[int, History] = {}

    def job(self, kind: str, row: int, args: tuple) -> Job:
        """A call on ``row``'s instance, with what rebuilds it should its worker be new."""
        h = self.rows.get(row)
        if h is None:
            return Job(kind, row, args)
        return Job(kind, row, args, replay=(h.seed, list(h.actions), h.text), generation=h.generation)

    def reset_done(self, job: Job) -> None:
        """Records a finished ``reset`` job (its row starts afresh, or has no instance)."""
        self.rows.pop(job.row, None)
        if not job.error:
            self.rows[job.row] = History(job.args[0], [], job.value[0], job.ran_on)

    def step_done(self, job: Job) -> None:
        """Records a finished ``step`` job: the actions it executed extend the history; an
        error (or a step on a row without an instance) ends it."""
        h = self.rows.pop(job.row, None)
        if h is None:  # the worker had no instance either (a KeyError): say why
            job.error = "no env instance for this row (its reset or its last call failed)"
            return
        if job.error:
            return
        progress = job.progress or TurnProgress()
        h.actions.extend(job.args[0][:progress.executed])
        h.text = progress.text if progress.executed else h.text
        h.generation = job.ran_on
        self.rows[job.row] = h

    def call_done(self, job: Job) -> None:
        """Records another finished job on a row (``random_action``): its instance is on the
        job's worker now, or (an error) gone."""
        h = self.rows.get(job.row)
        if h is not None and job.error:
            del self.rows[job.row]
        elif h is not None:
            h.generation = job.ran_on


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _end(slot: _Slot) -> None:
    """Kills the slot's worker and waits for it (a worker that is killed cannot refuse)."""
    if slot.process is not None:
        if slot.process.is_alive():
            slot.process.kill()
        slot.process.join(timeout=5.0)
        with contextlib.suppress(ValueError):
            slot.process.close()
    if slot.conn is not None:
        slot.conn.close()
    slot.process = slot.conn = None


def _end_all(slots: list[_Slot]) -> None:
    for slot in slots:
        with contextlib.suppress(Exception):  # at interpreter exit, end what can be ended
            _end(slot)


def describe_env(factory: Callable[[], HostEnv], timeout: float, *,
                 memory_limit_mb: float | None = None) -> dict[str, Any]:
    """The prototype's options (``name``, ``instruction``, ``action_names``,
    ``parallel_friendly``, ``max_workers``, ``step_timeout``), built in a worker process under
    ``timeout``: a constructor that hangs or crashes is a one-line ``RuntimeError``, one that
    raises a ``ValueError`` or ``TypeError`` (bad parameters) raises it here with its message."""
    pool = ProcessPool(factory, 1, timeout, memory_limit_mb=memory_limit_mb)
    try:
        job = pool.run([Job("info", 0, ())])[0]
    finally:
        pool.close()
    if job.raised is not None:  # the constructor refused its parameters: the same error here
        kind, message = job.raised
        raise {"ValueError": ValueError, "TypeError": TypeError}[kind](message)
    if job.error:
        raise RuntimeError(f"building the env in a worker process failed: {job.error}")
    return job.value

