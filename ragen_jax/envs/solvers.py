"""Optimal moves for one host-side state of an env: the oracle of the solver-mixture
warm-start (``rollout.scripted.SolverMixturePolicy``).

``solve(env, state)`` dispatches to the env's BFS solver (``frozenlake_solver``,
``sokoban_solver``); another env takes part by defining a ``solve(state)`` method with the
same contract. The solvers live apart from the env modules, which they import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ragen_jax.envs import frozenlake_solver, sokoban_solver
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.sokoban import Sokoban

SOKOBAN_MAX_STATES = 200_000  # search budget per Sokoban state (6x6 one-box levels need far fewer)


def solve(env: Any, state: Any) -> list[int] | None:
    """An optimal action sequence (env action ids) from one unbatched ``state``: ``[]`` when
    the task is done, ``None`` when it cannot be finished (or the search budget ran out)."""
    if isinstance(env, FrozenLake):
        return frozenlake_solver.solve(np.asarray(state.holes), np.asarray(state.player),
                                       np.asarray(state.goal))
    if isinstance(env, Sokoban):
        return sokoban_solver.solve(np.asarray(state.room_fixed), np.asarray(state.boxes),
                                    np.asarray(state.player), max_states=SOKOBAN_MAX_STATES)
    custom = getattr(env, "solve", None)
    if callable(custom):
        return custom(state)
    raise NotImplementedError(f"no solver for {type(env).__name__}: define solve(state) on it")
