"""Advantage estimators of StarPO, as pure functions on padded token arrays.

Arrays are ``[B, T]`` over a trajectory's token slots; ``mask`` is the loss mask (1 on tokens
the policy generated). Rewards sit on generated tokens (by default the trajectory score on the
last one). Outcome estimators (GRPO and friends) work on per-trajectory scores ``[B]`` and
broadcast over the mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ragen_jax.starpo.losses import masked_mean


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over masked entries (veRL: unbiased variance);
    0 where ``mask`` is 0. The mean is taken of ``x - min``, so equal entries give exactly 0
    (a float32 mean of equal values need not equal them, and with a variance of that
    rounding's size the division scales it up to order 1)."""
    mask = mask.astype(jnp.float32)
    low = jnp.min(jnp.where(mask > 0, x, jnp.inf))
    shifted = x - jnp.where(jnp.isfinite(low), low, 0.0)
    centred = shifted - masked_mean(shifted, mask)
    n = jnp.sum(mask)
    var = jnp.sum(jnp.square(centred) * mask) / jnp.maximum(n - 1, 1.0)
    return jnp.where(mask > 0, centred * jax.lax.rsqrt(var + eps), 0.0)


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


class Moments(NamedTuple):
    """Per-segment statistics [S] of some values: a value ``x`` of segment ``k`` centres to
    ``centred(x, k) = (x - low[k]) - offset[k]``, i.e. ``x - mean``. The mean is taken of
    ``x - low`` (``low`` the segment's smallest value), so a segment of equal values has
    ``offset`` 0 and centres exactly to 0: a float32 sum of equal values divided by their
    count need not give the value back, and ``/ (std + eps)`` turned that rounding into GRPO
    advantages of up to 0.32 for a group of 2-16 that all scored 3.3, 0.97 for 12345.678
    (verl-agent's float32 torch code gives the same)."""

    count: jax.Array  # [S] float32
    low: jax.Array  # [S] the segment's smallest value (0 for an empty segment)
    offset: jax.Array  # [S] mean of (x - low)
    std: jax.Array  # [S] unbiased (torch.std), 0 for fewer than two values

    def centred(self, x: jax.Array, segments: jax.Array) -> jax.Array:
        at = jnp.clip(segments, 0, self.count.shape[0] - 1)
        return (x - self.low[at]) - self.offset[at]


def segment_moments(values: jax.Array, segments: jax.Array, num_segments: int) -> Moments:
    """``Moments`` of ``values [N]`` in ``segments [N]``; entries whose segment is outside
    ``[0, num_segments)`` count in none."""
    values = values.astype(jnp.float32)
    count = jax.ops.segment_sum(jnp.ones_like(values), segments, num_segments)
    low = jax.ops.segment_min(values, segments, num_segments)
    low = jnp.where(count > 0, low, 0.0)  # (an empty segment's min is +inf)
    at = jnp.clip(segments, 0, num_segments - 1)
    shifted = values - low[at]
    offset = jax.ops.segment_sum(shifted, segments, num_segments) / jnp.maximum(count, 1.0)
    sq = jax.ops.segment_sum(jnp.square(shifted - offset[at]), segments, num_segments)
    std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
    return Moments(count, low, offset, std)


def _group_stats(scores: jax.Array, group_ids: jax.Array, num_groups: int):
    """Each row's ``(group count, score - group mean, group std)`` [B], exact for a group of
    equal scores (``segment_moments``)."""
    m = segment_moments(scores, group_ids, num_groups)
    at = jnp.clip(group_ids, 0, num_groups - 1)
    return m.count[at], m.centred(scores, group_ids), m.std[at]


def grpo(scores: jax.Array, group_ids: jax.Array, num_groups: int, norm_by_std: bool = True,
         eps: float = 1e-6) -> jax.Array:
    """GRPO: ``(s - group mean) / (group std + eps)`` with the unbiased std; Dr.GRPO with
    ``norm_by_std=False``: ``s - group mean``. A group of one gets mean 0 and std 1 (RAGEN and
    veRL), i.e. its raw score. Scores arrive after the reward normalisation
    (``starpo.normalization``); GRPO is invariant to its per-group affine maps, so only
    ``asym_clip``'s clamp changes what GRPO sees.  # [B]"""
    scores = scores.astype(jnp.float32)
    count, centred, std = _group_stats(scores, group_ids, num_groups)
    single = count < 2
    centred = jnp.where(single, scores, centred)
    return centred / (jnp.where(single, 1.0, std) + eps) if norm_by_std else centred


