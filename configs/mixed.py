"""Several environments in one run (RAGEN's ``es_manager.train.env_configs.tags`` and
``n_groups``): SimpleSokoban and FrozenLake, 4 groups each per step, trained in one batch.

``python launch.py --config configs/mixed.py[:preset]``. Each env's params are its own config
file's for the same preset (``configs/sokoban.py``, ``configs/frozenlake.py``: the tiny
preset's FrozenLake reads coordinates and does not slip). Validation splits
``rollout.val.env_groups`` between them in proportion to their groups (no entry gives ``val_groups``).
Metrics per tag: ``train/SimpleSokoban/success``, ``val-env/FrozenLake/success``, ...

Change the mixture on the command line, one entry's field at a time
(``--config.env.mix.FrozenLake.groups=6 --config.env.mix.SimpleSokoban.groups=2``) or whole
(``--config.env.mix="({'name': 'sokoban', 'tag': 'S', 'groups': 8},)"``); the groups must
sum to ``rollout.env_groups``.
"""

from configs import base, frozenlake, sokoban


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "mixed"  # informational: env.mix decides (the run folder is runs/mixed-<preset>)
    c.env.mix = (
        dict(name="sokoban", tag="SimpleSokoban", groups=4,
             params=sokoban.get_config(preset).env.params.to_dict()),
        dict(name="frozenlake", tag="FrozenLake", groups=4,
             params=frozenlake.get_config(preset).env.params.to_dict()),
    )
    c.rollout.env_groups = 8
    if preset == "tiny":  # as both envs' tiny presets: multi-turn, shorter warm-start batches
        c.warmstart.steps = 60
        c.warmstart.batch_size = 8
        c.warmstart.legal_actions = True  # the warm-start plays both envs (half the episodes each)
    return c
