"""The rollout's driver for host environments (``ragen_jax.envs.host``).

One ``HostEnv`` instance per row (kept between rollouts, replaced after a failure). Each turn
the rows' calls (a reset, building the row's instance first when it has none, or the row's
actions stepped in order until done) run where the family's ``isolation`` puts them:

* ``"process"`` (the default): in worker processes (``envs.host.processes.ProcessPool``),
  ``max_workers`` of them when the env is ``parallel_friendly``, else one. A call past
  ``step_timeout`` has its process killed, a crash of the process costs the call, and a fresh
  process takes the place (rebuilding its other rows' instances by replay). The policy sees a
  row's instance as a ``WorkerEnv`` handle.
* ``"thread"``: in this process on worker threads (``CallRunner``), ``max_workers`` when
  ``parallel_friendly``, else one. Python cannot stop a thread, so a call past the timeout is
  abandoned: its daemon thread keeps running inside the env (for a true hang, forever), it
  takes no further work, and a new thread takes its place, which may step other instances
  while the hung one is still inside env code. A hang that holds the GIL (a loop in C) stalls
  the watchdog too, and a segfault or ``os.abort()`` ends the run: threads are for envs that
  are trusted not to do either.

Threads and processes both pay off when steps wait (a subprocess, a server); only processes
run CPU-bound Python envs in parallel.

**Failures cost an episode, never the run.** A call that raises, returns something that is not
``(str, finite number, bool, dict)``, spends more than ``step_timeout`` seconds in one
``reset`` (with the instance's construction, when it needs one) or ``step``, or whose process
dies ends its episode: the error text (``"ValueError: ..."``, ``"timed out: ..."``, ``"its
worker process died (killed by SIGSEGV)"``; ``"reset: ..."`` for a reset) is recorded in
``StepOutcome.errors`` (the rollout writes it into the episode and its turn record, counts
``rollout/env_errors``, and training leaves the episode out of the update), the rewards of the
actions already stepped in that turn are kept in the record, and the instance is dropped (a
fresh one replaces it at the next reset).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ragen_jax.envs import levels
from ragen_jax.envs.host.env import HostEnv, reset_keys
from ragen_jax.envs.host.family import HostEnvFamily, HostState
from ragen_jax.envs.host.processes import (
    Histories,
    Job,
    ProcessPool,
    TurnProgress,
    checked_step,
    describe,
    names_of,
)
from ragen_jax.rollout.env_driver import ResetOutcome, StepOutcome, TurnActions

# A call gets ``mark``, to call right before each env call it makes (the timeout clock).
Call = Callable[[Callable[[], None]], Any]


@dataclasses.dataclass(eq=False)
class _Job:
    call: Call
    worker: _Worker | None = None
    step_started: float | None = None  # time.monotonic() at the current env call's start
    finished: bool = False
    value: Any = None
    error: str = ""


class _Worker(threading.Thread):
    """A daemon thread running jobs from the queue; once retired it exits after its job."""

    def __init__(self, jobs: queue.SimpleQueue, cond: threading.Condition):
        super().__init__(daemon=True, name="ragen_jax-host-env")
        self.jobs, self.cond, self.retired = jobs, cond, False

    def run(self) -> None:
        while not self.retired:
            job = self.jobs.get()
            if job is None:  # the runner was dropped
                return
            job.worker = self

            def mark(job: _Job = job) -> None:
                with self.cond:
                    job.step_started = time.monotonic()
                    self.cond.notify_all()

            try:
                job.value = job.call(mark)
            except BaseException as e:  # noqa: BLE001 - an env may raise anything, even SystemExit
                job.error = describe(e)
            with self.cond:
                job.finished = True
                self.cond.notify_all()


class CallRunner:
    """Runs calls on ``workers`` daemon threads; an env call running longer than ``timeout``
    seconds abandons its job (its thread is retired and replaced)."""

    def __init__(self, workers: int, timeout: float):
        self.timeout = float(timeout)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._workers = [self._spawn() for _ in range(workers)]
        # Idle workers wait on the queue: wake them to exit when the runner goes away.
        weakref.finalize(self, _stop_workers, self._jobs, self._workers)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._jobs, self._cond)
        worker.start()
        return worker

    def run(self, calls: Sequence[Call]) -> list[tuple[Any, str]]:
        """Runs every call; per call ``(value, "")`` or ``(None, error text)``."""
        jobs = [_Job(call) for call in calls]
        for job in jobs:
            self._jobs.put(job)
        pending = set(jobs)
        with self._cond:
            while pending:
                now = time.monotonic()
                for job in list(pending):
                    if job.finished:
                        pending.discard(job)
                    elif job.step_started is not None and now - job.step_started > self.timeout:
                        job.error = f"timed out: an env call took over {self.timeout:g} s"
                        pending.discard(job)
                        job.worker.retired = True  # it may still return; it takes no more jobs
                        # Retired threads that have since returned are gone: keep the live ones.
                        self._workers[:] = [w for w in self._workers if w.is_alive()]
                        self._workers.append(self._spawn())
                deadlines = [j.step_started + self.timeout for j in pending
                             if j.step_started is not None]
                if pending:
                    wait = max(min(deadlines) - now, 0.0) + 1e-3 if deadlines else None
                    self._cond.wait(timeout=wait)
        return [(None if job.error else job.value, job.error) for job in jobs]


def _stop_workers(jobs: queue.SimpleQueue, workers: list[_Worker]) -> None:
    for _ in workers:  # one stop per thread ever started (a retired one leaves its stop unread)
        jobs.put(None)


class _ThreadCalls:
    """Instances in this process, called on ``CallRunner`` threads (``isolation="thread"``)."""

    def __init__(self, family: HostEnvFamily):
        self.family = family
        self.instances: dict[int, HostEnv] = {}
        self.runner = CallRunner(family.workers, family.step_timeout)

    def reset(self, rows: Sequence[int], seeds: Sequence[int]) -> list[tuple[Any, str]]:
        results = self.runner.run([self._reset_call(self.instances.pop(b, None), s)
                                   for b, s in zip(rows, seeds, strict=True)])
        for b, (value, _) in zip(rows, results, strict=True):
            if value is not None:
                self.instances[b] = value[0]
        return results

    def _reset_call(self, env: HostEnv | None, seed: int) -> Call:
        # Building a missing instance is part of the call: a factory that raises or hangs
        # costs the episode (under the same timeout), as a reset that does.
        def call(mark: Callable[[], None]) -> tuple[HostEnv, str, tuple[str, ...], tuple[str, str]]:
            mark()
            nonlocal env
            if env is None:
                env = self.family.factory()
                if not isinstance(env, HostEnv):
                    raise TypeError(f"the env factory built a {type(env).__name__}, not a HostEnv")
            text = env.reset(seed)
            if not isinstance(text, str):
                raise TypeError(f"reset returned a {type(text).__name__}, not a str")
            return env, text, names_of(env), reset_keys(env, text)
        return call

    def step(self, rows: Sequence[int], actions: Sequence[Sequence[str]]
             ) -> list[tuple[TurnProgress, tuple[str, ...], str]]:
        turns = [_Turn(self.instances.pop(b), list(a)) for b, a in zip(rows, actions, strict=True)]
        out = []
        for b, turn, (_, error) in zip(rows, turns, self.runner.run(turns), strict=True):
            if not error:  # a failed instance is dropped: a fresh one replaces it at the next reset
                self.instances[b] = turn.env
            out.append((turn.progress, turn.names, error))
        return out

    def close(self) -> None:
        """Nothing to end: idle threads exit when the runner is dropped."""


@dataclasses.dataclass
class _Turn:
    """One row's actions of a turn, stepped in order; ``progress`` is kept when a later step
    fails."""

    env: HostEnv
    actions: list[str]
    progress: TurnProgress = dataclasses.field(default_factory=TurnProgress)
    names: tuple[str, ...] = ()  # the env's action names after the turn

    def __call__(self, mark: Callable[[], None]) -> _Turn:
        for action in self.actions:
            mark()
            self.progress.add(checked_step(self.env.step(action)))
            if self.progress.done:
                break
        self.names = names_of(self.env)  # in the call: a property that raises costs the episode
        return self


class WorkerEnv:
    """A row's instance living in a worker process, as policies see it (``HostState.env``)."""

    def __init__(self, calls: _ProcessCalls, row: int):
        self.calls, self.row = calls, row

    def random_action(self, rng: np.random.Generator) -> str:
        """The instance's ``random_action(rng)``, run in its worker; ``rng`` advances as if it
        had run here."""
        value, error = self.calls.random_action(self.row, rng)
        if error:
            raise RuntimeError(f"random_action in the env's worker process: {error}")
        action, rng.bit_generator.state = value
        return action


