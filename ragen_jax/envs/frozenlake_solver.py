"""Shortest FrozenLake paths by breadth-first search (host side, plain Python).

The oracle of the solver-mixture warm-start (``rollout.scripted``) and of tests. A path is
optimal for a deterministic lake (``success_rate=1`` or ``is_slippery=False``); on a
slippery lake it is the shortest intended route, not the MDP's optimal policy.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ragen_jax.envs.frozenlake import DELTAS


def solve(holes: np.ndarray, player: np.ndarray, goal: np.ndarray) -> list[int] | None:
    """Shortest action sequence (ids 0-3: Left, Down, Right, Up) from ``player`` to ``goal``
    over non-hole cells, ``[]`` when already there, ``None`` when there is no path or the
    player is in a hole. ``holes`` [n, n] bool, ``player`` and ``goal`` (row, col)."""
    holes = np.asarray(holes, bool)
    n_rows, n_cols = holes.shape
    start, end = (int(player[0]), int(player[1])), (int(goal[0]), int(goal[1]))
    if holes[start]:
        return None
    parents: dict = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == end:
            path = []
            while parents[cell] is not None:
                cell, action = parents[cell]
                path.append(action)
            return path[::-1]
        for action, (dr, dc) in enumerate(DELTAS.tolist()):
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < n_rows and 0 <= nxt[1] < n_cols and not holes[nxt] and nxt not in parents:
                parents[nxt] = (cell, action)
                queue.append(nxt)
    return None
