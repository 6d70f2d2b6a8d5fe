"""2048 (RAGEN's ``game_2048``, ``_9_2048.yaml``): one slide a turn, at most 700 a game, the
last 5 turns in the prompt; reward 0.1 * log2(merged + 1) per merging move.

``python launch.py --config configs/game2048.py[:preset]``. The tiny preset's random model
plays 20 turns a game, each turn showing the current board only: the board is the whole
state, and 20 boards would not fit its 1024-token rows.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "game2048"
    c.env.params = dict(size=4, max_steps=700)
    c.rollout.max_turn = 800
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 700
    # RAGEN's max_context_window 5; the tiny model sees the current board only (the whole state).
    base.limited_window(c, 1 if preset == "tiny" else 5)
    if preset == "tiny":
        c.rollout.max_turn = 20
        c.warmstart.legal_actions = True  # the format start's moves change the board
    else:
        c.rollout.response_length = 256
        c.rollout.max_model_len = 8192
    return c
