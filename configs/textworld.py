"""TextWorld (Microsoft's text-adventure engine; RAGEN plays it only through ALFWorld's games):
a game generated per seed by a TextWorld challenge, played by free-text commands; the reward
is the game's score change, success is winning it. A host environment
(``ragen_jax.envs.textworld_env``; the ``textworld`` extra: ``pip install
'ragen_jax[textworld]'``); games are generated and compiled offline by TextWorld's bundled
Inform 7 tools, once, into a cache folder (``--config.env.params.cache_dir``; default: the
temp dir).

The challenge and its settings are params: ``--config.env.params.challenge=tw-treasure_hunter``
keeps the ``level`` setting; a challenge with other settings (``tw-simple``: ``rewards``,
``goal``; ``tw-cooking``: ``recipe``, ``take``, ``go``, ...) needs a config of its own.
``num_games`` fixes a pool of games (seed ``s`` plays game ``s % num_games``, as RAGEN's
ALFWorld picks its game files; 0: a game per seed). Validation is held out by the game's
content.

The tiny preset: coin collector level 1 (one room, take the coin) on a pool of 8 games, so
that a first run compiles 8 games (~2 s each) and later runs none. The other presets: coin
collector level 10 (a path of ten rooms to the coin) on 512 games, up to 20 commands.

``python launch.py --config configs/textworld.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "textworld"
    c.env.tag = "TextWorld"
    c.env.params = dict(challenge="tw-coin_collector", level=10, num_games=512, cache_dir="",
                        show_commands=True)
    c.rollout.max_turn = 20
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 20
    if preset == "tiny":
        c.env.params.level = 1
        c.env.params.num_games = 8
        c.rollout.max_turn = 3
        c.rollout.max_actions_per_traj = 3
        c.rollout.val.env_groups = 2  # of the 8 games
        c.rollout.response_length = 16  # one short command and the tags
        c.rollout.max_model_len = 2048  # three turns of ~400-character observations
    else:
        c.rollout.response_length = 256
        c.rollout.max_model_len = 8192
    return c
