"""Optimal 2x2 cube solutions by breadth-first search (host side, NumPy).

Used as the oracle of the solver-mixture warm-start and in tests. The search is layered and
vectorised: a layer's states are expanded by all 12 moves at once (one gather), encoded as
base-6 integers (24 colours fit an int64: 6**24 < 2**63) and deduplicated with
``np.unique``/``np.isin``. It works for either move set (``rubiks.move_table``) because it
tests each state for "every face one colour" rather than looking for one goal state. Its cost
grows ~9x per depth: RAGEN's scramble depths (1 and 5) take milliseconds to a fraction of a
second, depth 6 a few seconds and ~0.5 GB (depth 7 would need several GB); ``max_depth``
bounds it.
"""

from __future__ import annotations

import numpy as np

from ragen_jax.envs.rubiks import move_table

DEFAULT_MAX_DEPTH = 6
_POWERS = 6 ** np.arange(24, dtype=np.int64)


def _codes(stickers: np.ndarray) -> np.ndarray:
    """[N, 24] colours -> [N] int64 base-6 codes."""
    return stickers.astype(np.int64) @ _POWERS


def _solved(stickers: np.ndarray) -> np.ndarray:
    faces = stickers.reshape(-1, 6, 4)
    return np.all(faces == faces[:, :, :1], axis=(1, 2))


def solve(stickers: np.ndarray, moves: str = "ragen",
          max_depth: int = DEFAULT_MAX_DEPTH) -> list[int] | None:
    """A shortest move sequence (action ids 0-11) that leaves every face one colour, ``[]``
    when the cube is already solved, ``None`` when none is at most ``max_depth`` long."""
    table = move_table(moves)
    start = np.asarray(stickers, np.int8).reshape(1, 24)
    if _solved(start)[0]:
        return []
    seen = _codes(start)
    layers = [(start, np.zeros(1, np.int64), np.zeros(1, np.int64))]  # (states, parent, move)
    for _ in range(max_depth):
        states = layers[-1][0]
        children = states[:, table].reshape(-1, 24)  # [N * 12, 24], move-major per parent
        codes = _codes(children)
        codes, first = np.unique(codes, return_index=True)
        fresh = ~np.isin(codes, seen, assume_unique=True)
        first = first[fresh]
        children = children[first]
        layers.append((children, first // len(table), first % len(table)))
        done = np.flatnonzero(_solved(children))
        if done.size:
            return _path(layers, int(done[0]))
        seen = np.union1d(seen, codes[fresh])
    return None


def _path(layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]], index: int) -> list[int]:
    """The moves from the root to state ``index`` of the last layer."""
    path = []
    for depth in range(len(layers) - 1, 0, -1):
        _, parent, move = layers[depth]
        path.append(int(move[index]))
        index = int(parent[index])
    return path[::-1]
