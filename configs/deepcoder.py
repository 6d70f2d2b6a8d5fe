"""DeepCoder (RAGEN's tag ``DeepCoder``, ``_10_deepcoder.yaml``): write a Python program for a
coding problem; it runs confined (``ragen_jax.envs.host.code_sandbox``: Landlock, seccomp, CPU /
memory / output limits, a fresh process per program) against the problem's tests; the reward
is the fraction passed, success is passing all. A host environment
(``ragen_jax.envs.deepcoder``) on a local JSONL or parquet file in DeepCoder-Preview's fields
(``problem``, ``tests``, ``starter_code``, ``metadata``) or RAGEN's prepared ones:
``--config.env.params.data_path=deepcoder.jsonl``; nothing is downloaded.

One answer per problem, as in RAGEN (``max_turn: 1``); ``--config.env.params.max_steps=3
--config.rollout.max_turn=3 --config.rollout.max_actions_per_traj=3`` gives a failed answer
its first failure as feedback and two more tries. The tiny preset plays our own 16-problem
sample (``tests/data/deepcoder_sample.jsonl``); validation is held out by problem text.

``python launch.py --config configs/deepcoder.py[:preset]``.
"""

from pathlib import Path

from configs import base

SAMPLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepcoder_sample.jsonl"


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "deepcoder"
    c.env.tag = "DeepCoder"
    c.env.params = dict(data_path="", max_steps=1, time_limit=3.0, memory_mb=512, confine=True)
    c.rollout.max_turn = 1
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 1
    c.rollout.prompt.max_answer_chars = 8000  # a whole program is the answer
    if preset == "tiny":
        c.env.params.data_path = str(SAMPLE)
        c.rollout.val.env_groups = 4  # of the sample's 16 problems
        c.rollout.response_length = 32  # a random model's program never runs; the loop does
    else:
        c.rollout.response_length = 1024
        c.rollout.max_model_len = 8192
    return c
