"""Gradient analysis by reward-variance bucket (RAGEN's ``gradient_reporter``), no update.

Which groups drive the update, and through which term of the loss? RAGEN ranks the batch's
groups by their reward std, splits them into equal-count buckets (low -> high variance, the
remainder going to the last bucket), and reports the global gradient norm of each loss
component (task / entropy / KL) on each bucket alone and on the whole batch, without stepping
the optimizer. Low-variance groups carry little advantage signal, so if their gradient is
dominated by the entropy or KL term, that is where the policy drifts without learning.

``reward_std_buckets`` assigns the buckets (host, numpy); ``make_gradient_analysis`` returns
one jitted function ``(params, rest, batch, bucket_ids) -> norms``. The components are the
terms of ``update.actor_loss_terms`` as they enter the loss (coefficients applied), each
aggregated with the run's ``loss_agg_mode`` over the selected rows only, exactly as an update
on those rows alone would see it; so the components of one selection add up to its full
gradient. Cost: one forward + backward of the batch per (selection, component).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ragen_jax.starpo import losses
from ragen_jax.starpo.optimizer_step import (
    Prefixes,
    TrainBatch,
    UpdateConfig,
    actor_loss_terms,
    rows_prefix,
    shared_prefix_arrays,
)


def components(config: UpdateConfig) -> tuple[str, ...]:
    """The loss components reported for ``config``: ``pg``, ``entropy`` (if its coefficient is
    non-zero) and ``kl`` (if ``kl_coef > 0``)."""
    return ("pg",) + (("entropy",) if config.entropy_coeff else ()) + (("kl",) if config.kl_coef else ())


def reward_std_buckets(scores: np.ndarray, num_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """``(bucket of each group [G], mean reward std of each bucket [K])`` for ``scores [G, S]``.

    Groups are ranked by their unbiased reward std (as RAGEN's filter) and split into
    ``num_buckets`` equal-count buckets, low to high; the remainder goes to the last bucket.
    With fewer groups than buckets the first buckets are empty (their mean is NaN).
    """
    scores = np.asarray(scores, np.float64)
    std = scores.std(axis=1, ddof=1) if scores.shape[1] > 1 else np.zeros(scores.shape[0])
    order = np.argsort(std, kind="stable")
    per = scores.shape[0] // num_buckets
    rank_bucket = np.minimum(np.arange(scores.shape[0]) // max(per, 1), num_buckets - 1)
    if per == 0:  # fewer groups than buckets: the top buckets get one group each
        rank_bucket = num_buckets - scores.shape[0] + np.arange(scores.shape[0])
    bucket = np.empty(scores.shape[0], np.int32)
    bucket[order] = rank_bucket
    means = np.array([std[bucket == k].mean() if (bucket == k).any() else np.nan
                      for k in range(num_buckets)])
    return bucket, means


def make_gradient_analysis(graphdef: Any, config: UpdateConfig, num_buckets: int,
                           micro_batches: int = 1) -> Callable:
    """The jitted ``analyse(params, rest, batch: TrainBatch, bucket_ids [B], prefixes=None)
    -> dict`` (``prefixes``: the batch's shared prefixes, recomputed in every micro-batch).

    Returns ``{"<component>": norm, "bucket<k>/<component>": norm, "bucket<k>/rows": count}``
    (scalars): the global L2 norm of the gradient of each component of the actor loss over the
    whole batch and over the rows of bucket ``k`` alone (rows with ``bucket_ids == k``; a
    bucket without rows has norm 0). ``params`` are only read. ``micro_batches`` splits the
    rows into that many gradient-accumulation chunks (exact; memory only), like the update.
    """
    names = components(config)
    num_sel = 1 + num_buckets  # selection 0 = every row, 1 + k = bucket k

    def numerators(params, rest, micro: TrainBatch, select: jax.Array,
                   prefixes: Prefixes | None) -> jax.Array:
        """Loss numerators of every (selection, component) on one micro-batch.  # [num_sel * C]"""
        model = nnx.merge(graphdef, params, rest)
        prefix = rows_prefix(shared_prefix_arrays(model, prefixes), prefixes, micro.prefix_index)
        terms, _ = actor_loss_terms(model, micro, config, prefix)
        return jnp.stack([losses.aggregate(terms[c], micro.loss_mask * select[s][:, None],
                                           config.loss_agg_mode)[0]
                          for s in range(num_sel) for c in names])

    @jax.jit
    def analyse(params, rest, batch: TrainBatch, bucket_ids: jax.Array,
                prefixes: Prefixes | None = None) -> dict[str, jax.Array]:
        rows = batch.input_ids.shape[0]
        select = jnp.concatenate([jnp.ones((1, rows), jnp.float32),
                                  (bucket_ids[None, :] == jnp.arange(num_buckets)[:, None]
                                   ).astype(jnp.float32)])  # [num_sel, B]
        dens = jnp.stack([losses.aggregate(jnp.zeros_like(batch.loss_mask),
                                           batch.loss_mask * select[s][:, None],
                                           config.loss_agg_mode)[1]
                          for s in range(num_sel) for _ in names])  # [num_sel * C]
        split = lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])  # noqa: E731
        micro, micro_select = jax.tree.map(split, batch), jnp.moveaxis(split(select.T), 2, 1)

        def norm_of(index):  # one (selection, component): accumulate its gradient, then norm
            onehot = jax.nn.one_hot(index, num_sel * len(names))

            def accumulate(grads, mb):
                g = jax.grad(lambda p: jnp.dot(numerators(p, rest, *mb, prefixes), onehot))(params)
                return jax.tree.map(jnp.add, grads, g), None

            grads, _ = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params),
                                    (micro, micro_select))
            return optax.global_norm(grads) / jnp.maximum(dens[index], 1e-8)

        norms = jax.lax.map(norm_of, jnp.arange(num_sel * len(names)))
        out = {}
        for s in range(num_sel):
            prefix = "" if s == 0 else f"bucket{s - 1}/"
            for i, c in enumerate(names):
                out[prefix + c] = norms[s * len(names) + i]
            if s:
                out[f"{prefix}rows"] = jnp.sum(select[s])
        return out

    return analyse


def report(norms: dict[str, float], mean_std: np.ndarray) -> dict[str, float]:
    """RAGEN's ``collapse_grad/*`` names from the fetched ``grad_analysis/*`` norms of
    ``make_gradient_analysis`` and each bucket's mean reward std: the whole batch's
    ``<component>_grad_norm``, and per non-empty bucket its component norms, ``num_rows``
    and ``reward_std_mean`` (a bucket with no rows, or whose groups were all filtered out,
    is not reported)."""
    norms = {k.removeprefix("grad_analysis/"): v for k, v in norms.items()
             if k.startswith("grad_analysis/")}
    out = {f"collapse_grad/{k}_grad_norm": v for k, v in norms.items() if "/" not in k}
    for k in range(len(mean_std)):
        if norms.get(f"bucket{k}/rows", 0) == 0:
            continue
        prefix = f"collapse_grad/bucket{k}/"
        out |= {prefix + name.split("/")[1] + "_grad_norm": v for name, v in norms.items()
                if name.startswith(f"bucket{k}/") and not name.endswith("/rows")}
        out |= {prefix + "num_rows": norms[f"bucket{k}/rows"],
                prefix + "reward_std_mean": float(mean_std[k])}
    return out
