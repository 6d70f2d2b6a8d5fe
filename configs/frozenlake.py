"""FrozenLake (RAGEN's: 4x4, frozen-tile probability 0.9, slippery: the move succeeds w.p. 0.8).

``python launch.py --config configs/frozenlake.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "frozenlake"
    c.env.params = dict(size=4, p=0.9, is_slippery=True, success_rate=0.8, max_steps=100)
    if preset == "tiny":
        # A random tiny model starts from a solver-mixture prior (README, "Starting policy").
        base.solver_mixture_prior(c)
        # RAGEN's CoordFrozenLake as its `_3_frozen_lake.yaml` trains it: coordinate text and
        # deterministic moves (success_rate=1). With the grid a random-init model made no
        # progress in 22 steps (validation 0.234 -> 0.242); with coordinates but slippery moves
        # none in 20 (0.211 -> 0.199): a slip punishes the right move 20% of the time.
        c.env.params.observation_format = "coord"
        c.env.params.success_rate = 1.0
    return c
