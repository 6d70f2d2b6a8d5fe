"""A plain-Python Sokoban level generator with RAGEN's semantics, as a baseline for
``bench_envs.py``.

gym-sokoban's ``generate_room`` differs from the generator RAGEN runs in three ways: RAGEN's
depth-first reverse search tries only the four pull actions, counts a "box swap" only when the
pulled box changes (gym-sokoban passes the stale ``last_pull`` down the recursion, so every
pull counts), takes ``search_depth`` from the env config (gym-sokoban: always 300), and
finishes with a short random walk of the player. This module keeps gym-sokoban's topology and
placement functions and re-implements RAGEN's search and walk, so our JAX generator can be
compared with both at the same settings.
"""

from __future__ import annotations

import random

import numpy as np
from gym_sokoban.envs import room_utils

DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))


def _reverse_search(room_state: np.ndarray, room_structure: np.ndarray, search_depth: int):
    targets = [tuple(int(v) for v in t) for t in np.argwhere(room_structure == 2)]
    num_boxes = len(targets)
    best = {"score": -1, "state": room_state, "mapping": {t: t for t in targets}}
    explored: set[bytes] = set()

    def dfs(state, mapping, swaps, last, ttl):
        ttl -= 1
        if ttl <= 0 or len(explored) >= 300_000:
            return
        key = state.tobytes()
        if key in explored:
            return
        displacement = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in mapping.items())
        score = swaps * displacement if np.count_nonzero(state == 2) == num_boxes else 0
        if score > best["score"]:
            best.update(score=score, state=state.copy(), mapping=dict(mapping))
        explored.add(key)
        (pr, pc), = np.argwhere(state == 5)
        for dr, dc in DELTAS:
            nr, nc = pr + dr, pc + dc
            new_state, new_mapping, new_last = state, mapping, last
            if state[nr, nc] in (1, 2):
                new_state = state.copy()
                new_state[pr, pc] = room_structure[pr, pc]
                new_state[nr, nc] = 5
                br, bc = pr - dr, pc - dc
                if new_state[br, bc] in (3, 4):
                    new_state[pr, pc] = 3
                    new_state[br, bc] = room_structure[br, bc]
                    new_mapping = dict(mapping)
                    for t, b in mapping.items():
                        if b == (br, bc):
                            new_mapping[t] = (int(pr), int(pc))
                            new_last = t
            dfs(new_state, new_mapping, swaps + (new_last != last), new_last, ttl)

    dfs(room_state, {t: t for t in targets}, 0, (-1, -1), search_depth)
    return best


def _wander(room_state: np.ndarray, room_structure: np.ndarray, p_move: float) -> np.ndarray:
    if random.random() > p_move:
        return room_state
    (pr, pc), = np.argwhere(room_state == 5)
    visited = [(pr, pc)]
    for step in range(3):
        options = [(pr + dr, pc + dc) for dr, dc in DELTAS
                   if room_state[pr + dr, pc + dc] in (1, 2) and (pr + dr, pc + dc) not in visited]
        if not options:
            break
        nr, nc = random.choice(options)
        room_state[pr, pc] = room_structure[pr, pc]
        room_state[nr, nc] = 5
        pr, pc = nr, nc
        visited.append((pr, pc))
        if step == 2 or random.random() > 0.5:
            break
    return room_state


def generate(dim: tuple[int, int], num_boxes: int, search_depth: int, seed: int):
    """One RAGEN-style level: (room_fixed, boxes [H, W] bool, player (r, c)) or None on failure
    (RAGEN would retry from another seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (gym-sokoban draws from the global RNG)
    num_steps = int(1.7 * (dim[0] + dim[1]))
    for _ in range(4):
        room = room_utils.room_topology_generation(dim, 0.35, num_steps)
        try:
            room = room_utils.place_boxes_and_player(room, num_boxes=num_boxes, second_player=False)
        except RuntimeError:
            continue
        structure = room.copy()
        structure[structure == 5] = 1
        state = room.copy()
        state[state == 2] = 4
        best = _reverse_search(state, structure, search_depth)
        displacement = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in best["mapping"].items())
        if displacement > 0:
            state = best["state"]
            state[state == 3] = 4
            state = _wander(state, structure, 0.8 if displacement == 1 else 0.5)
            return structure, (state == 3) | (state == 4), np.argwhere(state == 5)[0]
    return None
