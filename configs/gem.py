"""GEM's games (``gem-llm``, "a Gym for Generalist LLMs"; not a RAGEN env) through our adapter
(``ragen_jax.envs.gem_env``; the ``gem`` extra: ``pip install 'ragen_jax[gem]'``): GEM's
observations and rewards, the model's answer wrapped into GEM's ``\\boxed{...}``.

The preset plays GuessTheNumber, which runs without downloads and whose levels can be held
out: its hidden number is the level (the adapter reads it from the env's attributes), and a
random digit (the format warm-start's action) is a legal guess. ``tiny``: numbers 1-10 in 4
guesses (``game:GuessTheNumber-v0-easy``: 10 levels, 2 of them for validation); the other
presets: 1-50 in 7 guesses (``-hard``: 50 levels, 16 for validation). Another offline GEM game:
``--config.env.params.env_id=game:Mastermind-v0-easy --config.env.tag=Mastermind`` (with its
``max_turns``); GEM's Minesweeper places its mines at the first reveal, so every level looks
alike at reset and holding its validation out fails (``HeldOutError``): it needs
``--config.rollout.val.held_out=False``. The offline suites: docs/environments.md.

``python launch.py --config configs/gem.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "gem"
    c.env.tag = "GuessTheNumber"
    c.env.params = dict(env_id="game:GuessTheNumber-v0-hard")
    c.rollout.max_turn = 7  # GEM ends the game after its own max_turns
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 7
    if preset == "tiny":
        c.env.params.env_id = "game:GuessTheNumber-v0-easy"
        c.rollout.max_turn = c.rollout.max_actions_per_traj = 4
        c.rollout.val.env_groups = 2  # of the 10 hidden numbers
        c.rollout.response_length = 16
    else:
        c.rollout.val.env_groups = 16  # of the 50 hidden numbers
        c.rollout.response_length = 256
    return c
