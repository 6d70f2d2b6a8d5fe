"""Sokoban's cell codes, moves and state: what the env, its level generator and its solver share."""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

# Fixed cells (``room_fixed``).
WALL, FLOOR, TARGET = 0, 1, 2
# Observation codes, RAGEN's ``room_state`` values plus 6 for the player standing on a target.
BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = 3, 4, 5, 6

ACTION_NAMES = ("Up", "Down", "Left", "Right")
DELTAS = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], np.int32)  # (row, col) per action


@struct.dataclass
class EnvState:
    room_fixed: jax.Array  # [H, W] int8: WALL, FLOOR or TARGET
    boxes: jax.Array  # [H, W] bool
    player: jax.Array  # [2] int32, (row, col)
    boxes_on_target: jax.Array  # int32
    time: jax.Array  # int32, env steps taken


@struct.dataclass
class EnvParams:
    max_steps: int = 100
    step_penalty: float = -0.1
    box_on_target_reward: float = 1.0
    box_off_target_penalty: float = -1.0
    finished_reward: float = 10.0
