"""``HostEnvFamily`` is what ``ragen_jax.envs.make`` returns for a host env: it builds one
instance per episode slot (a ``HostEnv`` keeps its episode in ``self``) and gives the rollout
the same small surface as a JAX ``TextEnv`` (``name``, ``action_names_for``, ``render_text``);
the rollout resets and steps its instances with ``ragen_jax.rollout.host_driver``. The
rollout's per-row "state" of a host env is a ``HostState``: the last observation text, the
action names in force and the instance.

(The contract a ``HostEnv`` meets: ``ragen_jax.envs.host.env``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ragen_jax.envs.host import processes
from ragen_jax.envs.host.env import HostEnv


@dataclasses.dataclass(frozen=True)
class HostState:
    """One episode slot's state as the rollout sees it (and passes to policies)."""

    text: str  # the last observation
    action_names: tuple[str, ...]  # the names in force; () = free text
    env: Any  # the instance playing it, or its handle in a worker (None after a failed reset)


ISOLATIONS = ("process", "thread")
DESCRIBE_TIMEOUT = 60.0  # seconds building the prototype in a worker may take (no step_timeout given)


class HostEnvFamily:
    """Instances of one host env (``factory()`` builds one) and their batch options.

    ``parallel_friendly``, ``max_workers`` and ``step_timeout`` default to the prototype's
    class attributes. ``isolation`` (default ``"process"``) says where instances run:
    ``"process"``, in worker processes (``envs.host.processes``: a hang is killed, a crash costs
    its episode; ``memory_limit_mb`` caps how much a worker's address space may grow), or
    ``"thread"``, in this process on watchdog threads (no processes; a hung call is abandoned,
    not stopped, and a crash or a GIL-holding hang takes the run down). The prototype, which
    gives the defaults, is built where the instances run: under ``isolation="process"`` in a
    worker, under ``step_timeout`` (or ``DESCRIBE_TIMEOUT``). ``ragen_jax.rollout.host_driver.
    HostEnvDriver`` resets and steps a batch of instances.
    """

    def __init__(self, factory: Callable[[], HostEnv], *, parallel_friendly: bool | None = None,
                 max_workers: int | None = None, step_timeout: float | None = None,
                 isolation: str | None = None, memory_limit_mb: float | None = None):
        self.factory = factory
        self.isolation = "process" if isolation is None else isolation
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"env.params.isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.memory_limit_mb = None if memory_limit_mb is None else float(memory_limit_mb)
        if self.memory_limit_mb is not None and (self.isolation != "process" or self.memory_limit_mb <= 0):
            raise ValueError(f"env.params.memory_limit_mb must be > 0 and needs isolation='process', "
                             f"got {memory_limit_mb!r} with isolation={self.isolation!r}")
        self.prototype: HostEnv | None = None
        if self.isolation == "process":
            self.info = processes.describe_env(
                factory, DESCRIBE_TIMEOUT if step_timeout is None else float(step_timeout),
                memory_limit_mb=self.memory_limit_mb)
        else:
            self.prototype = factory()
            if not isinstance(self.prototype, HostEnv):
                raise TypeError(f"a host env factory must build a HostEnv, got {type(self.prototype)}")
            proto = self.prototype
            self.info = {"name": proto.name, "instruction": proto.instruction,
                         "parallel_friendly": proto.parallel_friendly,
                         "max_workers": proto.max_workers, "step_timeout": proto.step_timeout}
        info = self.info
        self.parallel_friendly = info["parallel_friendly"] if parallel_friendly is None else bool(parallel_friendly)
        self.max_workers = int(info["max_workers"] if max_workers is None else max_workers)
        self.step_timeout = float(info["step_timeout"] if step_timeout is None else step_timeout)
        if self.max_workers < 1 or self.step_timeout <= 0:
            raise ValueError(f"{info['name']}: max_workers must be >= 1 and step_timeout > 0, got "
                             f"{self.max_workers} and {self.step_timeout}")

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def instruction(self) -> str:
        return self.info["instruction"]

    @property
    def workers(self) -> int:
        """Threads or processes stepping instances: ``max_workers`` if parallel-friendly,
        else 1."""
        return self.max_workers if self.parallel_friendly else 1

    def action_names_for(self, state: HostState) -> tuple[str, ...]:
        return state.action_names

    def render_text(self, state: HostState) -> str:
        return state.text

    def random_action(self, state: HostState, rng: np.random.Generator) -> str:
        """A random well-formed action for ``state`` (its instance's ``random_action``)."""
        if state.env is None:
            raise ValueError("no env instance behind this state (its reset failed)")
        return state.env.random_action(rng)