class _ProcessCalls:
    """Instances in worker processes (``isolation="process"``, ``envs.host.processes``)."""

    def __init__(self, family: HostEnvFamily):
        self.pool = ProcessPool(family.factory, family.workers, family.step_timeout,
                                memory_limit_mb=family.memory_limit_mb)
        self.histories = Histories()

    def reset(self, rows: Sequence[int], seeds: Sequence[int]) -> list[tuple[Any, str]]:
        jobs = self.pool.run([Job("reset", b, (s,)) for b, s in zip(rows, seeds, strict=True)])
        out = []
        for b, job in zip(rows, jobs, strict=True):
            self.histories.reset_done(job)
            if job.error:
                out.append((None, job.error))
                continue
            text, names, keys = job.value
            out.append(((WorkerEnv(self, b), text, names, keys), ""))
        return out

    def step(self, rows: Sequence[int], actions: Sequence[Sequence[str]]
             ) -> list[tuple[TurnProgress, tuple[str, ...], str]]:
        jobs = [self.histories.job("step", b, (list(texts),))
                for b, texts in zip(rows, actions, strict=True)]
        out = []
        for job in self.pool.run(jobs):
            self.histories.step_done(job)
            out.append((job.progress or TurnProgress(), job.value or (), job.error))
        return out

    def random_action(self, row: int, rng: np.random.Generator) -> tuple[Any, str]:
        job = self.pool.run([self.histories.job("random_action", row, (rng,))])[0]
        self.histories.call_done(job)
        return job.value, job.error

    def close(self) -> None:
        """Ends the worker processes."""
        self.pool.close()


