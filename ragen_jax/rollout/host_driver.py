"""The rollout's driver for host environments (``ragen_jax.envs.host``).

One ``HostEnv`` instance per row (kept between rollouts, replaced after a failure). Each turn
the rows' calls (a reset, building the row's instance first when it has none, or the row's
actions stepped in order until done) run on worker threads: ``max_workers`` of them when the
env is ``parallel_friendly``, else one, so a non-thread-safe env is still stepped (and built)
by one thread at a time. Threads pay off when steps wait (a subprocess, a server); a
CPU-bound Python env holds the GIL and gains nothing from them.

**Failures cost an episode, never the run.** A call that raises, returns something that is not
``(str, finite number, bool, dict)``, or spends more than ``step_timeout`` seconds in one
``reset`` (with the instance's construction, when it needs one) or ``step`` ends its episode:
the error text (``"ValueError: ..."``, ``"timed out: ..."``; ``"reset: ..."`` for a reset) is
recorded in ``StepOutcome.errors`` (the rollout writes it into the episode and its turn
record, and counts ``rollout/env_errors``), the rewards of the actions already stepped in
that turn are kept, and the instance is dropped (a fresh one replaces it at the next reset).
Python cannot stop a thread, so a hung call's thread is abandoned: it is a daemon thread (it
never blocks the interpreter's exit), it takes no further work, and a new thread takes its
place.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ragen_jax.envs import levels
from ragen_jax.envs.host import HostEnv, HostEnvFamily, HostState
from ragen_jax.rollout.env_driver import ResetOutcome, StepOutcome, TurnActions

MAX_ERROR_CHARS = 500  # an error text is cut to this many characters

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


def describe(e: BaseException) -> str:
    """``"Type: message"``, cut to ``MAX_ERROR_CHARS``."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text[:MAX_ERROR_CHARS]


@dataclasses.dataclass
class _Turn:
    """One row's actions of a turn, stepped in order; its fields are the progress so far (kept
    when a later step fails)."""

    env: HostEnv
    actions: list[str]
    text: str
    reward: float = 0.0
    executed: int = 0
    effective: int = 0
    done: bool = False
    truncated: bool = False
    success: bool = False
    names: tuple[str, ...] = ()  # the env's action names after the turn

    def __call__(self, mark: Callable[[], None]) -> _Turn:
        for action in self.actions:
            mark()
            text, reward, done, info = _checked_step(self.env.step(action))
            self.text, self.executed = text, self.executed + 1
            self.reward += reward
            self.effective += bool(info.get("action_is_effective", True))
            if done:
                self.done, self.success = True, bool(info.get("success", False))
                self.truncated = bool(info.get("truncated", False))
                break
        self.names = _names(self.env)  # in the call: a property that raises costs the episode
        return self


def _checked_step(out: Any) -> tuple[str, float, bool, Mapping[str, Any]]:
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


class HostEnvDriver:
    """Resets and steps one ``HostEnv`` instance per row (see the module docstring)."""

    def __init__(self, family: HostEnvFamily):
        self.family = family
        self.instances: list[HostEnv | None] = []
        self.runner = CallRunner(family.workers, family.step_timeout)
        self.held_out: frozenset[int] = frozenset()

    def hold_out(self, ids: np.ndarray) -> None:
        self.held_out = frozenset(int(i) for i in np.asarray(ids, np.uint64).reshape(-1))

    def reset(self, seeds: Sequence[int] | np.ndarray, *, held_out: bool = True) -> ResetOutcome:
        """Row ``b`` reset with ``seeds[b]``; states are ``HostState``s (an object array). A
        row whose level is held out is reset again with ``levels.redraw_seed(seed, 1)``, 2, ...
        until it is not (the rows still held out after ``levels.MAX_DRAWS``: an error)."""
        seeds = [int(s) for s in np.asarray(seeds).reshape(-1)]
        while len(self.instances) < len(seeds):
            self.instances.append(None)
        n = len(seeds)
        states = np.empty(n, object)
        ids, redraws, errors = np.zeros(n, np.uint64), np.zeros(n, np.int32), {}
        rows = list(range(n))
        for draw in range(levels.MAX_DRAWS + 1):
            calls = [self._reset_call(self.instances[b], levels.redraw_seed(seeds[b], draw)) for b in rows]
            again = []
            for b, (value, error) in zip(rows, self.runner.run(calls), strict=True):
                redraws[b] = draw
                if error:
                    errors[b] = f"reset: {error}"
                    self.instances[b] = None
                    states[b] = HostState("", (), None)
                    continue
                env, text, names, key = value
                self.instances[b] = env
                states[b] = HostState(text, names, env)
                ids[b] = levels.text_level_id(key)
                if held_out and int(ids[b]) in self.held_out:
                    again.append(b)
            rows = again
            if not rows:
                break
        if rows:
            raise levels.held_out_error(self.family.name, [seeds[b] for b in rows])
        return ResetOutcome(states, states, errors, ids, redraws)

    def _reset_call(self, env: HostEnv | None, seed: int) -> Call:
        # Building a missing instance is part of the call: a factory that raises or hangs
        # costs the episode (under the same timeout), as a reset that does.
        def call(mark: Callable[[], None]) -> tuple[HostEnv, str, tuple[str, ...], str]:
            mark()
            nonlocal env
            if env is None:
                env = self.family.factory()
                if not isinstance(env, HostEnv):
                    raise TypeError(f"the env factory built a {type(env).__name__}, not a HostEnv")
            text = env.reset(seed)
            if not isinstance(text, str):
                raise TypeError(f"reset returned a {type(text).__name__}, not a str")
            key = env.level_key()
            return env, text, _names(env), text if key is None else str(key)
        return call

    def step(self, states: Any, actions: dict[int, TurnActions],
             keys: jax.Array) -> tuple[Any, Any, StepOutcome]:
        """Steps each listed row's action texts on its instance (``keys`` unused: a host env's
        randomness comes from its seed)."""
        del keys
        n = len(states)
        rows = sorted(actions)
        turns = [_Turn(states[b].env, list(actions[b].texts), states[b].text) for b in rows]
        results = self.runner.run(turns)
        states = states.copy()
        reward, executed, effective = np.zeros(n, np.float32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        terminated, truncated, success = (np.zeros(n, bool) for _ in range(3))
        errors = {}
        for b, turn, (_, error) in zip(rows, turns, results, strict=True):
            reward[b], executed[b], effective[b] = turn.reward, turn.executed, turn.effective
            if error:
                errors[b] = error
                self.instances[b] = None
                states[b] = HostState(turn.text, (), None)
                continue
            terminated[b] = turn.done and not turn.truncated
            truncated[b] = turn.truncated
            success[b] = turn.success
            states[b] = HostState(turn.text, turn.names, turn.env)
        return states, states, StepOutcome(reward, executed, effective, terminated, truncated,
                                           success, errors)


def _names(env: HostEnv) -> tuple[str, ...]:
    return tuple(str(n) for n in (env.action_names or ()))
