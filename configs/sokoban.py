"""Sokoban (RAGEN's ``SimpleSokoban``: 6x6, one box, 10 actions over at most 5 turns).

``python launch.py --config configs/sokoban.py[:preset]``. A random tiny model starts from a
solver-mixture prior (``base.solver_mixture_prior``; README, "Starting policy").
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "sokoban"
    c.env.params = dict(dim_room=(6, 6), num_boxes=1, max_steps=100)
    if preset == "tiny":
        base.solver_mixture_prior(c)
        # A random model cannot read RAGEN's ~260-token instructions: one line instead, which
        # the single-turn rows start with. The rows teach reading the board: the solver's moves
        # (share 1) on 4096 levels of their own (the mixture's groups repeat ~1000 levels).
        c.rollout.system_template = "Sokoban: push the box X onto the target O. Answer with {actions}."
        c.warmstart.turn_solver_share = 1.0
        c.warmstart.turn_episodes = 4096
        c.warmstart.turn_system_prompt = True
    return c
