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

Metrics: ``reward_variance`` (the group's score std), ``reward`` (mean), ``reward_sum``,
``length`` (mean sampled tokens), and RAGEN's policy-entropy metrics ``entropy`` (the group's
mean of per-trajectory entropies) and ``entropy_variance`` (their unbiased std, despite the
name, as RAGEN). A trajectory's entropy is the mean over its sampled tokens of the entropy of
the policy's next-token distribution at the sampling temperature. The filter runs before the
update computes any log-prob, so, as RAGEN does (its ``compute_log_prob`` before the filter),
the trainer runs one extra forward pass of the current policy over the whole rollout batch
(``trajectory_entropies``) when, and only when, an entropy metric is chosen. The sampler's
log-probs of the sampled tokens would give only a one-sample estimate (``-log p`` of the
drawn token), so the exact full-vocabulary entropy is computed instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.starpo.token_scores import token_logprobs

METRICS = ("reward_variance", "reward", "reward_sum", "length", "entropy", "entropy_variance")
ENTROPY_METRICS = ("entropy", "entropy_variance")
STRATEGIES = ("top_p", "top_k", "top_k_abs", "min_p")
ZERO = 1e-10


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """RAGEN's ``actor_rollout_ref.rollout.rollout_filter_*`` settings. The defaults keep
    everything (RAGEN's base config); StarPO-S in the V1 paper is
    ``strategy="top_k", value=0.25`` (keep the quarter of groups with the highest std)."""

    strategy: str = "top_p"  # top_p (groups until their metrics sum to value x the total) | top_k (a value share of the groups) | top_k_abs (value groups) | min_p (groups whose metric is at least value x the best) (RAGEN: top_p)
    value: float = 1.0  # the strategy's parameter; top_p 1.0 keeps every group (RAGEN: 1; StarPO-S: top_k 0.25)
    filter_type: str = "largest"  # keep the groups of the largest metric | smallest
    metric: str = "reward_variance"  # reward_variance (score std) | reward | reward_sum | length | entropy | entropy_variance
    include_zero: bool = True  # False: groups whose metric is zero are dropped before the strategy runs (RAGEN: True)
    top_p_prob_mode: str = "linear"  # top_p's weights: linear (the metric itself) | softmax (of the metric)
    selection_eps: float = 0.01  # top_p: slack subtracted from the threshold, so a float sum that just reaches it counts (RAGEN: 0.01)
    loss_scaling: str = "none"  # none | linear | sqrt: scale the kept samples' advantages by the kept ratio (or its square root)

    def __post_init__(self):
        for field, allowed in (("strategy", STRATEGIES), ("metric", METRICS),
                               ("filter_type", ("largest", "smallest")),
                               ("top_p_prob_mode", ("linear", "softmax")),
                               ("loss_scaling", ("none", "linear", "sqrt"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"filter.{field} must be one of {allowed}, got {getattr(self, field)!r}")


def _std(x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Unbiased std of each row [G, S] (RAGEN's torch.std); 0 for groups of one. With
    ``valid [G, S]``, over the valid entries only (0 for fewer than two)."""
    if valid is None:
        return jnp.std(x, axis=1, ddof=1) if x.shape[1] > 1 else jnp.zeros(x.shape[0])
    n = valid.sum(1)
    centred = jnp.where(valid, x - _mean(x, valid)[:, None], 0.0)
    return jnp.where(n > 1, jnp.sqrt(jnp.sum(centred**2, 1) / jnp.maximum(n - 1, 1)), 0.0)


def _mean(x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Mean of each row [G, S]; with ``valid``, of its valid entries (0 for none)."""
    if valid is None:
        return x.mean(axis=1)
    n = valid.sum(1)
    return jnp.where(n > 0, jnp.sum(jnp.where(valid, x, 0.0), 1) / jnp.maximum(n, 1), 0.0)


def group_scores(scores: jax.Array, lengths: jax.Array | None, metric: str,
                 entropies: jax.Array | None = None, valid: jax.Array | None = None) -> jax.Array:
    """The per-group selection score. ``scores`` [G, S] trajectory scores (rewards plus
    penalties), ``lengths`` [G, S] response lengths (for ``metric="length"``), ``entropies``
    [G, S] per-trajectory mean token entropies (for the entropy metrics); ``valid`` [G, S]
    (None: all) the rollouts that count (an env error's episode does not).  # [G]"""
    if metric == "reward_variance":  # RAGEN: unbiased torch.std despite the name
        return _std(scores, valid)
    if metric in ENTROPY_METRICS:
        if entropies is None:
            raise ValueError(f"filter metric {metric!r} needs entropies")
        return _mean(entropies, valid) if metric == "entropy" else _std(entropies, valid)
    if metric == "reward":
        return _mean(scores, valid)
    if metric == "reward_sum":
        return scores.sum(axis=1) if valid is None else jnp.sum(jnp.where(valid, scores, 0.0), 1)
    if lengths is None:
        raise ValueError("filter metric 'length' needs lengths")
    return _mean(lengths.astype(jnp.float32), valid)


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


@functools.partial(jax.jit, static_argnames=("config",))  # one program, not ~35 op by op
def filter_groups(scores: jax.Array, config: FilterConfig, lengths: jax.Array | None = None,
                  entropies: jax.Array | None = None, valid: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Applies the filter to a batch of ``G`` groups of ``S`` rollouts (group-major);
    ``lengths`` and ``entropies`` [G, S] as ``group_scores`` needs them for the metric.

    ``valid [G, S]`` (None: all) marks the rollouts that count: the others (episodes an env
    error ended) take no part in any group statistic, get weight 0, and a group with none
    left is never kept.

    Returns ``(keep [G] bool, weights [G * S] float32, metrics)``: ``weights`` is 0 for
    dropped rollouts and 1 (or the kept ratio, or its square root, with ``loss_scaling``)
    for kept ones. Metrics use RAGEN's names.
    """
    num_groups = scores.shape[0]
    score = group_scores(scores, lengths, config.metric, entropies, valid)
    keep = select_groups(score, config)
    if valid is not None:
        keep = keep & valid.any(1)
    kept = keep.sum()
    ratio = kept / num_groups
    scale = {"none": 1.0, "linear": ratio, "sqrt": jnp.sqrt(ratio)}[config.loss_scaling]
    weights = jnp.repeat(keep.astype(jnp.float32) * scale, scores.shape[1])
    if valid is not None:
        weights = weights * valid.reshape(-1)

    def chosen_mean(x):
        return jnp.where(kept > 0, jnp.sum(jnp.where(keep, x, 0.0)) / jnp.maximum(kept, 1), 0.0)

    std, mean = _std(scores, valid), _mean(scores, valid)
    best = scores.max(axis=1) if valid is None else jnp.max(jnp.where(valid, scores, -jnp.inf), 1)
    best = jnp.where(jnp.isfinite(best), best, 0.0)
    metrics = {
        "rollout/in_group_reward_std": std.mean(),
        "rollout/in_group_reward_mean": mean.mean(),
        "rollout/in_group_reward_max": best.mean(),
        "rollout/chosen_in_group_reward_std": chosen_mean(std),
        "rollout/chosen_in_group_reward_mean": chosen_mean(mean),
        "rollout/filter_kept_count": kept.astype(jnp.float32),
        "rollout/filter_kept_ratio": ratio,
        "rollout/filter_zero_count": jnp.sum(jnp.abs(score) <= ZERO).astype(jnp.float32),
        "rollout/empty_after_filter": (kept == 0).astype(jnp.float32),
    }
    if entropies is not None:
        e_std, e_mean = _std(entropies, valid), _mean(entropies, valid)
        metrics |= {
            "rollout/in_group_entropy_std": e_std.mean(),
            "rollout/in_group_entropy_mean": e_mean.mean(),
            "rollout/in_group_entropy_max": entropies.max(axis=1).mean(),
            "rollout/chosen_in_group_entropy_std": chosen_mean(e_std),
            "rollout/chosen_in_group_entropy_mean": chosen_mean(e_mean),
        }
    return keep, weights, metrics


def trajectory_entropies(model, input_ids: np.ndarray, attention_mask: np.ndarray,
                         positions: np.ndarray, loss_mask: np.ndarray, temperature: float,
                         rows_per_pass: int) -> np.ndarray:
    """Each row's mean, over its sampled tokens (``loss_mask``), of the entropy of ``model``'s
    next-token distribution at ``temperature``; 0 for a row that sampled nothing. Rows run
    ``rows_per_pass`` at a time (the last pass padded, one compiled shape).  # [B] float32"""
    rows = input_ids.shape[0]
    size = max(1, min(rows_per_pass, rows))
    total = -(-rows // size) * size

    def pad(x):
        return np.concatenate([x, np.zeros((total - rows, *x.shape[1:]), x.dtype)])

    arrays = [pad(np.asarray(a)) for a in (input_ids, attention_mask, positions, loss_mask)]
    out = [_mean_entropy(model, *(jnp.asarray(a[s:s + size]) for a in arrays), temperature)
           for s in range(0, total, size)]
    return np.asarray(jnp.concatenate(out))[:rows]


@functools.partial(nnx.jit, static_argnums=(5,))
def _mean_entropy(model, input_ids, attention_mask, positions, loss_mask, temperature):
    mask = loss_mask.astype(jnp.float32)
    _, entropy = token_logprobs(model, input_ids, attention_mask, positions, temperature,
                                loss_mask=loss_mask.astype(bool))
    return jnp.sum(entropy * mask, axis=1) / jnp.maximum(mask.sum(1), 1.0)
