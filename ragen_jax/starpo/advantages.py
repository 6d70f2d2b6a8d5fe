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


def discounted_turn_returns(rewards: jax.Array, played: jax.Array, gamma: float) -> jax.Array:
    """Each turn's discounted return ``R_t = r_t + gamma * R_{t+1}`` over its episode's later
    turns (GiGPO's step return, the paper's Eq. 5), from ``rewards [E, T]`` per turn; 0 on
    turns not ``played`` (which follow the played ones).  # [E, T]"""
    played = played.astype(jnp.float32)

    def back(running, xs):
        r, m = xs
        g = (r + gamma * running) * m
        return g, g

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, returns = jax.lax.scan(back, zeros, (rewards.T.astype(jnp.float32), played.T),
                              reverse=True)
    return returns.T


def anchor_segments(group_ids: jax.Array, anchors: jax.Array, valid: jax.Array) -> jax.Array:
    """Each entry's anchor group, by sorting: the ``valid`` entries with equal ``group_ids [N]``
    and ``anchors [N, 2]`` (hash lanes) share an id in ``[0, N)``; the others get ``N`` (which
    ``segment_sum`` with ``N`` segments drops). Static shapes, no loop over entries.  # [N]"""
    n = group_ids.shape[0]
    group = jnp.where(valid, group_ids, jnp.iinfo(jnp.int32).max).astype(jnp.int32)
    lanes = jnp.where(valid[:, None], anchors, 0).astype(jnp.uint32)
    order = jnp.lexsort((lanes[:, 1], lanes[:, 0], group))  # the last key sorts first
    g, a0, a1 = group[order], lanes[order, 0], lanes[order, 1]
    starts = jnp.concatenate([jnp.ones(1, bool),
                              (g[1:] != g[:-1]) | (a0[1:] != a0[:-1]) | (a1[1:] != a1[:-1])])
    segments = jnp.zeros(n, jnp.int32).at[order].set(jnp.cumsum(starts).astype(jnp.int32) - 1)
    return jnp.where(valid, segments, n)


def gigpo(scores: jax.Array, group_ids: jax.Array, num_groups: int, turn_rewards: jax.Array,
          turn_anchors: jax.Array, played: jax.Array, gamma: float = 0.95,
          step_weight: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """GiGPO (Group-in-Group Policy Optimization, arXiv 2505.10978), per turn: the episode's
    group advantage (``grpo`` of ``scores [E]`` in ``group_ids [E]``, Eq. 3) plus
    ``step_weight`` times the turn's step advantage (Eq. 7-8): its discounted return
    (``discounted_turn_returns`` of ``turn_rewards [E, T]``) against the returns of every turn
    of its group that acted from the same anchor state (``turn_anchors [E, T, 2]``, Eq. 6):
    ``R - mean`` (``/ (std + eps)``, unbiased std, with ``norm_by_std``). A turn whose anchor
    no other turn of its group shares gets step advantage 0 (verl-agent: a group of one is
    its own mean). Episodes with a negative group id (an env error ended them) and turns not
    ``played`` are in no group and get 0.  # [E, T]"""
    e, t = turn_rewards.shape
    valid = played & (group_ids >= 0)[:, None]  # [E, T]
    episode = grpo(scores, group_ids, num_groups, norm_by_std=norm_by_std, eps=eps)  # [E]
    returns = discounted_turn_returns(turn_rewards, played, gamma).reshape(-1)  # [E * T]
    flat = valid.reshape(-1)
    segments = anchor_segments(jnp.repeat(group_ids, t), turn_anchors.reshape(-1, 2), flat)
    n = e * t
    count = jax.ops.segment_sum(jnp.ones(n, jnp.float32), segments, n)
    mean = jax.ops.segment_sum(returns, segments, n) / jnp.maximum(count, 1.0)
    at = jnp.minimum(segments, n - 1)  # (the invalid entries' values are masked below)
    centred = returns - mean[at]
    sq = jax.ops.segment_sum(jnp.square(centred) * flat, segments, n)
    std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))[at]
    step = centred / (std + eps) if norm_by_std else centred
    step = jnp.where(flat & (count[at] > 1), step, 0.0).reshape(e, t)
    return jnp.where(valid, episode[:, None] + step_weight * step, 0.0)


def broadcast(advantage: jax.Array, mask: jax.Array) -> jax.Array:
    """A per-trajectory advantage [B] on every generated token.  # [B, T]"""
    return advantage[:, None] * mask.astype(jnp.float32)