class HostEnvDriver:
    """Resets and steps one ``HostEnv`` instance per row (see the module docstring)."""

    def __init__(self, family: HostEnvFamily):
        self.family = family
        self.calls = _ThreadCalls(family) if family.isolation == "thread" else _ProcessCalls(family)
        self.held_out: frozenset[int] = frozenset()

    def close(self) -> None:
        """Ends the worker processes (``isolation="process"``; they also end when the driver
        is garbage collected or the interpreter exits)."""
        self.calls.close()

    def hold_out(self, ids: np.ndarray) -> None:
        self.held_out = frozenset(int(i) for i in np.asarray(ids, np.uint64).reshape(-1))

    def reset(self, seeds: Sequence[int] | np.ndarray, *, held_out: bool = True) -> ResetOutcome:
        """Row ``b`` reset with ``seeds[b]``; states are ``HostState``s (an object array). A
        row whose held-out id (its ``HostEnv.holdout_key``, by default its level's) is held out
        is reset again with ``levels.redraw_seed(seed, 1)``, 2, ... until it is not (the rows
        still held out after ``levels.MAX_DRAWS``: an error)."""
        seeds = [int(s) for s in np.asarray(seeds).reshape(-1)]
        n = len(seeds)
        states = np.empty(n, object)
        ids, holdout = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
        redraws, errors = np.zeros(n, np.int32), {}
        rows = list(range(n))
        for draw in range(levels.MAX_DRAWS + 1):
            results = self.calls.reset(rows, [levels.redraw_seed(seeds[b], draw) for b in rows])
            again = []
            for b, (value, error) in zip(rows, results, strict=True):
                redraws[b] = draw
                if error:
                    errors[b] = f"reset: {error}"
                    states[b] = HostState("", (), None)
                    continue
                env, text, names, (level, held) = value
                states[b] = HostState(text, names, env)
                ids[b], holdout[b] = levels.text_level_id(level), levels.text_level_id(held)
                if held_out and int(holdout[b]) in self.held_out:
                    again.append(b)
            rows = again
            if not rows:
                break
        if rows:
            raise levels.held_out_error(self.family.name, [seeds[b] for b in rows])
        return ResetOutcome(states, states, errors, ids, redraws, holdout=holdout)

    def step(self, states: Any, actions: dict[int, TurnActions],
             keys: jax.Array) -> tuple[Any, Any, StepOutcome]:
        """Steps each listed row's action texts on its instance (``keys`` unused: a host env's
        randomness comes from its seed)."""
        del keys
        n = len(states)
        rows = sorted(actions)
        results = self.calls.step(rows, [list(actions[b].texts) for b in rows])
        states = states.copy()
        reward, executed, effective = np.zeros(n, np.float32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        last_effective, terminated, truncated, success = (np.zeros(n, bool) for _ in range(4))
        errors = {}
        for b, (p, names, error) in zip(rows, results, strict=True):
            reward[b], executed[b], effective[b] = p.reward, p.executed, p.effective
            last_effective[b] = p.last_effective
            text = p.text if p.executed else states[b].text
            if error:
                errors[b] = error
                states[b] = HostState(text, (), None)
                continue
            terminated[b] = p.done and not p.truncated
            truncated[b] = p.truncated
            success[b] = p.success
            states[b] = HostState(text, names, states[b].env)
        return states, states, StepOutcome(reward, executed, effective, last_effective,
                                           terminated, truncated, success, errors)
