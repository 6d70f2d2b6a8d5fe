"""StarPO losses: PPO clipped surrogate (clip-higher, dual clip), KL estimators, entropy,
clipped value loss, and the loss aggregation modes — as veRL v0.6 (RAGEN's backend) defines
them, in pure JAX.

Every loss returns a per-token matrix; ``aggregate`` reduces it to a ``(numerator,
denominator)`` pair so that gradient accumulation over micro-batches is exact: sum the
numerators and the denominators of all micro-batches, then divide once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3", "mse")


def aggregate(loss: jax.Array, mask: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """``(numerator, denominator)`` of the aggregated loss; the loss is their ratio.

    - ``token-mean``: sum over all masked tokens / their count.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean.
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum (Dr.GRPO).
    - ``seq-mean-token-sum-norm``: sum of sequence sums / T, a constant horizon.
    Sequences with no masked token do not count in the sequence means (veRL would divide
    by zero or count them as 0).
    """
    mask = mask.astype(jnp.float32)
    seq_sum = jnp.sum(loss * mask, axis=-1)  # [B]
    seq_len = jnp.sum(mask, axis=-1)  # [B]
    nonempty = (seq_len > 0).astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(seq_sum), jnp.sum(seq_len)
    if mode == "seq-mean-token-mean":
        return jnp.sum(seq_sum / jnp.maximum(seq_len, 1.0)), jnp.sum(nonempty)
    if mode == "seq-mean-token-sum":
        return jnp.sum(seq_sum), jnp.sum(nonempty)
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(seq_sum), jnp.asarray(loss.shape[-1], jnp.float32)
    raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")


def ratio_of(num_den: tuple[jax.Array, jax.Array]) -> jax.Array:
    num, den = num_den
    return num / jnp.maximum(den, 1e-8)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                clip_low: float = 0.2, clip_high: float = 0.28, clip_c: float = 3.0
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate per token, with clip-higher (``1 - clip_low``, ``1 + clip_high``)
    and dual clip: for negative advantages the loss is capped at ``-A * clip_c``. The log
    ratio is clamped to +-20. Returns ``(loss [B, T], metrics)``."""
    log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = jnp.maximum(loss1, loss2)
    loss3 = -advantages * clip_c
    dual = jnp.minimum(loss3, clipped)
    loss = jnp.where(advantages < 0, dual, clipped)
    metrics = {
        "actor/ppo_kl": masked_mean(-log_ratio, mask),
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).astype(jnp.float32), mask),
        "actor/pg_clipfrac_lower": masked_mean(((clipped > loss3) & (advantages < 0)).astype(jnp.float32), mask),
    }
    return loss, metrics


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k1") -> jax.Array:
    """Per-token KL(policy || reference) estimate from sampled tokens' log-probs.

    ``k1``: ``logp - ref`` (unbiased, high variance); ``k3``: Schulman's low-variance
    ``exp(ref - logp) - (ref - logp) - 1``, clamped to [-10, 10] as veRL does; ``mse``:
    ``0.5 (logp - ref)^2``."""
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k3":
        return jnp.clip(jnp.exp(-diff) + diff - 1.0, -10.0, 10.0)
    if estimator == "mse":
        return 0.5 * jnp.square(diff)
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the softmax over the last axis.  # [..., V] -> [...]"""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               clip_range: float = 0.5) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss per token, ``0.5 * max((v - R)^2, (clip(v, old +- c) - R)^2)``."""
    clipped_values = jnp.clip(values, old_values - clip_range, old_values + clip_range)
    loss1 = jnp.square(values - returns)
    loss2 = jnp.square(clipped_values - returns)
    metrics = {
        "critic/vf_clipfrac": masked_mean((loss2 > loss1).astype(jnp.float32), mask),
        "critic/vpred_mean": masked_mean(values, mask),
    }
    return 0.5 * jnp.maximum(loss1, loss2), metrics
