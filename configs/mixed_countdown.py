"""Countdown and SimpleSokoban in one run: a one-step host env (free-text arithmetic answers)
and a multi-turn JAX grid world, 4 groups each per step, trained in one batch.

``python launch.py --config configs/mixed_countdown.py[:preset]``. Each env's params and
per-env rollout settings are its own config file's for the same preset
(``configs/countdown.py``: one answer per puzzle and a longer response; ``configs/sokoban.py``:
the run's multi-turn budget). Validation splits ``rollout.val.env_groups`` between them in
proportion to their groups. Metrics per tag: ``train/Countdown/success``,
``val-env/SimpleSokoban/success``, ... See ``configs/mixed.py`` for changing the mixture on
the command line.
"""

from configs import base, countdown, sokoban
from ragen_jax.config.schema import MIX_ROLLOUT_FIELDS


def _field(section, path: str):
    for name in path.split("."):
        section = section[name]
    return section


def _own_rollout(env_config, run_config) -> dict:
    """The entry's ``rollout`` overrides: the per-env fields where its own config differs from
    the mixed run's (a section's nested: ``{"prompt": {"turn_template": ...}}``)."""
    own = {}
    for path in MIX_ROLLOUT_FIELDS:
        value = _field(env_config.rollout, path)
        if value != _field(run_config.rollout, path):
            *sections, name = path.split(".")
            node = own
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
    return own


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "mixed"  # informational: env.mix decides (the run folder is runs/mixed-<preset>)
    cd, sk = countdown.get_config(preset), sokoban.get_config(preset)
    c.env.mix = (
        dict(name="sokoban", tag="SimpleSokoban", groups=4,
             params=sk.env.params.to_dict(), rollout=_own_rollout(sk, c)),
        dict(name="countdown", tag="Countdown", groups=4,
             params=cd.env.params.to_dict(), rollout=_own_rollout(cd, c)),
    )
    c.rollout.env_groups = 8
    if preset == "tiny":  # as Sokoban's tiny preset: shorter warm-start batches, legal moves
        c.warmstart.steps = 60
        c.warmstart.batch_size = 8
        c.warmstart.legal_actions = True
    return c
