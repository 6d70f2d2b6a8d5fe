"""Bandit (RAGEN's two named arms, one pull). Validation also runs on the held-out test
names (tag ``BanditTest``): with a pretrained model that measures transfer of the names'
priors; a random-init tiny model can only learn the training names, so its test-name
success is expected near chance.

``python launch.py --config configs/bandit.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "bandit"
    c.env.params = dict(split="train")
    c.env.val_extra = dict(BanditTest=dict(split="test"))
    # The training split's few levels (its name pairs x two orders) are all validation levels,
    # so validation replays them; BanditTest holds the test names out by split.
    c.rollout.held_out_val = False
    c.rollout.max_turn = 1  # one pull per episode
    c.rollout.max_actions_per_traj = 1
    c.rollout.max_actions_per_turn = 1
    if preset == "tiny":
        c.trainer.test_freq = 5
    return c
