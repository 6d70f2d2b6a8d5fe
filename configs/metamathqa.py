"""MetaMathQA (RAGEN's tag ``MetamathQA``, ``_5_metamathqa.yaml``): answer a math question; a
correct answer (RAGEN's comparison: lower case, whitespace removed, string equality) ends the
episode with reward 1, halved for each wrong answer before it (RAGEN's retries). A host
environment (``ragen_jax.envs.metamathqa``) on a local JSONL or parquet file in MetaMathQA's
fields (``query``, ``response``): ``--config.env.params.data_path=MetaMathQA-395K.jsonl``;
nothing is downloaded.

Three answers per question here; RAGEN's tag allows one (``max_actions_per_traj: 1``), which
``--config.rollout.max_turn=1 --config.rollout.max_actions_per_traj=1`` reproduces. The tiny
preset plays our own 26-question sample (``tests/data/metamathqa_sample.jsonl``); validation
is held out by question text, so a file needs more distinct questions than
``rollout.val.env_groups`` (256) draws to leave some for training.

``python launch.py --config configs/metamathqa.py[:preset]``.
"""

from pathlib import Path

from configs import base

SAMPLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "metamathqa_sample.jsonl"


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "metamathqa"
    c.env.tag = "MetamathQA"
    c.env.params = dict(data_path="")
    c.rollout.max_turn = 3
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 3
    if preset == "tiny":
        c.env.params.data_path = str(SAMPLE)
        c.rollout.val.env_groups = 8  # of the sample's 26 questions
        c.rollout.response_length = 24  # a short answer and the tags
    return c
