"""StarPO-S / SNR-adaptive rollout filtering: keep the groups whose rollouts carry signal.

RAGEN scores each group of rollouts (same env seed) — by default the std of its trajectory
scores, the "SNR" proxy: a group where every rollout earned the same score yields zero
advantage under GRPO and mostly noise under PPO — and keeps the top groups by a strategy.
RAGEN cuts the dropped groups out of the batch and pads it back; here shapes stay static:
dropped groups get weight zero; the caller trains on rows of positive weight and multiplies
their advantages by it (``loss_scaling``, as RAGEN's ``filter_loss_scaling``).

Semantics follow RAGEN's ``ragen/trainer/rollout_filter.py`` exactly for each strategy
(including its edge cases: an unreachable ``top_p`` threshold keeps nothing, ``top_k`` keeps
at least one group, zero-score groups are removed first when ``include_zero`` is False).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

METRICS = ("reward_variance", "reward", "reward_sum", "length")
STRATEGIES = ("top_p", "top_k", "top_k_abs", "min_p")
ZERO = 1e-10


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """RAGEN's ``actor_rollout_ref.rollout.rollout_filter_*`` settings. The defaults keep
    everything (RAGEN's base config); StarPO-S in the V1 paper is
    ``strategy="top_k", value=0.25`` (keep the quarter of groups with the highest std)."""

    strategy: str = "top_p"
    value: float = 1.0
    filter_type: str = "largest"  # or "smallest"
    metric: str = "reward_variance"
    include_zero: bool = True
    top_p_prob_mode: str = "linear"  # or "softmax"
    selection_eps: float = 0.01
    loss_scaling: str = "none"  # "linear" or "sqrt": scale kept samples' advantages by the kept ratio

    def __post_init__(self):
        for field, allowed in (("strategy", STRATEGIES), ("metric", METRICS),
                               ("filter_type", ("largest", "smallest")),
                               ("top_p_prob_mode", ("linear", "softmax")),
                               ("loss_scaling", ("none", "linear", "sqrt"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"filter.{field} must be one of {allowed}, got {getattr(self, field)!r}")


def group_scores(scores: jax.Array, lengths: jax.Array | None, metric: str) -> jax.Array:
    """The per-group selection score. ``scores`` [G, S] trajectory scores (rewards plus
    penalties), ``lengths`` [G, S] response lengths (for ``metric="length"``).  # [G]"""
    if metric == "reward_variance":  # RAGEN: unbiased torch.std despite the name
        return jnp.std(scores, axis=1, ddof=1) if scores.shape[1] > 1 else jnp.zeros(scores.shape[0])
    if metric == "reward":
        return scores.mean(axis=1)
    if metric == "reward_sum":
        return scores.sum(axis=1)
    if lengths is None:
        raise ValueError("filter metric 'length' needs lengths")
    return lengths.astype(jnp.float32).mean(axis=1)


def select_groups(score: jax.Array, config: FilterConfig) -> jax.Array:
    """Which groups to keep, given their selection scores [G].  # [G] bool"""
    num_groups = score.shape[0]
    score = score.astype(jnp.float32)
    valid = jnp.ones(num_groups, bool) if config.include_zero else jnp.abs(score) > ZERO
    n_valid = valid.sum()
    sign = 1.0 if config.filter_type == "largest" else -1.0
    # Sort order: best first by the filter direction, invalid groups last.
    order = jnp.argsort(jnp.where(valid, -sign * score, jnp.inf), stable=True)
    rank = jnp.zeros(num_groups, jnp.int32).at[order].set(jnp.arange(num_groups, dtype=jnp.int32))

    if config.strategy == "top_p":
        if config.value >= 1.0:
            return valid
        if config.top_p_prob_mode == "softmax":
            probs = jax.nn.softmax(jnp.where(valid, sign * score, -jnp.inf))
            cumulative = jnp.cumsum(probs[order])
            k = jnp.minimum(jnp.sum(cumulative < config.value) + 1, n_valid)
            return (rank < k) & valid
        sorted_scores = score[order]
        sorted_valid = valid[order]
        threshold = config.value * jnp.sum(jnp.where(valid, score, 0.0)) - config.selection_eps
        before = jnp.cumsum(sorted_scores) - sorted_scores  # sum of the groups ahead
        take = jnp.cumprod((before < threshold) & (sorted_scores > 0) & sorted_valid).astype(bool)
        reached = jnp.sum(jnp.where(take, sorted_scores, 0.0)) >= threshold
        return (take & reached)[rank]
    if config.strategy in ("top_k", "top_k_abs"):
        k = int(config.value * num_groups) if config.strategy == "top_k" else int(config.value)
        k = jnp.maximum(jnp.minimum(k, n_valid), 1)
        return (rank < k) & valid
    # min_p
    if config.filter_type == "largest":
        best = jnp.max(jnp.where(valid, score, -jnp.inf))
        return valid & (score >= best * config.value - ZERO)
    best = jnp.min(jnp.where(valid, score, jnp.inf))
    return valid & (score <= best / (config.value + ZERO) + ZERO)


def filter_groups(scores: jax.Array, config: FilterConfig, lengths: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Applies the filter to a batch of ``G`` groups of ``S`` rollouts (group-major).

    Returns ``(keep [G] bool, weights [G * S] float32, metrics)``: ``weights`` is 0 for
    dropped rollouts and 1 (or the kept ratio, or its square root, with ``loss_scaling``)
    for kept ones. Metrics use RAGEN's names.
    """
    num_groups = scores.shape[0]
    score = group_scores(scores, lengths, config.metric)
    keep = select_groups(score, config)
    kept = keep.sum()
    ratio = kept / num_groups
    scale = {"none": 1.0, "linear": ratio, "sqrt": jnp.sqrt(ratio)}[config.loss_scaling]
    weights = jnp.repeat(keep.astype(jnp.float32) * scale, scores.shape[1])

    def chosen_mean(x):
        return jnp.where(kept > 0, jnp.sum(jnp.where(keep, x, 0.0)) / jnp.maximum(kept, 1), 0.0)

    std = jnp.std(scores, axis=1, ddof=1) if scores.shape[1] > 1 else jnp.zeros(num_groups)
    metrics = {
        "rollout/in_group_reward_std": std.mean(),
        "rollout/in_group_reward_mean": scores.mean(axis=1).mean(),
        "rollout/in_group_reward_max": scores.max(axis=1).mean(),
        "rollout/chosen_in_group_reward_std": chosen_mean(std),
        "rollout/chosen_in_group_reward_mean": chosen_mean(scores.mean(axis=1)),
        "rollout/filter_kept_count": kept.astype(jnp.float32),
        "rollout/filter_kept_ratio": ratio,
        "rollout/filter_zero_count": jnp.sum(jnp.abs(score) <= ZERO).astype(jnp.float32),
        "rollout/empty_after_filter": (kept == 0).astype(jnp.float32),
    }
    return keep, weights, metrics
