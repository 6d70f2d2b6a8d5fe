"""FrozenLake (RAGEN's: 4x4, frozen-tile probability 0.9, slippery: the move succeeds w.p. 0.8).

``python launch.py --config configs/frozenlake.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "frozenlake"
    c.env.params = dict(size=4, p=0.9, is_slippery=True, success_rate=0.8, max_steps=100)
    if preset == "tiny":
        # A random tiny model starts from a solver-mixture prior (docs/models.md, "Starting policy").
        base.solver_mixture_prior(c)
        # From RAGEN's `_3_frozen_lake.yaml` (CoordFrozenLake) its deterministic moves
        # (success_rate=1: a slip would punish the right move 20% of the time) and its
        # coordinate lines, but not its grid map or instruction: `coord` text (a tiny model
        # reads positions more easily than a grid) with our instruction. RAGEN's text and
        # instruction: --config.env.params.observation_format=grid_coord.
        c.env.params.observation_format = "coord"
        c.env.params.success_rate = 1.0
    return c
