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
  the sampled reasonings (and over an EMA of that std across steps, ``mi_zscore_ema``).

As RAGEN, ``l`` is the per-token mean log-probability for the main names (``mi_estimate``,
``conditional_entropy_est``, ``mi_zscore``, retrieval) and the sequence sum for the
``_seq`` variants (``mi_seq_estimate``, ``conditional_entropy_seq_est``, ...), so curves under
one name are comparable with RAGEN's.

``cross_scores`` computes the matrix with the policy in jitted micro-batches (the output head
runs on chunks of positions, ``starpo.token_scores``: a micro-batch's logits are never all in
memory at once);
``collapse_metrics`` turns it into RAGEN's numbers. Two ways to sample the pairs from a
rollout batch, as RAGEN: ``first_turn_pairs`` (X = the first prompt, Z = the first response;
episodes of a group share X, one column per group) and ``trajectory_uniform_pairs`` (a
trajectory uniformly, then one of its turns uniformly; X = the whole context before that
turn's sampled tokens, Z = those tokens; one column per pair, identical X's share a label).
``prompt_labels`` gives those labels, ``first_turn_validity`` RAGEN's first-turn counts and
``valid_thinking_counts`` its share of turns with a parsed, non-blank reasoning.
The trainer logs both kinds every ``diagnostics.compute_freq`` steps under RAGEN's names
``collapse_first_turn_sample/*`` and ``collapse_trajectory_sample/*`` (per-token means and
sequence-sum ``_seq`` variants, and EMAs of the marginal's std per kind), plus ``collapse/first_turn_{num_total,
num_valid,valid_rate}`` and (with ``enable_think``) ``collapse/valid_thinking_rate``. The
gradient-norm-by-reward-std-bucket analysis is ``ragen_jax.starpo.gradient_analysis``.

One difference from RAGEN: Z is the whole sampled turn (RAGEN takes the text between the
think tags, re-tokenised), so the estimates also run with ``enable_think=False``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.qwen import Qwen2ForCausalLM
from ragen_jax.shapes import round_up
from ragen_jax.starpo.token_scores import target_logprobs


def cross_scores(model: Qwen2ForCausalLM, inputs: list[list[int]], reasonings: list[list[int]],
                 micro_batch_size: int | None = None, micro_batch_tokens: int | None = None,
                 shape: tuple[int, int, int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Log-probability of every reasoning under every input, by teacher forcing.

    Returns ``(per_token_mean [n_z, n_x], sequence_sum [n_z, n_x])``: the mean and the sum over
    the tokens of ``z_i`` of ``log p(z_i | x_j)``.

    Each input is encoded once into a KV cache; every pair ``(z_i, x_j)`` then runs only the
    tokens of ``z_i`` on a copy of ``x_j``'s cache. The cost is ``n_x |x| + n_z n_x |z|``
    tokens instead of the ``n_z n_x (|x| + |z|)`` of scoring every ``[x_j | z_i]`` from
    scratch, which matters when the inputs are long multi-turn contexts and the reasonings
    short. Pairs run in batches of ``micro_batch_size`` (RAGEN: 128; None = all at once) and of
    at most ``micro_batch_tokens`` cache slots (pairs x (input + reasoning) width; None = no
    bound), which bounds memory: each pair holds a copy of its input's cache, and 128 pairs
    of a 2.5k-token context on the 0.5B shape would hold ~5 GiB of cache copies alone.

    ``shape = (n_x, n_z, width_x, width_z)``: the least counts and widths of the programs,
    fixed by the caller (a run's ``CollapseMonitor``) so that every measurement reuses one
    compiled program: inputs and reasonings are padded to at least these counts (padding
    pairs are computed and dropped) and widths. Inputs are rounded up to 64 tokens and
    reasonings to 16 in any case.
    """
    n_z, n_x = len(reasonings), len(inputs)
    pad_x, pad_z, min_x, min_z = (n_x, n_z, 0, 0) if shape is None else shape
    pad_x, pad_z = max(n_x, pad_x), max(n_z, pad_z)
    width_x = max(round_up(max(len(x) for x in inputs), 64), min_x)
    width_z = max(round_up(max(max(len(z) for z in reasonings), 1), 16), min_z)
    x_ids = np.zeros((pad_x, width_x), np.int32)
    x_real = np.zeros((pad_x, width_x), bool)
    x_real[:, 0] = True  # a padding input holds one token: nothing in it is fully masked
    for j, x in enumerate(inputs):
        x_ids[j, :len(x)] = x
        x_real[j, :len(x)] = True
    x_len = x_real.sum(1).astype(np.int32)
    cache, first_logp = _encode_inputs(model, jnp.asarray(x_ids), jnp.asarray(x_real),
                                       width_x + width_z)

    n = pad_z * pad_x
    chunk = n if not micro_batch_size else min(int(micro_batch_size), n)
    if micro_batch_tokens:
        chunk = max(1, min(chunk, int(micro_batch_tokens) // (width_x + width_z)))
    rows = -(-n // chunk) * chunk  # padded to whole micro-batches (one compiled shape)
    z_ids = np.zeros((rows, width_z), np.int32)
    z_real = np.zeros((rows, width_z), bool)
    column = np.tile(np.arange(pad_x, dtype=np.int32), rows // pad_x + 1)[:rows]
    for i, z in enumerate(reasonings):
        z_ids[i * pad_x:(i + 1) * pad_x, :len(z)] = z
        z_real[i * pad_x:(i + 1) * pad_x, :len(z)] = True
    sums = np.concatenate([np.asarray(
        _pair_scores(model, cache, first_logp, jnp.asarray(x_len), jnp.asarray(column[s:s + chunk]),
                     jnp.asarray(z_ids[s:s + chunk]), jnp.asarray(z_real[s:s + chunk])))
        for s in range(0, rows, chunk)])
    total = sums[:n].reshape(pad_z, pad_x)[:n_z, :n_x]  # on the host: no op-by-op compiles
    counts = np.asarray([max(len(z), 1) for z in reasonings], np.float32)[:, None]
    return total / counts, total


@functools.partial(nnx.jit, static_argnums=(3,))
def _encode_inputs(model, x_ids, x_real, size):
    """The inputs' KV cache (``size`` slots; right padding left as invalid slots) and the
    log-distribution of the token after each input's last real token ``[n_x, V]``."""
    positions = jnp.maximum(jnp.cumsum(x_real, axis=1) - 1, 0).astype(jnp.int32)  # [n_x, Sx]
    last = jnp.maximum(x_real.sum(1) - 1, 0)  # [n_x]
    cache = model.init_cache(x_ids.shape[0], size)
    logits, cache = model(x_ids, positions, x_real, cache, logits_at=last)  # [n_x, 1, V]
    return cache, jax.nn.log_softmax(logits[:, 0], axis=-1)


@nnx.jit
def _pair_scores(model, cache, first_logp, x_len, column, z_ids, z_real):
    """``sum_t log p(z_t | x, z_<t)`` for pairs ``(z_ids[r], input column[r])``: [R]."""
    pair_cache = cache.take(column)
    start = x_len[column]  # [R] the first position of z
    positions = start[:, None] + jnp.arange(z_ids.shape[1], dtype=jnp.int32)[None]  # [R, Lz]
    hidden, _ = model.model.decode(z_ids, positions, z_real, pair_cache)  # [R, Lz, E]
    first = jnp.take_along_axis(first_logp[column], z_ids[:, :1], axis=1)[:, 0]  # [R]
    rest, _ = target_logprobs(model, hidden[:, :-1], z_ids[:, 1:], mask=z_real[:, 1:])  # [R, Lz-1]
    return jnp.where(z_real[:, 0], first, 0.0) + jnp.sum(rest, axis=1)


def mi_terms(scores: jax.Array, true_column: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(matched [n_z], marginal [n_z])`` of a cross-score matrix ``scores [n_z, n_x]``."""
    scores = jnp.asarray(scores, jnp.float32)
    n_z, n_x = scores.shape
    matched = scores[jnp.arange(n_z), jnp.asarray(true_column)]
    marginal = jax.scipy.special.logsumexp(scores, axis=1) - math.log(n_x)
    return matched, marginal


def collapse_metrics(scores: jax.Array, true_column: jax.Array, input_ids: jax.Array | None = None,
                     ks: tuple[int, ...] = (2, 4, 8), *, seq_scores: jax.Array | None = None,
                     std_ema: tuple[float | None, float | None] = (None, None),
                     ema_decay: float = 0.9) -> dict[str, float]:
    """RAGEN's MI diagnostics, under RAGEN's names.

    ``scores [n_z, n_x]`` is the per-token-mean cross-score matrix (RAGEN's ``mi_estimate``,
    ``conditional_entropy_est``, ``mi_zscore``, retrieval, ... are per-token means);
    ``seq_scores``, the sequence-sum matrix, adds RAGEN's ``*_seq*`` variants
    (``mi_seq_estimate``, ``conditional_entropy_seq_est``, ``reasoning_entropy_seq_est``,
    ``marginal_std_seq``, ``mi_zscore_seq``). ``true_column [n_z]`` is each reasoning's own
    input; ``input_ids [n_x]`` labels identical inputs (same id = same prompt, counted as a
    correct retrieval), default all distinct. ``std_ema``: the previous EMAs of the marginal's
    std (per-token, sequence; None before the first), updated here with ``ema_decay`` and
    returned as ``marginal_std_ema`` / ``marginal_std_ema_seq`` with RAGEN's
    ``mi_zscore_ema`` / ``mi_zscore_ema_seq`` (the gap over the EMA of the std).
    """
    scores = jnp.asarray(scores, jnp.float32)
    n_z, n_x = scores.shape
    labels = np.arange(n_x) if input_ids is None else np.asarray(input_ids)
    if seq_scores is not None:
        seq_scores = jnp.asarray(seq_scores, jnp.float32)
    terms = jax.device_get(_collapse_terms(scores, seq_scores, jnp.asarray(true_column),
                                           jnp.asarray(labels), tuple(ks)))
    out = {"mi_upper_bound": math.log(n_x)}
    for (suffix, t), prev in zip(terms["variants"].items(), std_ema, strict=False):  # "" then "_seq"
        std = float(t["marginal_std"])
        ema = std if prev is None else ema_decay * prev + (1 - ema_decay) * std
        est = "_seq_est" if suffix else "_est"
        out |= {
            f"conditional_entropy{est}": float(-t["matched_mean"]),
            f"reasoning_entropy{est}": float(-t["marginal_mean"]),
            ("mi_seq_estimate" if suffix else "mi_estimate"): float(t["gap_mean"]),
            f"matched_log_prob_mean{suffix}": float(t["matched_mean"]),
            f"marginal_log_prob_mean{suffix}": float(t["marginal_mean"]),
            f"marginal_std{suffix}": std,
            f"mi_zscore{suffix}": _zscore(t["gap"], std),
            f"marginal_std_ema{suffix}": ema,
            f"mi_zscore_ema{suffix}": _zscore(t["gap"], ema),
        }
    n_distinct = len(np.unique(labels))
    for k, acc in zip((1, *ks), terms["retrieval"], strict=True):
        chance = min(k / n_distinct, 1.0)
        at = "" if k == 1 else f"@{k}"
        out[f"retrieval_accuracy{at}"] = float(acc)
        out[f"retrieval_chance_level{at}"] = chance
        out[f"retrieval_above_chance{at}"] = float(acc) - chance
    return out


def _zscore(gap: np.ndarray, std: float) -> float:
    """RAGEN's MI z-score: the mean of ``gap [n_z]`` over ``std + 1e-3``."""
    return float(np.mean(gap / np.float32(std + 1e-3)))


@functools.partial(jax.jit, static_argnums=(4,))
def _collapse_terms(scores: jax.Array, seq_scores: jax.Array | None, true_column: jax.Array,
                    labels: jax.Array, ks: tuple[int, ...]) -> dict:
    """``collapse_metrics``' array work as one program (op by op, each diagnostics step
    compiled some forty small ones at a new shape): per score matrix its MI terms, and the
    retrieval accuracy at ``(1, *ks)`` on the per-token ``scores [n_z, n_x]``."""
    variants = {}
    for suffix, matrix in (("", scores), ("_seq", seq_scores)):
        if matrix is None:
            continue
        matched, marginal = mi_terms(matrix, true_column)  # [n_z] each
        gap, std = matched - marginal, jnp.std(marginal)
        variants[suffix] = {"matched_mean": matched.mean(), "marginal_mean": marginal.mean(),
                            "gap_mean": gap.mean(), "gap": gap, "marginal_std": std}
    # Retrieval on the per-token scores: the best column equivalent to the truth against the
    # other columns; ties are broken uniformly at random (in expectation), so an input-blind
    # policy scores chance.
    equivalent = labels[None, :] == labels[true_column][:, None]  # [n_z, n_x]
    best_true = jnp.max(jnp.where(equivalent, scores, -jnp.inf), axis=1)[:, None]
    higher = jnp.sum((scores > best_true) & ~equivalent, axis=1)
    ties = jnp.sum((scores == best_true) & ~equivalent, axis=1)
    retrieval = [jnp.mean(jnp.clip((k - higher) / (ties + 1.0), 0.0, 1.0)) for k in (1, *ks)]
    return {"variants": variants, "retrieval": retrieval}


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


def valid_thinking_counts(trajectories: list[dict]) -> tuple[int, int]:
    """``(num_turns, num_valid)``: turns played, and those that parsed without a format error
    with a non-blank ``<think>`` block (RAGEN's ``collapse/valid_thinking_rate``, the share of
    turns whose reasoning exists to be scored). Meaningful with ``enable_think`` only."""
    turns = [t for traj in trajectories for t in traj.get("turns", []) if "format_error" in t]
    return len(turns), sum(not t["format_error"] and bool(str(t.get("think", "")).strip())
                           for t in turns)
