"""Optimal moves for one host-side state of an env: the oracle of the solver-mixture
warm-start (``rollout.scripted.SolverMixturePolicy``).

``solve(env, state)`` dispatches to the env's BFS solver (``frozenlake_solver``,
``sokoban.solver``, ``rubiks_solver``) or, for 2048, which has no practical optimal solver,
to the scripted baseline's next move (``game2048_baseline``: a one-move list); another env
takes part by defining a ``solve(state)`` method with the same contract. The solvers live
apart from the env modules, which they import.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ragen_jax.envs import frozenlake_solver, game2048_baseline, rubiks_solver
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.game2048 import Game2048, host_moves
from ragen_jax.envs.rubiks import RubiksCube
from ragen_jax.envs.sokoban import solver as sokoban_solver
from ragen_jax.envs.sokoban.env import Sokoban

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
    if isinstance(env, RubiksCube):
        return rubiks_solver.solve(np.asarray(state.stickers), env.moves)
    if isinstance(env, Game2048):
        board = np.asarray(state.board)
        if not any(host_moves(board, a) for a in range(env.num_actions)):
            return None  # the game is over
        return [int(_corner_action(env)(board))]
    custom = getattr(env, "solve", None)
    if callable(custom):
        return custom(state)
    raise NotImplementedError(f"no solver for {type(env).__name__}: define solve(state) on it")


_CORNER: dict[int, Any] = {}


def _corner_action(env: Game2048) -> Any:
    """The baseline's move, jitted once per board size (it depends on the env only by it)."""
    if env.size not in _CORNER:
        _CORNER[env.size] = jax.jit(lambda board: game2048_baseline.corner_action(env, board))
    return _CORNER[env.size]
