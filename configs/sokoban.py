"""Sokoban (RAGEN's ``SimpleSokoban``: 6x6, one box, 10 actions over at most 5 turns).

``python launch.py --config configs/sokoban.py[:preset]``. The tiny preset's warm-start
uses fewer, shorter batches than the bandit's (multi-turn trajectories are ~700 tokens, five
answers each).
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "sokoban"
    c.env.params = dict(dim_room=(6, 6), num_boxes=1, max_steps=100)
    if preset == "tiny":
        c.warmstart.steps = 60
        c.warmstart.batch_size = 8
        # Random answers teach answers that ignore the state (I(X;Z) = 0 from step 1, and RL
        # never left it in 20 minutes); random *legal* moves give a reason to read it. The
        # solver-mixture start is an option (warmstart.solver_share; see configs/frozenlake.py).
        c.warmstart.legal_actions = True
    return c
