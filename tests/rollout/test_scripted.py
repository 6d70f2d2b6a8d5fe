"""Scripted policies: the random-action answers of the format warm-start."""

import itertools

import jax
import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.models import tokenizer as tk
from ragen_jax.rollout import AgentRollout, RandomActionPolicy, RolloutConfig, SamplingParams
from ragen_jax.rollout.context import ContextConfig, parse_response
from ragen_jax.rollout.scripted import answer_text, random_actions


@pytest.mark.parametrize("think,prefill", list(itertools.product([False, True], repeat=2)))
def test_answer_text_parses_under_every_context(think, prefill):
    ctx = ContextConfig(enable_think=think, prefill_tag=prefill)
    text = answer_text(["Up", "Left"], ctx)
    p = parse_response(ctx.answer_prefix + text, ["Up", "Down", "Left", "Right"], ctx)
    assert not p.format_error and p.action_ids == [0, 2]


def test_random_actions_draw_then_replace_the_opening():
    a = random_actions(np.random.default_rng(0), 4, 3)
    b = random_actions(np.random.default_rng(0), 4, 3, opening=6)
    assert len(a) == 3 and b == [2] + a[1:]


def test_random_action_policy_opens_each_group_with_every_action():
    tok = tk.load(None)
    env, params = make("sokoban")
    cfg = RolloutConfig(max_turn=2, response_length=24)
    policy = RandomActionPolicy(env, params, tok, cfg.context, seed=0)
    batch = AgentRollout(env, params, tok, cfg).collect(policy, [1, 2], jax.random.key(0),
                                                        group_size=len(env.action_names))
    first = [t["turns"][0]["actions"][0] for t in batch.trajectories]
    assert first == list(env.action_names) * 2
    assert batch.metrics["Sokoban/format_error_rate"] == 0.0
    assert len(policy.calls) == 2
    with pytest.raises(ValueError, match="env_states"):
        policy([[1, 2]], params=SamplingParams())
