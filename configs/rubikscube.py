"""The 2x2 Rubik's cube (RAGEN's ``rubikscube``, ``_10_rubikscube.yaml``): one scramble move
(the tag's ``scramble_depth: 1``), up to 4 moves a turn, 20 moves and 25 turns a game, the last
5 turns in the prompt; reward 1 when solved. RAGEN's moves, its non-physical B included
(``ragen_jax.envs.rubiks``); ``--config.env.params.moves=physical`` plays a real cube and
``--config.env.params.scramble_depth=5`` RAGEN's class default.

``python launch.py --config configs/rubikscube.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "rubikscube"
    c.env.params = dict(moves="ragen", scramble_depth=1, max_steps=20)
    # Depth 1 gives 12 levels, all of them among the validation seeds: validation replays them.
    c.rollout.held_out_val = False
    c.rollout.max_turn = 25
    c.rollout.max_actions_per_turn = 4
    c.rollout.max_actions_per_traj = 20
    # RAGEN's max_context_window 5; the tiny model sees the current stickers only (the whole state).
    base.limited_window(c, 1 if preset == "tiny" else 5)
    if preset == "tiny":
        c.rollout.response_length = 24  # four moves and the tags
    else:
        c.rollout.response_length = 500
    return c
