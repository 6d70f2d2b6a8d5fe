"""The 2x2 Rubik's cube (RAGEN's ``rubikscube``, ``_10_rubikscube.yaml``) with held-out
validation: three scramble moves (RAGEN's tag scrambles one), up to 4 moves a turn, 20 moves
and 25 turns a game, the last 5 turns in the prompt; reward 1 when solved. RAGEN's moves, its
non-physical B included (``ragen_jax.envs.rubiks``); ``--config.env.params.moves=physical``
plays a real cube.

Why depth 3: validation levels are never trained on (``rollout.val.held_out``, by level
identity), and RAGEN's depth 1 has only 12 distinct scrambles, every one of them among the 256
validation seeds, so no training level would be left. Three independent moves give 1,016
distinct scrambles (none of them solved, unlike depth 2's 8%); the 256 validation seeds meet
~200 of them, which carry ~36% of the depth-3 draws; training redraws those and plays the
other ~800 at the same depth distribution. Every scramble is solved in at most 3 moves: one
turn's 4-move budget suffices.

RAGEN's own setting (depth 1, validation replays training levels) is
``configs/rubikscube_depth1.py``.

``python launch.py --config configs/rubikscube.py[:preset]``.
"""

from configs import base

SCRAMBLE_DEPTH = 3


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "rubikscube"
    c.env.params = dict(moves="ragen", scramble_depth=SCRAMBLE_DEPTH, max_steps=20)
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
