"""Turn-wise training rows (``algorithm.sample_unit=turn``): episode-level advantages on every
turn, and with the full context the same policy gradient as the trajectory rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.config.resolve import update_settings
from ragen_jax.envs import make
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.models import tokenizer as tk
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.sharding import make_mesh
from ragen_jax.starpo import advantages as adv_lib
from ragen_jax.starpo.estimators import AdvantageSettings
from ragen_jax.starpo.optimizer_step import TrainBatch, actor_objective
from ragen_jax.starpo.rows import RowSettings, build_step_batch
from ragen_jax.starpo.token_scores import token_logprobs
from ragen_jax.starpo.update import (
    Networks,
    StepSettings,
    init_state,
    make_update,
    step_advantages,
)

TINY = QwenConfig.tiny(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       tie_word_embeddings=False)
GROUPS, SIZE = 2, 4
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
MOVES = ["Up", "Down", "Left", "Right", "Jump", "Up || Left"]


def advantage_settings(estimator="grpo"):
    return AdvantageSettings(estimator=estimator, gamma=1.0, lam=1.0, norm_adv_by_std=True,
                             bi_level_gae=False, high_level_gamma=0.95, num_groups=GROUPS,
                             step_gamma=0.95, step_weight=1.0,
                             episode_stats="episode", penalty="discounted")


@pytest.fixture(scope="module")
def rollout():
    """A full-context rollout with varied (scripted) answers: 3 turns, differing scores."""
    tok = tk.load(None)
    env, params = make("sokoban")
    cfg = RolloutConfig(env_groups=GROUPS, group_size=SIZE, max_turn=3, response_length=16)
    policy = ScriptedPolicy.from_texts(
        tok, lambda row, call: f"go</think><answer>{MOVES[(row * 5 + call * 3) % 6]}</answer>")
    batch = AgentRollout(env, params, tok, cfg).collect(policy, [7, 8], jax.random.key(0))
    assert np.unique(batch.scores).size > 2
    return batch


def rows_of(batch, unit, share=False, mini=1):
    return build_step_batch(
        batch, np.ones(GROUPS, bool), np.ones(GROUPS * SIZE, np.float32),
        RowSettings(mini, pad_multiple=8, share_prefixes=share, sample_unit=unit),
        group_buckets=np.zeros(GROUPS, np.int32), mesh=make_mesh((1, 1, 1)),
        rng=np.random.default_rng(0))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_turn_rows_carry_their_episodes_advantage(rollout, estimator):
    """Each turn row gets its episode's trajectory-level advantage, the group statistics
    counting every episode once (RAGEN's episode de-duplication), whatever its turn count."""
    turns = rows_of(rollout, "turn")
    n = int(rollout.num_turns.sum())
    assert turns.input_ids.shape[0] == n > GROUPS * SIZE
    adv, _ = step_advantages(advantage_settings(estimator), turns)
    traj, _ = step_advantages(advantage_settings(estimator), rows_of(rollout, "trajectory"))
    per_episode = np.asarray(traj).sum(1) / np.maximum(rollout.loss_mask.sum(1), 1)
    mask = np.asarray(turns.loss_mask) > 0
    for r, e in enumerate(np.asarray(turns.episode_index)):
        np.testing.assert_allclose(np.asarray(adv)[r][mask[r]], per_episode[e], atol=1e-6)
    assert not np.asarray(adv)[~mask].any()
    # By hand for GRPO: one score per episode, normalised in its group.
    if estimator == "grpo":
        want = adv_lib.grpo(jnp.asarray(rollout.scores), jnp.asarray(rollout.group_ids), GROUPS)
        np.testing.assert_allclose(per_episode, np.asarray(want), atol=1e-5)


def _pg_gradients(model, rows, advantages):
    """Per aggregation mode, the policy gradient of the rows' token-level objective; and their
    (old) log-probs. One compiled program (op by op it takes a minute of CPU)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def gradients(params, rows, advantages):
        model = nnx.merge(graphdef, params, rest)
        old, _ = token_logprobs(model, rows.input_ids, rows.attention_mask, rows.positions)
        batch = TrainBatch(rows.input_ids, rows.attention_mask, rows.positions, rows.loss_mask,
                           old, advantages)

        def loss(p, agg):
            config = update_settings(entropy_coeff=0.0, loss_agg_mode=agg)
            num, (den, _) = actor_objective(nnx.merge(graphdef, p, rest), batch, config)
            return num / den
        return {agg: jax.grad(loss)(params, agg) for agg in AGGREGATIONS}, old
    return gradients(params, rows, advantages)


def test_full_context_turn_rows_give_the_trajectory_gradient(rollout):
    """Full context, trajectory-level advantages: the turn rows' policy gradient equals the
    trajectory rows'. Each turn row is a prefix of its transcript (same tokens, positions and
    so log-probs for its answer), its answer tokens carry the same advantage, and token-mean
    aggregation divides both sums by the same number of answer tokens; the on-policy ratio is
    1, so nothing is clipped. Sequence-mean aggregation weighs rows, so it differs."""
    model = Qwen2ForCausalLM(TINY, rngs=nnx.Rngs(0))
    s = advantage_settings("grpo")
    traj, turns = rows_of(rollout, "trajectory"), rows_of(rollout, "turn")
    adv_traj, _ = step_advantages(s, traj)
    adv_turn, _ = step_advantages(s, turns)
    assert float(jnp.abs(adv_traj).sum()) > 0
    g_traj, lp_traj = _pg_gradients(model, traj, adv_traj)
    g_turn, lp_turn = _pg_gradients(model, turns, adv_turn)
    # The answers' log-probs are the same numbers in both layouts.
    mask_traj, mask_turn = np.asarray(traj.loss_mask) > 0, np.asarray(turns.loss_mask) > 0
    per_episode = [np.asarray(lp_turn)[np.asarray(turns.episode_index) == e][
        mask_turn[np.asarray(turns.episode_index) == e]] for e in range(GROUPS * SIZE)]
    np.testing.assert_allclose(np.concatenate(per_episode), np.asarray(lp_traj)[mask_traj],
                               atol=1e-5)
    leaves_traj, leaves_turn = jax.tree.leaves(g_traj["token-mean"]), jax.tree.leaves(g_turn["token-mean"])
    scale = max(float(jnp.abs(g).max()) for g in leaves_traj)
    assert scale > 0
    for a, b in zip(leaves_traj, leaves_turn, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, rtol=1e-4)
    assert not all(np.allclose(a, b, atol=1e-5 * scale) for a, b in zip(
        jax.tree.leaves(g_turn["seq-mean-token-mean"]),
        jax.tree.leaves(g_traj["seq-mean-token-mean"]), strict=True))


def test_turn_row_update_with_shared_prefixes(rollout):
    """The whole update runs on turn rows (episodes beside the rows, GAE with its critic: the
    actor's and the critic's passes), and sharing each group's prompt prefix changes nothing.
    (GRPO on turn rows is the same actor pass with other advantages: those are checked by
    test_turn_rows_carry_their_episodes_advantage, and the update's actor pass with shared
    prefixes on trajectory rows by
    test_shared_prefix.py::test_update_with_shared_prefixes_equals_the_update_without.)"""
    estimator = "gae"
    actor = update_settings(lr=1e-3, micro_batches=2)
    critic = update_settings(lr=1e-3, entropy_coeff=0.0) if estimator == "gae" else None
    n = int(rollout.num_turns.sum())
    mini = n // 2 if n % 2 == 0 else n
    s = StepSettings(actor=actor, critic=critic, reference=None,
                     advantages=advantage_settings(estimator), mini_batch_size=mini, epochs=1,
                     recompute_logprobs=True, gradient_buckets=3, sample_unit="turn")
    model = Qwen2ForCausalLM(TINY, rngs=nnx.Rngs(0))
    graphdef, trained, rest = nnx.split(model, nnx.Param, ...)
    networks, critic_vars = Networks(graphdef, rest), None
    if critic is not None:
        from ragen_jax.models import Qwen2ForValue

        cg, critic_vars, cr = nnx.split(Qwen2ForValue.from_actor(model, seed=1), nnx.Param, ...)
        networks = Networks(graphdef, rest, cg, cr)
    update = make_update(s, networks)
    copy = lambda: jax.tree.map(jnp.copy, init_state(s, trained, critic_vars))  # noqa: E731
    plain = rows_of(rollout, "turn", mini=mini)
    shared = rows_of(rollout, "turn", share=True, mini=mini)
    assert shared.prefixes is not None and shared.input_ids.shape[1] < plain.input_ids.shape[1]
    new_a, m_a = update(copy(), plain)
    new_b, m_b = update(copy(), shared)
    for k in m_a:
        assert np.isfinite(float(m_a[k])), k
        assert float(m_b[k]) == pytest.approx(float(m_a[k]), rel=1e-4, abs=1e-5), k
    for a, b in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
