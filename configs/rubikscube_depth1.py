"""RAGEN's own 2x2 cube task (``_10_rubikscube.yaml``: ``scramble_depth: 1``), validated on
training levels.

Depth 1 has 12 distinct scrambles (one quarter turn from solved), and the 256 validation seeds
draw all 12: holding validation out (``rollout.val.held_out``) would leave no level to train
on (training's redraws fail with ``HeldOutError``), so this variant sets
``held_out_val=False``, as RAGEN does (it separates train and validation by seed only). Its
validation success measures what was trained, not generalisation; ``configs/rubikscube.py``
(depth 3, held out) is the honest preset. Otherwise the same preset.

``python launch.py --config configs/rubikscube_depth1.py[:preset]``.
"""

from configs import rubikscube


def get_config(preset: str = "tiny"):
    c = rubikscube.get_config(preset)
    c.env.params.scramble_depth = 1
    c.rollout.val.held_out = False
    return c
