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
    return c
