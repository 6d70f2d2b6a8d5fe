"""The ``HostEnv`` contract: a Python environment that is not pure JAX, played by the same rollout.

RAGEN's environments share one string-in, ``(obs, reward, done, info)``-out contract; most of
them (Countdown, Sudoku, anything that parses free text, runs a program or calls a server)
cannot be jitted. A ``HostEnv`` is that contract:

* ``reset(seed) -> text``: the same seed gives the same episode (the rollout resets every env
  of a group with the group's seed);
* ``step(action) -> (text, reward, done, info)``: ``action`` is one action of the model's
  answer (the answer split on ``||``; an action name when the env has ``action_names``);
  ``info["success"]`` says whether a finished episode was won; ``info["truncated"]`` (optional)
  that it ended by a step limit rather than by the task; ``info["action_is_effective"]``
  (optional, default True) that the action changed something.

Optional parts: ``action_names`` (a fixed list the parser matches case-insensitively, as
RAGEN's ``action_lookup``; empty = free text, every non-empty answer part is passed to
``step``), ``instruction`` (the system message's env instruction), ``random_action`` (a
well-formed action for the format warm-start), and RAGEN's ``parallel_friendly`` /
``max_workers`` (whether different instances may step in parallel threads or processes, and
how many), plus ``step_timeout`` (seconds one ``reset`` or ``step`` call may take before its
episode is ended as an env error).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class HostEnv:
    """Base class of a host environment (see the module docstring for the contract).

    Subclasses implement ``reset`` and ``step`` and may set the class attributes below.
    Instances are never shared between episodes running at the same time, so an env only has
    to be thread-safe across instances, and only if it sets ``parallel_friendly``.
    """

    action_names: tuple[str, ...] = ()  # fixed action names; () = free-text actions
    instruction: str = ""  # the system message's env instruction
    parallel_friendly: bool = False  # different instances may step in parallel threads (RAGEN)
    max_workers: int = 8  # threads when parallel_friendly (RAGEN: max_workers)
    step_timeout: float = 30.0  # seconds a reset or step may take; past it the episode fails

    @property
    def name(self) -> str:
        """The default metric tag (RAGEN's env tag): the class name."""
        return type(self).__name__

    def reset(self, seed: int) -> str:
        """Starts the episode of ``seed`` (the same seed, the same episode); returns its text."""
        raise NotImplementedError(f"{self.name} must implement reset(seed)")

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Plays one action: ``(text, reward, done, info)`` with ``info["success"]``."""
        raise NotImplementedError(f"{self.name} must implement step(action)")

    def level_key(self) -> str | None:
        """What identifies the level of the episode just reset (``envs.levels``: validation
        levels are held out of training by it). None (the default): the reset's text."""
        return None

    def holdout_key(self) -> str | None:
        """What held-out validation keeps out of training for the episode just reset, where
        that is coarser than the level because an episode can walk from one level's start
        onto another's (a served Sokoban: its room). None (the default): the level."""
        return None

    def random_action(self, rng: np.random.Generator) -> str:
        """A well-formed action in the current state, drawn at random (never a solver): the
        format warm-start's answers. Default: one of ``action_names``."""
        if not self.action_names:
            raise NotImplementedError(f"{self.name}: free-text env without random_action(rng)")
        return str(self.action_names[int(rng.integers(len(self.action_names)))])


def reset_keys(env: HostEnv, text: str) -> tuple[str, str]:
    """``(level, held out)``: the identity keys of the episode ``env`` just reset to ``text``,
    ``level_key()`` (None: the text) and ``holdout_key()`` (None: the level's key)."""
    level = env.level_key()
    level = text if level is None else str(level)
    held = env.holdout_key()
    return level, level if held is None else str(held)
