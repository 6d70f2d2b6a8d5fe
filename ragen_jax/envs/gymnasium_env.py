"""A Gymnasium environment as a host environment.

``GymnasiumEnv(make_env, ...)`` wraps one ``gymnasium.Env`` (built by ``make_env()``, one per
episode slot) in the ``HostEnv`` contract:

* **Observation text**: ``render(obs, env)`` when given; else the observation itself when it is
  a ``str`` (a ``Text`` space); else ``env.render()`` when the env was made with
  ``render_mode="ansi"``; else ``str(obs)``.
* **Actions**: a ``Discrete(n)`` space reads action names (``action_names``, default ``"0"`` ..
  ``str(n - 1)``, matched case-insensitively by the rollout's parser, as RAGEN's
  ``action_lookup``); a ``Text`` space takes the answer part as written; any other space needs
  ``parse_action(text) -> action`` (raise ``ValueError`` for text that is no action: the step
  then costs ``invalid_reward`` and the episode goes on).
* **Episodes**: ``reset(seed)`` is ``env.reset(seed=seed)`` (Gymnasium's seeding: the same
  seed, the same episode); ``done`` is ``terminated or truncated``; ``info["truncated"]`` is
  Gymnasium's truncation; ``info["success"]`` is the env's ``info["success"]`` or
  ``info["is_success"]`` if it reports one, else ``terminated and reward > 0``.

Register it under a name so a config can use it (see README "Adding an environment")::

    register("frozenlake-gym", lambda **kw: GymnasiumEnv(
        lambda: gymnasium.make("FrozenLake-v1", render_mode="ansi", **kw),
        action_names=("Left", "Down", "Right", "Up")))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import numpy as np

from ragen_jax.envs.host.env import HostEnv


class GymnasiumEnv(HostEnv):
    """One ``gymnasium.Env`` behind the host-env contract (see the module docstring)."""

    def __init__(self, make_env: Callable[[], gymnasium.Env], *,
                 action_names: Sequence[str] | None = None,
                 render: Callable[[Any, gymnasium.Env], str] | None = None,
                 parse_action: Callable[[str], Any] | None = None, instruction: str = "",
                 invalid_reward: float = 0.0, parallel_friendly: bool = False):
        self.env = make_env()
        self.render_fn, self.parse_action = render, parse_action
        self.invalid_reward = float(invalid_reward)
        self.instruction = instruction
        self.parallel_friendly = parallel_friendly
        space = self.env.action_space
        if isinstance(space, gymnasium.spaces.Discrete):
            names = tuple(action_names or (str(space.start + i) for i in range(space.n)))
            if len(names) != space.n:
                raise ValueError(f"{len(names)} action names for a Discrete({space.n}) space")
            self.action_names = names
            self._lookup = {n.strip().lower(): space.start + i for i, n in enumerate(names)}
        elif not isinstance(space, gymnasium.spaces.Text) and parse_action is None:
            raise ValueError(f"a {type(space).__name__} action space needs parse_action")

    @property
    def name(self) -> str:
        spec = getattr(self.env, "spec", None)
        return spec.id if spec is not None else type(self.env.unwrapped).__name__

    def reset(self, seed: int) -> str:
        obs, _ = self.env.reset(seed=int(seed))
        return self.text(obs)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        try:
            act = self.to_action(action)
        except ValueError as e:
            info = {"success": False, "action_is_effective": False, "action_is_valid": False,
                    "invalid_action": str(e)}
            return f"Invalid action: {e}", self.invalid_reward, False, info
        obs, reward, terminated, truncated, info = self.env.step(act)
        success = info.get("success", info.get("is_success", terminated and reward > 0))
        out = {"success": bool(success), "truncated": bool(truncated and not terminated),
               "action_is_effective": bool(info.get("action_is_effective", True))}
        return self.text(obs), float(reward), bool(terminated or truncated), out

    def to_action(self, text: str) -> Any:
        """The env action ``text`` names (``ValueError`` if none)."""
        if self.parse_action is not None:
            return self.parse_action(text)
        if self.action_names:
            key = text.strip().lower()
            if key not in self._lookup:
                raise ValueError(f"unknown action {text!r}")
            return self._lookup[key]
        if not self.env.action_space.contains(text):
            raise ValueError(f"{text!r} is not in the action space")
        return text

    def text(self, obs: Any) -> str:
        """The observation as the agent reads it (see the module docstring)."""
        if self.render_fn is not None:
            return str(self.render_fn(obs, self.env))
        if isinstance(obs, str):
            return obs
        if getattr(self.env, "render_mode", None) == "ansi":
            return str(self.env.render())
        return str(obs.tolist() if isinstance(obs, np.ndarray) else obs)

    def random_action(self, rng: np.random.Generator) -> str:
        if self.action_names:
            return super().random_action(rng)
        self.env.action_space.seed(int(rng.integers(2**31)))
        return str(self.env.action_space.sample())
