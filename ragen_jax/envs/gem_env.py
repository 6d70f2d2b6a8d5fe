"""GEM (``gem-llm``, "a Gym for Generalist LLMs") environments as host environments.

``GemEnv(env_id)`` plays ``gem.make(env_id)`` through the host-env contract: ``reset(seed)``
returns GEM's first observation followed by its ``info["suffix"]`` (the line GEM's own prompt
wrappers append: the board, "Enter your next guess.", ...), and ``step(action)`` passes the
model's answer to GEM. GEM's game envs read an action only inside ``\\boxed{...}``; the model
answers inside ``<answer>`` like in every other env here, and the adapter wraps an answer that
has no ``\\boxed{`` into one. Rewards are GEM's; ``info["success"]``: the episode terminated
(not truncated) with a positive reward (GEM reports no success flag).

Which GEM envs run here without downloads (gem-llm 0.1.0): the ``game:*`` suites
GuessTheNumber, Mastermind, Minesweeper, TowerofHanoi, Sudoku, Sokoban, Game2048,
FifteenPuzzle and Crosswords (each ``-easy`` / ``-hard`` / ``-random``). Not offline: Hangman,
Wordle and WordSearch (they load NLTK's ``words`` corpus, a download), and the ``math:*``,
``code:*``, ``qa:*``, ``logic:*`` and ``eval:*`` suites (Hugging Face datasets). The ``rg:*``
(reasoning-gym) envs generate offline but ignore the reset seed (each reset takes the next item
of a fixed stream), which breaks the rollout's "same seed, same episode" contract; the adapter
refuses them.

Level identity (held-out validation): the env's simple attributes after reset (numbers,
strings and containers of them: GuessTheNumber's hidden number, Sudoku's boards, Minesweeper's
mines), not the first observation: that often hides the level (every GuessTheNumber game opens
alike) and may vary without it (its example guess is drawn at random). An env whose state lives
in other objects has the same key for every level, so holding its validation out fails loudly
(``HeldOutError``) rather than passing silently; one with no simple attribute falls back to
its first observation.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ragen_jax.envs.host.env import HostEnv

_DIGITS = "0123456789"


def _simple(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-able data when it is made of numbers, strings and containers only;
    else None (random generators, datasets, functions are not part of a level)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if depth < 4 and isinstance(value, (list, tuple)):
        items = [_simple(v, depth + 1) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) else items
    if depth < 4 and isinstance(value, (set, frozenset)):
        return _simple(sorted(value, key=repr), depth)
    if depth < 4 and isinstance(value, dict):
        out = {str(k): _simple(v, depth + 1) for k, v in value.items()}
        return None if any(out[str(k)] is None and v is not None for k, v in value.items()) else out
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return value.tolist()
    return None


class GemEnv(HostEnv):
    """One GEM env per episode slot (see the module docstring)."""

    def __init__(self, env_id: str, instruction: str = "", **kwargs: Any):
        try:
            import gem
        except ImportError:
            raise ImportError("GEM envs need gem-llm: pip install 'ragen_jax[gem]'") from None
        if env_id.startswith("rg:"):
            raise ValueError(f"{env_id}: reasoning-gym envs ignore the reset seed (each reset takes "
                             f"the next item of a fixed stream), so episodes cannot be replayed")
        self.env_id = env_id
        self.env = gem.make(env_id, **kwargs)
        self.instruction = instruction or (
            f"You are playing {env_id.split(':', 1)[-1]} (a GEM environment). Give one move per "
            f"answer, e.g. <answer>4</answer>.")
        self.first = ""

    @property
    def name(self) -> str:
        return self.env_id.split(":", 1)[-1].split("-", 1)[0]

    @staticmethod
    def _text(obs: Any, info: dict[str, Any]) -> str:
        suffix = info.get("suffix") if isinstance(info, dict) else None
        return f"{obs}\n{suffix}" if suffix else str(obs)

    def reset(self, seed: int) -> str:
        obs, info = self.env.reset(seed=int(seed))
        self.first = self._text(obs, info)
        return self.first

    def level_key(self) -> str | None:
        env = getattr(self.env, "unwrapped", self.env)
        attrs = {k: v for k, v in ((k, _simple(v)) for k, v in sorted(vars(env).items())) if v is not None}
        return json.dumps(attrs, sort_keys=True) if attrs else self.first

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        move = action if "\\boxed{" in action else f"\\boxed{{{action.strip()}}}"
        obs, reward, terminated, truncated, info = self.env.step(move)
        reward = float(reward)
        out = {"success": bool(terminated and not truncated and reward > 0),
               "truncated": bool(truncated and not terminated)}
        return self._text(obs, info), reward, bool(terminated or truncated), out

    def random_action(self, rng: np.random.Generator) -> str:
        """A random digit (the answer format; GEM games take numbers or short words)."""
        return _DIGITS[int(rng.integers(1, 10))]
