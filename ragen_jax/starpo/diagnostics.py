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

``cross_scores`` computes the matrix with the policy in jitted micro-batches;
``collapse_metrics`` turns it into RAGEN's numbers. Two ways to sample the pairs from a
rollout batch, as RAGEN: ``first_turn_pairs`` (X = the first prompt, Z = the first response;
episodes of a group share X, one column per group) and ``trajectory_uniform_pairs`` (a
trajectory uniformly, then one of its turns uniformly; X = the whole context before that
turn's sampled tokens, Z = those tokens; one column per pair, identical X's share a label).
``prompt_labels`` gives those labels and ``first_turn_validity`` RAGEN's first-turn counts.
The trainer logs both kinds every ``diagnostics.compute_freq`` steps under RAGEN's names
``collapse_first_turn_sample/*`` and ``collapse_trajectory_sample/*`` (with per-token variants
and an EMA of the z-score per kind), plus ``collapse/first_turn_{num_total,num_valid,
valid_rate}``. The gradient-norm-by-reward-std-bucket analysis is
``ragen_jax.starpo.gradient_analysis``. One difference from RAGEN: Z is the whole sampled turn
(RAGEN takes the text between the think tags, re-tokenised), so the estimates also run with
``enable_think=False``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.qwen import Qwen2ForCausalLM


def cross_scores(model: Qwen2ForCausalLM, inputs: list[list[int]], reasonings: list[list[int]],
                 micro_batch_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Log-probability of every reasoning under every input, by teacher forcing.

    Returns ``(per_token_mean [n_z, n_x], sequence_sum [n_z, n_x])``: the mean and the sum over
    the tokens of ``z_i`` of ``log p(z_i | x_j)``. The ``n_z * n_x`` sequences ``[x_j | z_i]``
    run as padded batches (right padding; real tokens form a prefix) of ``micro_batch_size``
    rows (RAGEN: 128; None = all at once), which bounds memory for long trajectory contexts.
    """
    n_z, n_x = len(reasonings), len(inputs)
    n = n_z * n_x
    chunk = n if not micro_batch_size else min(int(micro_batch_size), n)
    rows = -(-n // chunk) * chunk  # padded to whole micro-batches (one compiled shape)
    length = max(len(x) for x in inputs) + max(len(z) for z in reasonings)
    length = -(-length // 64) * 64  # fewer distinct shapes to compile
    ids = np.zeros((rows, length), np.int32)
    real = np.zeros((rows, length), bool)
    real[n:, 0] = True  # filler rows: one real token, nothing scored
    scored = np.zeros((rows, length), np.float32)
    for i, z in enumerate(reasonings):
        for j, x in enumerate(inputs):
            row = i * n_x + j
            seq = list(x) + list(z)
            ids[row, :len(seq)] = seq
            real[row, :len(seq)] = True
            scored[row, len(x):len(seq)] = 1.0
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
    logp = jnp.concatenate([
        _scores(model, *(jnp.asarray(a[s:s + chunk]) for a in (ids, real, positions, scored)))
        for s in range(0, rows, chunk)])
    total = logp[:n].reshape(n_z, n_x)
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


def trajectory_uniform_pairs(input_ids: np.ndarray, loss_mask: np.ndarray, turn_ids: np.ndarray,
                             num_samples: int, rng: np.random.Generator
                             ) -> tuple[list[list[int]], list[list[int]], np.ndarray, np.ndarray]:
    """``(inputs, reasonings, true_column, labels)``: RAGEN's trajectory-uniform pairs.

    Each of ``num_samples`` pairs picks a trajectory uniformly (with replacement, among those
    that sampled anything), then one of its turns with sampled tokens uniformly; X is every
    token before that turn's first sampled token (system, earlier turns, this turn's prompt),
    Z the turn's sampled tokens. Every pair is its own column (``true_column = arange``);
    ``labels [n]`` are equal for identical X's (``prompt_labels``), so that retrieving an
    identical prompt counts as correct. Deterministic given ``rng``'s state.
    """
    sampled = loss_mask.astype(bool)  # [B, L]
    turns = [np.unique(turn_ids[b][sampled[b]]) for b in range(input_ids.shape[0])]
    rows = [b for b, t in enumerate(turns) if t.size]
    inputs, reasonings = [], []
    if rows and num_samples > 0:
        for b in rng.choice(rows, size=num_samples, replace=True).tolist():
            turn = rng.choice(turns[b])
            z = sampled[b] & (turn_ids[b] == turn)  # [L]
            inputs.append(input_ids[b, :int(np.argmax(z))].tolist())
            reasonings.append(input_ids[b][z].tolist())
    return inputs, reasonings, np.arange(len(inputs), dtype=np.int32), prompt_labels(inputs)


def prompt_labels(inputs: list[list[int]]) -> np.ndarray:
    """One integer per input, equal exactly for identical token sequences (first-seen order),
    for ``collapse_metrics(..., input_ids=labels)``.  # [n] int32"""
    seen: dict[tuple[int, ...], int] = {}
    return np.asarray([seen.setdefault(tuple(x), len(seen)) for x in inputs], np.int32)


def first_turn_validity(trajectories: list[dict]) -> tuple[int, int]:
    """``(num_total, num_valid)``: episodes that played a first turn, and those whose first
    answer parsed without a format error (RAGEN's ``collapse/first_turn_num_{total,valid}``;
    reads ``RolloutBatch.trajectories[i]["turns"][0]["format_error"]``)."""
    firsts = [t["turns"][0] for t in trajectories if t.get("turns") and "format_error" in t["turns"][0]]
    return len(firsts), sum(not t["format_error"] for t in firsts)
