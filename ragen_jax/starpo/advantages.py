"""Advantage estimators of StarPO, as pure functions on padded token arrays.

Arrays are ``[B, T]`` over a trajectory's token slots; ``mask`` is the loss mask (1 on tokens
the policy generated). Rewards sit on generated tokens (by default the trajectory score on the
last one). Outcome estimators (GRPO and friends) work on per-trajectory scores ``[B]`` and
broadcast over the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ragen_jax.starpo.losses import masked_mean


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over masked entries (veRL: unbiased variance);
    0 where ``mask`` is 0."""
    mean = masked_mean(x, mask)
    n = jnp.sum(mask)
    var = jnp.sum(jnp.square(x - mean) * mask) / jnp.maximum(n - 1, 1.0)
    return jnp.where(mask > 0, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0,
        lam: float = 1.0, whiten: bool = True) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over generated tokens, as veRL computes it.

    A backward TD(lambda) pass in which masked positions (prompt, observations, padding) are
    skipped: the value and the running advantage carry across them unchanged, so the last
    token of turn k bootstraps from the first generated token of turn k+1. Returns
    ``(advantages, returns)`` [B, T]; returns = raw advantages + values (the critic's target);
    advantages are whitened over the mask when ``whiten``.
    """
    mask = mask.astype(jnp.float32)

    def back(carry, xs):
        next_value, last = carry  # [B], [B]
        r, v, m = xs
        delta = r + gamma * next_value - v
        adv = delta + gamma * lam * last
        next_value = v * m + next_value * (1 - m)
        last = adv * m + last * (1 - m)
        return (next_value, last), adv

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    xs = (rewards.T.astype(jnp.float32), values.T.astype(jnp.float32), mask.T)
    _, adv = jax.lax.scan(back, (zeros, zeros), xs, reverse=True)
    adv = adv.T * mask
    returns = (adv + values) * mask
    return (masked_whiten(adv, mask) if whiten else adv), returns


def bi_level_gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, turn_end: jax.Array,
                 gamma: float = 1.0, lam: float = 1.0, high_level_gamma: float = 0.95,
                 whiten: bool = True) -> tuple[jax.Array, jax.Array]:
    """RAGEN's two-level GAE: first over turns, then over the tokens of each turn.

    Turn level: at each turn's last generated token (``turn_end`` [B, T]), a GAE over turns
    with ``high_level_gamma`` bootstraps from the value at the next turn's end; the turn's
    return replaces its reward. Token level: a GAE with ``gamma`` inside each turn, restarting
    (no bootstrap) at every turn end. RAGEN finds turn ends as nonzero-reward tokens (a
    zero-reward turn is then merged into the next) and its call path is broken at HEAD; here
    turn ends are given explicitly.
    """
    mask = mask.astype(jnp.float32)
    end = turn_end.astype(jnp.float32) * mask
    rewards, values = rewards.astype(jnp.float32), values.astype(jnp.float32)

    def turns(carry, xs):
        next_value, last = carry
        r, v, e = xs
        adv = r + high_level_gamma * next_value - v + high_level_gamma * lam * last
        next_value = jnp.where(e > 0, v, next_value)
        last = jnp.where(e > 0, adv, last)
        return (next_value, last), adv

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, turn_adv = jax.lax.scan(turns, (zeros, zeros), (rewards.T, values.T, end.T), reverse=True)
    turn_return = turn_adv.T + values
    rewards = jnp.where(end > 0, turn_return, rewards)

    def tokens(carry, xs):
        next_value, last = carry
        r, v, m, e = xs
        next_value = jnp.where(e > 0, 0.0, next_value)
        last = jnp.where(e > 0, 0.0, last)
        adv = r + gamma * next_value - v + gamma * lam * last
        next_value = jnp.where(m > 0, v, next_value)
        last = jnp.where(m > 0, adv, last)
        return (next_value, last), adv

    _, adv = jax.lax.scan(tokens, (zeros, zeros), (rewards.T, values.T, mask.T, end.T), reverse=True)
    adv = adv.T * mask
    returns = (adv + values) * mask
    return (masked_whiten(adv, mask) if whiten else adv), returns


def _group_stats(scores: jax.Array, group_ids: jax.Array, num_groups: int):
    ones = jnp.ones_like(scores)
    count = jax.ops.segment_sum(ones, group_ids, num_groups)
    total = jax.ops.segment_sum(scores, group_ids, num_groups)
    mean = total / jnp.maximum(count, 1.0)
    sq = jax.ops.segment_sum(jnp.square(scores - mean[group_ids]), group_ids, num_groups)
    std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))  # unbiased, as torch.std
    return count[group_ids], mean[group_ids], std[group_ids]


def grpo(scores: jax.Array, group_ids: jax.Array, num_groups: int, norm_by_std: bool = True,
         eps: float = 1e-6) -> jax.Array:
    """GRPO: ``(s - group mean) / (group std + eps)`` with the unbiased std; Dr.GRPO with
    ``norm_by_std=False``: ``s - group mean``. A group of one gets mean 0 and std 1 (RAGEN and
    veRL), i.e. its raw score. Scores arrive after the reward normalisation
    (``starpo.normalization``); GRPO is invariant to its per-group affine maps, so only
    ``asym_clip``'s clamp changes what GRPO sees.  # [B]"""
    scores = scores.astype(jnp.float32)
    count, mean, std = _group_stats(scores, group_ids, num_groups)
    single = count < 2
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    return (scores - mean) / (std + eps) if norm_by_std else scores - mean


def rloo(scores: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    """Leave-one-out baseline: ``s - mean of the others`` (= ``n/(n-1) (s - mean)``); a group
    of one keeps its raw score (veRL).  # [B]"""
    scores = scores.astype(jnp.float32)
    count, mean, _ = _group_stats(scores, group_ids, num_groups)
    return jnp.where(count > 1, (scores - mean) * count / jnp.maximum(count - 1.0, 1.0), scores)


def reinforce_plus_plus(rewards: jax.Array, mask: jax.Array, gamma: float = 1.0
                        ) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ (veRL ``compute_reinforce_plus_plus_outcome_advantage``): each generated
    token's discounted return ``G_t = r_t + gamma * G_next`` of the token rewards, then
    whitened over the batch's generated tokens. Returns ``(advantages, returns)`` [B, T].

    Masked positions (prompt, observations, padding) are skipped as in ``gae``: the running
    return carries across them unchanged (and undiscounted), so an earlier turn's tokens see
    the score placed on the last turn. veRL resets the running return at every masked
    position, which is the same on its single-turn layout (response, then padding) but would
    give earlier turns of a multi-turn row a return of 0.
    """
    mask = mask.astype(jnp.float32)

    def back(running, xs):
        r, m = xs
        g = r + gamma * running
        return g * m + running * (1 - m), g

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, returns = jax.lax.scan(back, zeros, (rewards.T.astype(jnp.float32), mask.T), reverse=True)
    returns = returns.T * mask
    return masked_whiten(returns, mask), returns


def reinforce_plus_plus_baseline(scores: jax.Array, group_ids: jax.Array, num_groups: int,
                                 mask: jax.Array) -> jax.Array:
    """REINFORCE++-baseline (veRL ``compute_reinforce_plus_plus_baseline_outcome_advantage``):
    ``s - group mean`` (a group of one keeps its raw score), broadcast on the generated
    tokens, then whitened over the batch's generated tokens (so longer rows weigh more in the
    mean and std, as in veRL). veRL returns the same array as advantages and returns.  # [B, T]"""
    scores = scores.astype(jnp.float32)
    count, mean, _ = _group_stats(scores, group_ids, num_groups)
    centred = scores - jnp.where(count < 2, 0.0, mean)
    mask = mask.astype(jnp.float32)
    return masked_whiten(broadcast(centred, mask), mask)


def broadcast(advantage: jax.Array, mask: jax.Array) -> jax.Array:
    """A per-trajectory advantage [B] on every generated token.  # [B, T]"""
    return advantage[:, None] * mask.astype(jnp.float32)
