"""The whole-step update ``update(state, batch)``: equal to its pieces composed by hand,
pure, and with each optional role (critic, reference, LoRA reference) decided at build."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.config.resolve import update_settings
from ragen_jax.models import Qwen2ForCausalLM, Qwen2ForValue, QwenConfig
from ragen_jax.models.lora import add_lora
from ragen_jax.starpo import advantages as adv_lib
from ragen_jax.starpo.estimators import AdvantageSettings
from ragen_jax.starpo.optimizer_step import (
    TrainBatch,
    jit_optimizer_step,
    make_optimizer,
)
from ragen_jax.starpo.token_scores import token_logprobs
from ragen_jax.starpo.update import Networks, StepBatch, StepSettings, init_state, make_update

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8)
B, L, GROUPS = 8, 16, 2


def make_batch(model, seed=0) -> StepBatch:
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, 64, (B, L)), jnp.int32)
    lengths = rng.integers(L // 2, L + 1, B)
    attn = jnp.asarray(np.arange(L)[None] < lengths[:, None])
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    loss = (attn & jnp.asarray(rng.random((B, L)) < 0.6) & (jnp.arange(L) > 0)).astype(jnp.float32)
    logp, _ = token_logprobs(model, ids, attn, pos)
    scores = jnp.asarray(rng.normal(size=B), jnp.float32)
    last = jnp.asarray(lengths - 1)
    rewards = jnp.zeros((B, L)).at[jnp.arange(B), last].set(scores) * loss
    return StepBatch(input_ids=ids, attention_mask=attn, positions=pos, loss_mask=loss,
                     sampler_logp=logp, token_rewards=rewards, turn_end=jnp.zeros((B, L)),
                     scores=scores, group_ids=jnp.repeat(jnp.arange(GROUPS), B // GROUPS),
                     bucket_ids=jnp.zeros(B, jnp.int32), advantage_scale=jnp.ones(B))


def settings(estimator="grpo", critic=False, reference=None, mini=B, recompute=False):
    actor = update_settings(lr=1e-3, micro_batches=2, kl_coef=0.1 if reference else 0.0)
    return StepSettings(actor=actor, critic=update_settings(lr=1e-3, entropy_coeff=0.0) if critic else None,
                        reference=reference, advantages=AdvantageSettings(
                            estimator=estimator, gamma=1.0, lam=1.0, norm_adv_by_std=True,
                            bi_level_gae=False, high_level_gamma=0.95, num_groups=GROUPS,
                            step_gamma=0.95, step_weight=1.0, episode_stats="episode",
                            penalty="discounted"),
                        mini_batch_size=mini, epochs=1, recompute_logprobs=recompute,
                        gradient_buckets=3)


def build(s: StepSettings, lora: bool = False, seed: int = 0):
    model = Qwen2ForCausalLM(QwenConfig.tiny(**CFG), rngs=nnx.Rngs(seed))
    if lora:
        add_lora(model, rank=2)
    graphdef, trained, rest = nnx.split(model, nnx.LoRAParam if lora else nnx.Param, ...)
    networks, critic_vars = Networks(graphdef, rest), None
    if s.critic is not None:
        cg, critic_vars, cr = nnx.split(Qwen2ForValue.from_actor(model, seed=1), nnx.Param, ...)
        networks = Networks(graphdef, rest, cg, cr)
    return model, networks, init_state(s, trained, critic_vars)


def test_grpo_update_equals_its_pieces_and_is_pure():
    s = settings()
    model, networks, state = build(s)
    batch = make_batch(model)
    update = make_update(s, networks)
    new, metrics = update(copy(state), batch)
    # By hand: GRPO advantages, then one actor step on the whole batch at lr(step 0).
    adv = adv_lib.broadcast(adv_lib.grpo(batch.scores, batch.group_ids, GROUPS), batch.loss_mask)
    rows = TrainBatch(batch.input_ids, batch.attention_mask, batch.positions, batch.loss_mask,
                      batch.sampler_logp, adv, None)
    opt = make_optimizer(s.actor)
    params, _, ref_metrics = jit_optimizer_step(networks.actor, s.actor, opt, donate=False)(
        state.actor, networks.actor_rest, opt.init(state.actor), rows)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new.actor), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(float(ref_metrics["actor/pg_loss"]), abs=1e-6)
    assert int(new.step) == 1 and new.critic is None and new.reference is None
    assert "rollout/ref_kl" not in metrics and "critic/values_mean" not in metrics
    # A function of its inputs: the same state again gives the same result; the state
    # passed in is donated (its buffers hold the result, one copy of the weights in memory).
    donated = copy(state)
    again, _ = update(donated, batch)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(x.is_deleted() for x in jax.tree.leaves(donated.actor))


def copy(state):
    return jax.tree.map(jnp.copy, state)


def test_updates_of_one_architecture_share_one_program_and_read_their_own_frozen_weights():
    """Two LoRA actors of one architecture and other base weights (the untrained variables):
    the second ``make_update`` reuses the first's jitted program (nothing traced or compiled
    again), and its update reads its own base weights (arguments of the program, not
    constants in it): the same result as an update built for it alone."""
    from ragen_jax.compilation import CompileWatch
    from ragen_jax.starpo.update import _jitted_update

    s = settings(recompute=True)
    model_a, networks_a, state_a = build(s, lora=True, seed=0)
    model_b, networks_b, state_b = build(s, lora=True, seed=1)
    batch = make_batch(model_b)
    make_update(s, networks_a)(copy(state_a), batch)
    watch = CompileWatch()
    shared, _ = make_update(s, networks_b)(copy(state_b), batch)
    assert watch.take()["compile/count"] == 0
    alone, _ = _jitted_update.__wrapped__(s, networks_b.actor, None, None)(
        copy(state_b), batch, networks_b.actor_rest, None, train_actor=True,
        analyse_gradients=False)
    assert watch.take()["compile/count"] > 0  # a program of its own (the check can fail)
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(alone), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other, _ = make_update(s, networks_a)(copy(state_b), batch)  # A's base weights, B's adapters
    assert not all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(other.actor), jax.tree.leaves(shared.actor), strict=True))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_filter_loss_scaling_scales_the_advantages(mode):
    """RAGEN's filter_loss_scaling multiplies the advantages, so it changes the loss under
    every aggregation (a scaled loss mask would cancel in token-mean)."""
    s = settings()
    s = dataclasses.replace(s, actor=dataclasses.replace(s.actor, loss_agg_mode=mode))
    model, networks, state = build(s)
    batch = make_batch(model)
    update = make_update(s, networks)
    _, full = update(copy(state), batch)
    _, half = update(copy(state), batch.replace(advantage_scale=jnp.full(B, 0.5)))
    # First step: ratio 1, so the surrogate is -advantage, linear in the scale.
    assert float(full["actor/pg_loss"]) != 0.0
    assert float(half["actor/pg_loss"]) == pytest.approx(0.5 * float(full["actor/pg_loss"]), rel=1e-5)


def test_mini_batches_and_recompute_match_the_sampler():
    s = settings(mini=B // 2, recompute=True)
    model, networks, state = build(s)
    _, metrics = make_update(s, networks)(state, make_batch(model))
    assert float(metrics["train/num_mini_batches"]) == 2.0
    assert float(metrics["rollout/logprob_gap"]) < 1e-5  # same model as the "sampler"


def test_critic_role_trains_the_critic_and_can_run_alone():
    s = settings("gae", critic=True)
    model, networks, state = build(s)
    update = make_update(s, networks)
    batch = make_batch(model)
    new, metrics = update(copy(state), batch, train_actor=False)  # critic warmup: critic only
    for a, b in zip(jax.tree.leaves(state.actor), jax.tree.leaves(new.actor), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = [float(jnp.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(state.critic), jax.tree.leaves(new.critic), strict=True)]
    assert max(moved) > 0 and np.isfinite(float(metrics["critic/vf_loss"]))
    assert "actor/pg_loss" not in metrics
    new, metrics = update(new, batch)
    assert "actor/pg_loss" in metrics and "critic/values_mean" in metrics


@pytest.mark.parametrize("lora", [False, True])
def test_reference_role_starts_at_the_actor(lora):
    s = settings(reference="adapters_off" if lora else "frozen_copy", recompute=True)
    model, networks, state = build(s, lora=lora)
    assert (state.reference is None) == lora  # under LoRA the reference is the adapters-off actor
    update = make_update(s, networks)
    batch = make_batch(model)
    state, metrics = update(state, batch)
    assert abs(float(metrics["rollout/ref_kl"])) < 1e-6  # reference == policy before any update
    _, metrics = update(state, batch)
    assert abs(float(metrics["rollout/ref_kl"])) > 1e-7  # the policy has moved away from it
    assert np.isfinite(float(metrics["actor/kl_loss"]))
