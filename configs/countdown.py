"""Countdown (RAGEN's tag ``Countdown``): reach the target with the given numbers, each used
once, ``+ - * /`` and parentheses; one answer per episode (reward 1 correct, 0.1 right numbers
but wrong value, 0 otherwise). A host environment (``ragen_jax.envs.countdown``): puzzles
generated from the seed (3-4 numbers up to 99, targets up to 100, solvable by construction);
``--config.env.params.data_path=puzzles.jsonl`` (or ``.parquet``, with the ``parquet`` extra:
pyarrow) reads RAGEN-style ``{"target", "nums"}`` rows instead (RAGEN's first 20,000,
``max_instances``). Either way only puzzles solvable with ``+`` and ``-`` alone are played, as
RAGEN filters its data; ``--config.env.params.plus_minus_only=False`` plays them all.

``python launch.py --config configs/countdown.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "countdown"
    c.env.tag = "Countdown"
    c.env.params = dict(min_numbers=3, max_numbers=4, max_number=99, max_target=100)
    c.rollout.max_turn = 1  # one answer per puzzle (RAGEN: max_actions_per_traj 1)
    c.rollout.max_actions_per_traj = 1
    c.rollout.max_actions_per_turn = 1
    if preset == "tiny":
        # An expression of four two-digit numbers is ~16 tokens (digits are single tokens in
        # the built-in tokenizer) plus the answer tags and the end-of-turn token.
        c.rollout.response_length = 32
        c.trainer.test_freq = 5
    return c
