"""Reward normalisation of trajectory scores, RAGEN's ``agent_proxy.reward_normalization``.

Before any estimator runs, each trajectory's score (env rewards plus format penalties) is
normalised within a *grouping* of the batch's rows by a *method*:

- grouping ``state``: the rows of one env group (same seed, same start state); ``batch``: all
  rows together; ``inductive``: the rows of one env tag (one environment of a run that mixes
  several; the caller passes a tag id per row).
- method ``identity``: the score as is (RAGEN's default); ``mean``: ``s - mean``;
  ``mean_std``: ``(s - mean) / (std + 1e-6)`` with the unbiased std, and 0 for the whole
  grouping when its std is at most 1e-6 (all equal, or a group of one); ``asym_clip``:
  ``mean_std`` clamped to ``[-1, 3]``.

The V1 paper's names are settings of it (``PRESETS``): ``GRPO`` = state/mean_std,
``BRPO`` = batch/mean_std, ``ARPO`` = identity. They normalise the *reward*; the
advantage estimator (``algorithm.adv_estimator``) still runs on the normalised scores:

- ``gae`` and ``reinforce_plus_plus`` see the normalised score as the last token's reward
  (both whiten their advantages over the batch afterwards, which removes the overall scale
  and shift but not the per-group shift of ``state``);
- ``grpo`` normalises by group again: its result is invariant to any per-group affine map,
  so ``state`` or ``batch`` with ``mean``/``mean_std`` change nothing under it (up to the
  epsilons); only ``asym_clip``'s clamp does. ``drgrpo``, ``rloo`` and
  ``reinforce_plus_plus_baseline`` subtract a group mean again, which is a no-op after
  ``state``/``mean`` and a rescale after ``batch``/``mean_std``.

Like RAGEN, it runs on the whole batch before the filter (which selects groups by the raw
scores) and applies to the trajectory score on the last sampled token only, so it needs
``rollout.use_turn_scores=False`` (RAGEN skips it otherwise; ``schema`` refuses the
combination). Host-side numpy on the gathered batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ragen_jax.rollout.batch import RolloutBatch

GROUPINGS = ("state", "batch", "inductive")
METHODS = ("identity", "mean", "mean_std", "asym_clip")
# RAGEN V1's names -> (grouping, method)
PRESETS = {"GRPO": ("state", "mean_std"), "BRPO": ("batch", "mean_std"),
           "ARPO": ("state", "identity")}
STD_EPS = 1e-6
ASYM_CLIP = (-1.0, 3.0)


def _normalize_one(x: np.ndarray, method: str) -> np.ndarray:
    """One grouping's scores, normalised."""
    if method == "identity":
        return x
    centred = x - x.mean()
    if method == "mean":
        return centred
    std = float(np.std(x, ddof=1)) if x.size > 1 else 0.0
    z = centred / (std + STD_EPS) if std > STD_EPS else np.zeros_like(x)
    return np.clip(z, *ASYM_CLIP) if method == "asym_clip" else z


def normalize_scores(scores: np.ndarray, group_ids: np.ndarray, tag_ids: np.ndarray,
                     grouping: str, method: str, valid: np.ndarray | None = None) -> np.ndarray:
    """``scores [B]`` normalised by ``method`` within each ``grouping`` (module docstring):
    ``group_ids [B]`` are the rows' env groups (``state``), ``tag_ids [B]`` their env tags
    (``inductive``). ``valid [B]`` (None: all): only these rows make the statistics; the
    others (episodes an env error ended, which train on nothing) get 0.  # [B] float32"""
    if grouping not in GROUPINGS:
        raise ValueError(f"reward normalisation grouping must be one of {GROUPINGS}, got {grouping!r}")
    if method not in METHODS:
        raise ValueError(f"reward normalisation method must be one of {METHODS}, got {method!r}")
    scores = np.asarray(scores, np.float64)
    keys = {"state": np.asarray(group_ids), "inductive": np.asarray(tag_ids),
            "batch": np.zeros(scores.shape[0], np.int64)}[grouping]
    valid = np.ones(scores.shape[0], bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros_like(scores)
    for key in np.unique(keys[valid]):
        rows = (keys == key) & valid
        out[rows] = _normalize_one(scores[rows], method)
    return out.astype(np.float32)


def place_scores(token_rewards: np.ndarray, loss_mask: np.ndarray,
                 scores: np.ndarray) -> np.ndarray:
    """Token rewards holding ``scores [B]`` on each row's last sampled token and 0 elsewhere
    (the rollout's layout without turn scores); rows with no sampled token keep theirs
    (all 0: their score had nowhere to go).  # [B, L] float32"""
    sampled = np.asarray(loss_mask).astype(bool)
    has = sampled.any(1)
    last = sampled.shape[1] - 1 - np.argmax(sampled[:, ::-1], axis=1)
    out = np.where(has[:, None], 0.0, token_rewards).astype(np.float32)
    rows = np.nonzero(has)[0]
    out[rows, last[rows]] = scores[rows]
    return out


def normalize_batch(batch: RolloutBatch, scores: np.ndarray, tag_ids: np.ndarray, rows: slice,
                    grouping: str, method: str, valid: np.ndarray | None = None) -> RolloutBatch:
    """This process's ``batch`` with its scores (and their token rewards) normalised over the
    whole batch: ``scores [G, S]`` every process's scores by global group, ``tag_ids [G * S]``
    their env tags, ``rows`` this process's share of the ``G * S`` rows, ``valid [G, S]``
    the rows that count (``normalize_scores``). ``identity`` returns ``batch`` itself (turn
    scores, when used, stay where they are)."""
    if method == "identity":
        return batch
    groups, size = scores.shape
    normed = normalize_scores(scores.reshape(-1), np.repeat(np.arange(groups), size), tag_ids,
                              grouping, method,
                              None if valid is None else np.asarray(valid).reshape(-1))[rows]
    return dataclasses.replace(batch, scores=normed,
                               token_rewards=place_scores(batch.token_rewards, batch.loss_mask, normed))
