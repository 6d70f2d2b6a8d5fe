"""Environments: pure-JAX text environments (gymnax style: Sokoban, FrozenLake, Bandit, 2048,
the 2x2 Rubik's cube) and host environments (Python, free-text actions: Countdown, Sudoku,
MetaMathQA, DeepCoder, Search, GEM's and TextWorld's games, any Gymnasium env, an env served
over HTTP).

The names below load on first use: a host env's worker process (``envs.host.processes``)
imports only the host env it builds (``ragen_jax.envs.countdown`` needs no JAX), so it starts
light and never forks JAX's threads.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Bandit": "bandit", "TextEnv": "base", "Countdown": "countdown", "DeepCoder": "deepcoder",
    "FrozenLake": "frozenlake", "GemEnv": "gem_env",
    "Game2048": "game2048", "GymnasiumEnv": "gymnasium_env", "HostEnv": "host",
    "HostEnvFamily": "host", "HostState": "host", "MetaMathQA": "metamathqa",
    "REGISTRY": "registry", "make": "registry", "register": "registry",
    "RubiksCube": "rubiks", "Search": "search", "Sokoban": "sokoban", "Sudoku": "sudoku",
    "TextWorldEnv": "textworld_env",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
