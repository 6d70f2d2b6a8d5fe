"""Optimal Sokoban solutions by breadth-first search (host side, plain Python).

Used to check that generated levels are solvable, to measure their difficulty (the length of
an optimal solution, in env steps), and as an oracle policy in tests and evaluation.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ragen_jax.envs.sokoban.types import DELTAS, TARGET, WALL


def solve(room_fixed: np.ndarray, boxes: np.ndarray, player: np.ndarray,
          max_states: int = 2_000_000) -> list[int] | None:
    """Shortest action sequence (ids 0-3: Up, Down, Left, Right) that puts every box on a
    target, or ``None`` if there is none within ``max_states`` explored states.

    ``room_fixed`` [H, W] (wall 0, floor 1, target 2), ``boxes`` [H, W] bool, ``player`` (r, c).
    """
    room_fixed = np.asarray(room_fixed)
    height, width = room_fixed.shape
    walls = {(int(r), int(c)) for r, c in np.argwhere(room_fixed == WALL)}
    targets = frozenset((int(r), int(c)) for r, c in np.argwhere(room_fixed == TARGET))
    start = ((int(player[0]), int(player[1])),
             frozenset((int(r), int(c)) for r, c in np.argwhere(np.asarray(boxes))))
    if start[1] <= targets:
        return []
    parents: dict = {start: None}
    queue = deque([start])
    moves = [tuple(int(v) for v in d) for d in DELTAS]
    while queue and len(parents) < max_states:
        state = queue.popleft()
        (pr, pc), box_set = state
        for action, (dr, dc) in enumerate(moves):
            one = (pr + dr, pc + dc)
            if one in walls or not (0 <= one[0] < height and 0 <= one[1] < width):
                continue
            new_boxes = box_set
            if one in box_set:
                two = (one[0] + dr, one[1] + dc)
                if two in walls or two in box_set:
                    continue
                new_boxes = (box_set - {one}) | {two}
            nxt = (one, new_boxes)
            if nxt in parents:
                continue
            parents[nxt] = (state, action)
            if new_boxes <= targets:
                path = []
                while parents[nxt] is not None:
                    nxt, a = parents[nxt]
                    path.append(a)
                return path[::-1]
            queue.append(nxt)
    return None
