"""Reasoning-collapse diagnostics (RAGEN V2): does the reasoning still depend on the input?

Template collapse — reasoning that looks varied but ignores the state — is invisible to token
entropy. RAGEN detects it with a mutual-information estimate: score every sampled reasoning
``z_i`` under every input ``x_j`` by teacher forcing, giving a matrix ``l[i, j]`` of
log-probabilities; the true input of ``z_i`` is column ``c_i``. Then

- matched ``l[i, c_i]``; marginal ``logsumexp_j l[i, j] - log N`` (uniform mixture of inputs);
- H(Z|X) = -mean(matched), H(Z) = -mean(marginal), I(X;Z) = mean(matched - marginal), whose
  upper bound is log N;
- retrieval accuracy @k: the true input (or one identical to it) is among the k best columns;
- the MI z-score ``mean((matched - marginal) / (std(marginal) + 1e-3))``, the std taken over
  the sampled reasonings.

``cross_scores`` computes the matrix with the policy in one jitted batched pass;
``collapse_metrics`` turns it into RAGEN's numbers; ``first_turn_pairs`` samples the pairs
from a rollout batch (X = the first prompt, Z = the first response; episodes of a group share
X) and the trainer logs the result every ``diagnostics.compute_freq`` steps as
``collapse/first_turn/*`` with an EMA of the z-score. Partial (issue 6): trajectory-uniform
pairs, the gradient-norm-by-bucket analysis and the studies are not done yet.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.qwen import Qwen2ForCausalLM


def cross_scores(model: Qwen2ForCausalLM, inputs: list[list[int]], reasonings: list[list[int]]
                 ) -> tuple[jax.Array, jax.Array]:
    """Log-probability of every reasoning under every input, by teacher forcing.

    Returns ``(per_token_mean [n_z, n_x], sequence_sum [n_z, n_x])``: the mean and the sum over
    the tokens of ``z_i`` of ``log p(z_i | x_j)``. All ``n_z * n_x`` sequences ``[x_j | z_i]``
    run as one padded batch (right padding; real tokens form a prefix).
    """
    n_z, n_x = len(reasonings), len(inputs)
    length = max(len(x) for x in inputs) + max(len(z) for z in reasonings)
    length = -(-length // 64) * 64  # fewer distinct shapes to compile
    ids = np.zeros((n_z * n_x, length), np.int32)
    real = np.zeros((n_z * n_x, length), bool)
    scored = np.zeros((n_z * n_x, length), np.float32)
    for i, z in enumerate(reasonings):
        for j, x in enumerate(inputs):
            row = i * n_x + j
            seq = list(x) + list(z)
            ids[row, :len(seq)] = seq
            real[row, :len(seq)] = True
            scored[row, len(x):len(seq)] = 1.0
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
    logp = _scores(model, jnp.asarray(ids), jnp.asarray(real), jnp.asarray(positions),
                   jnp.asarray(scored))
    total = logp.reshape(n_z, n_x)
    counts = jnp.asarray([max(len(z), 1) for z in reasonings], jnp.float32)[:, None]
    return total / counts, total


@nnx.jit
def _scores(model, ids, real, positions, scored):
    from ragen_jax.starpo.update import token_logprobs

    logp, _ = token_logprobs(model, ids, real, positions)
    return jnp.sum(logp * scored, axis=-1)


def collapse_metrics(scores: jax.Array, true_column: jax.Array, input_ids: jax.Array | None = None,
                     ks: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, float]:
    """RAGEN's MI diagnostics from a cross-score matrix ``scores [n_z, n_x]``.

    ``true_column [n_z]`` is each reasoning's own input; ``input_ids [n_x]`` labels identical
    inputs (same id = same prompt, counted as a correct retrieval), default all distinct.
    """
    scores = jnp.asarray(scores, jnp.float32)
    n_z, n_x = scores.shape
    true_column = jnp.asarray(true_column)
    labels = jnp.arange(n_x) if input_ids is None else jnp.asarray(input_ids)
    matched = scores[jnp.arange(n_z), true_column]
    marginal = jax.scipy.special.logsumexp(scores, axis=1) - math.log(n_x)
    gap = matched - marginal
    out = {
        "conditional_entropy_est": float(-matched.mean()),
        "reasoning_entropy_est": float(-marginal.mean()),
        "mi_estimate": float(gap.mean()),
        "mi_upper_bound": math.log(n_x),
        "mi_zscore": float(jnp.mean(gap / (jnp.std(marginal) + 1e-3))),
        "marginal_std": float(jnp.std(marginal)),
    }
    # Retrieval: the best column equivalent to the truth against the other columns; ties are
    # broken uniformly at random (in expectation), so an input-blind policy scores chance.
    equivalent = labels[None, :] == labels[true_column][:, None]  # [n_z, n_x]
    best_true = jnp.max(jnp.where(equivalent, scores, -jnp.inf), axis=1)[:, None]
    higher = jnp.sum((scores > best_true) & ~equivalent, axis=1)
    ties = jnp.sum((scores == best_true) & ~equivalent, axis=1)
    n_distinct = len(np.unique(np.asarray(labels)))
    for k in ks:
        acc = float(jnp.mean(jnp.clip((k - higher) / (ties + 1.0), 0.0, 1.0)))
        chance = min(k / n_distinct, 1.0)
        out[f"retrieval_acc@{k}"] = acc
        out[f"retrieval_chance@{k}"] = chance
        out[f"retrieval_margin@{k}"] = acc - chance
    return out


def first_turn_pairs(input_ids: np.ndarray, loss_mask: np.ndarray, turn_ids: np.ndarray,
                     group_ids: np.ndarray, num_samples: int, rng: np.random.Generator
                     ) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """``(inputs, reasonings, true_column)`` for up to ``num_samples`` episodes of a batch.

    X is everything before the first sampled token (system + first user message + header),
    Z the first turn's sampled tokens. Episodes of one group share X, so inputs are one per
    sampled group and ``true_column`` indexes them. Episodes that sampled nothing are skipped.
    """
    rows = [b for b in range(input_ids.shape[0]) if (loss_mask[b] & (turn_ids[b] == 1)).any()]
    rows = sorted(rng.choice(rows, size=min(num_samples, len(rows)), replace=False).tolist()) if rows else []
    columns: dict[int, int] = {}
    inputs, reasonings, true_column = [], [], []
    for b in rows:
        first = loss_mask[b] & (turn_ids[b] == 1)
        start = int(np.argmax(first))
        g = int(group_ids[b])
        if g not in columns:
            columns[g] = len(inputs)
            inputs.append(input_ids[b, :start].tolist())
        reasonings.append(input_ids[b][first].tolist())
        true_column.append(columns[g])
    return inputs, reasonings, np.asarray(true_column, np.int32)
