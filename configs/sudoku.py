"""Sudoku (RAGEN's tags ``SimpleSudoku`` and ``MediumSudoku``): fill the grid one placement at a
time, ``place 5 at row 2 col 3`` (+1 the solution's value, +0.5 legal but wrong, -0.1 invalid,
+10 solved). A host environment (``ragen_jax.envs.sudoku``): unique-solution puzzles generated
from the seed.

The default trains SimpleSudoku (4x4, easy: 10 givens) and, with a real model, also validates
MediumSudoku (9x9, medium: 30 givens; its ~250-token boards do not fit the tiny preset's
1024-token trajectories). ``--config.env.params.size=9 --config.env.params.difficulty=medium
--config.env.tag=MediumSudoku`` trains the 9x9 one.

``python launch.py --config configs/sudoku.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "sudoku"
    c.env.tag = "SimpleSudoku"
    c.env.params = dict(size=4, difficulty="easy", max_steps=100)
    c.rollout.max_actions_per_traj = 20  # RAGEN's SimpleSudoku (MediumSudoku: 30)
    if preset == "tiny":
        c.rollout.response_length = 48  # two placements are ~30 tokens
    else:
        c.env.val_extra = dict(MediumSudoku=dict(size=9, difficulty="medium"))
    return c