def rloo(scores: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    """Leave-one-out baseline: ``s - mean of the others`` (= ``n/(n-1) (s - mean)``); a group
    of one keeps its raw score (veRL).  # [B]"""
    scores = scores.astype(jnp.float32)
    count, centred, _ = _group_stats(scores, group_ids, num_groups)
    return jnp.where(count > 1, centred * count / jnp.maximum(count - 1.0, 1.0), scores)


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
    count, centred, _ = _group_stats(scores, group_ids, num_groups)
    centred = jnp.where(count < 2, scores, centred)
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


GIGPO_EPISODE_STATS = ("episode", "turn")  # what GiGPO's episode statistics count (``gigpo``)


def gigpo(scores: jax.Array, group_ids: jax.Array, num_groups: int, turn_rewards: jax.Array,
          turn_anchors: jax.Array, played: jax.Array, gamma: float = 0.95,
          step_weight: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6,
          episode_stats: str = "episode", turn_penalties: jax.Array | None = None
          ) -> jax.Array:
    """GiGPO (Group-in-Group Policy Optimization, arXiv 2505.10978), per turn: the episode's
    group advantage (Eq. 3: ``scores [E]`` in ``group_ids [E]``, GRPO's centring) plus
    ``step_weight`` times the turn's step advantage (Eq. 7-8): its discounted return
    (``discounted_turn_returns`` of ``turn_rewards [E, T]``) against the returns of every turn
    of its group that acted from the same anchor state (``turn_anchors [E, T, 2]``, Eq. 6):
    ``R - mean`` (``/ (std + eps)``, unbiased std, with ``norm_by_std``). A turn whose anchor
    no other turn of its group shares gets step advantage 0 (verl-agent: a group of one is
    its own mean). Episodes with a negative group id (an env error ended them) and turns not
    ``played`` are in no group and get 0.  # [E, T]

    ``episode_stats``, what the episode part's group mean and std count: ``"episode"`` each
    episode once (RAGEN's de-duplication; verl-agent's ``compute_mean_std_cross_steps=False``);
    ``"turn"`` each episode once per turn it played (verl-agent's default,
    ``compute_mean_std_cross_steps=True``, where every step row adds its episode's score: an
    episode weighs by its number of turns). Either way a group of one entry keeps its raw
    score (mean 0, std 1, as GRPO's group of one).

    ``turn_penalties [E, T]``: None, each turn's penalty is part of its score, in
    ``turn_rewards`` and ``scores`` (so discounted into the earlier turns' step returns and
    summed into the episode's score). Given, the penalties, still included in ``turn_rewards``
    and ``scores``, are moved onto their own turn as verl-agent places its invalid-action
    penalty (``apply_invalid_action_penalty`` in its ``ray_trainer.py``, run after
    ``compute_step_discounted_returns``, subtracts ``coef * invalid`` from each step row's
    ``step_rewards``, i.e. its discounted return, and from the episode reward that its
    ``EpisodeRewardManager`` put on the row's last token): a turn's step return is the
    discounted return of the rewards without penalties plus its own penalty, its episode score
    the episode's score without penalties plus its own. Under ``"episode"`` statistics a
    group's entries are then each episode's first turn's score (verl-agent keeps the first row
    it meets of each episode; its rows are in turn order unless ``balance_batch`` reorders
    them), under ``"turn"`` every turn's own."""
    if episode_stats not in GIGPO_EPISODE_STATS:
        raise ValueError(f"episode_stats must be one of {GIGPO_EPISODE_STATS}, got "
                         f"{episode_stats!r}")
    e, t = turn_rewards.shape
    valid = played & (group_ids >= 0)[:, None]  # [E, T]
    scores = scores.astype(jnp.float32)
    rewards = turn_rewards.astype(jnp.float32)
    own = jnp.broadcast_to(scores[:, None], (e, t))  # each turn's episode score
    if turn_penalties is not None:
        penalty = jnp.where(played, turn_penalties.astype(jnp.float32), 0.0)
        own = own - jnp.sum(penalty, 1, keepdims=True) + penalty
        rewards = rewards - penalty
    if episode_stats == "turn":
        stats = segment_moments(own.reshape(-1), jnp.where(valid, group_ids[:, None],
                                                           num_groups).reshape(-1), num_groups)
    else:
        stats = segment_moments(own[:, 0], group_ids, num_groups)
    at = jnp.clip(group_ids, 0, num_groups - 1)
    single = (stats.count[at] < 2)[:, None]
    episode = jnp.where(single, own, stats.centred(own, group_ids[:, None]))
    if norm_by_std:
        episode = episode / (jnp.where(single, 1.0, stats.std[at][:, None]) + eps)

    returns = discounted_turn_returns(rewards, played, gamma)  # [E, T]
    if turn_penalties is not None:
        returns = returns + penalty
    flat = valid.reshape(-1)
    segments = anchor_segments(jnp.repeat(group_ids, t), turn_anchors.reshape(-1, 2), flat)
    n = e * t
    steps = segment_moments(returns.reshape(-1), segments, n)
    at = jnp.minimum(segments, n - 1)  # (the invalid entries' values are masked below)
    step = steps.centred(returns.reshape(-1), segments)
    if norm_by_std:
        step = step / (steps.std[at] + eps)
    step = jnp.where(flat & (steps.count[at] > 1), step, 0.0).reshape(e, t)
    return jnp.where(valid, episode + step_weight * step, 0.0)


def broadcast(advantage: jax.Array, mask: jax.Array) -> jax.Array:
    """A per-trajectory advantage [B] on every generated token.  # [B, T]"""
    return advantage[:, None] * mask.astype(jnp.float32)
