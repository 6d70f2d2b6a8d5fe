"""Search QA (RAGEN's ``search`` env, tags SearchQA / HotpotQA): answer a question by
``search[query]`` (the top passages come back) and ``finish[answer]`` (reward 1 for an exact
match after SQuAD's normalisation, else the token F1 when it reaches 0.3, else 0; a malformed
action costs 0.1). A host environment (``ragen_jax.envs.search``) on local files: questions
``--config.env.params.data_path=nq_train.jsonl`` (``question``, ``golden_answers``) and a BM25
index over ``--config.env.params.corpus_path=wiki.jsonl`` (``contents`` rows; the ``search``
extra: ``pip install 'ragen_jax[search]'``), or a retrieval server instead of the corpus:
``--config.env.params.corpus_path= --config.env.params.server_url=http://127.0.0.1:8000/retrieve``.

Up to 5 turns of one action each. The tiny preset plays our own 6-question sample and 8-passage
corpus (``tests/data/search_*.jsonl``); validation is held out by question text.

``python launch.py --config configs/search.py[:preset]``.
"""

from pathlib import Path

from configs import base

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "search"
    c.env.tag = "SearchQA"
    c.env.params = dict(data_path="", corpus_path="", server_url="", topk=3, max_steps=5)
    c.rollout.max_turn = 5
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 5
    if preset == "tiny":
        c.env.params.data_path = str(DATA / "search_questions.jsonl")
        c.env.params.corpus_path = str(DATA / "search_corpus.jsonl")
        c.env.params.passage_chars = 200
        c.rollout.val.env_groups = 2  # of the sample's 6 questions
        c.rollout.response_length = 32
    else:
        c.rollout.response_length = 256
        c.rollout.max_model_len = 8192
    return c
