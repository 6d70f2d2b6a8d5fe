"""Scripted policies: the random-action answers of the format warm-start."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.models import tokenizer as tk
from ragen_jax.rollout import AgentRollout, RandomActionPolicy, SamplingParams
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.context import parse_response
from ragen_jax.rollout.scripted import answer_text, random_actions


@pytest.mark.parametrize("think,prefill", list(itertools.product([False, True], repeat=2)))
def test_answer_text_parses_under_every_context(think, prefill):
    ctx = dataclasses.replace(RolloutConfig().context, enable_think=think, prefill_tag=prefill)
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


def test_solver_mixture_policy_share_one_solves_and_share_zero_is_random_legal():
    from ragen_jax.envs.solvers import solve
    from ragen_jax.rollout.scripted import SolverMixturePolicy

    tok = tk.load(None)
    env, params = make("frozenlake", observation_format="coord", success_rate=1.0)
    cfg = RolloutConfig(max_turn=5, response_length=24, prompt=PromptConfig(enable_think=False))
    rollout = AgentRollout(env, params, tok, cfg)
    seeds = np.arange(12)
    solved = rollout.collect(SolverMixturePolicy(env, params, tok, cfg.context, 0, solver_share=1.0),
                             seeds, jax.random.key(0), group_size=2)
    assert solved.metrics["FrozenLake/success"] == 1.0  # every generated lake has a path
    _, first = rollout.reset_envs(seeds)
    for b, traj in enumerate(solved.trajectories):  # and it takes a shortest one
        optimal = len(solve(env, jax.tree.map(lambda x, b=b: x[b // 2], first)))
        assert sum(len(t["actions"]) for t in traj["turns"]) == optimal
    mixed = rollout.collect(SolverMixturePolicy(env, params, tok, cfg.context, 0, solver_share=0.0),
                            seeds, jax.random.key(0), group_size=2)
    assert mixed.metrics["FrozenLake/effective_action_rate"] == 1.0  # random, but legal
    assert mixed.metrics["FrozenLake/success"] < 0.7
    with pytest.raises(ValueError, match="solver_share"):
        SolverMixturePolicy(env, params, tok, cfg.context, 0, solver_share=1.5)
