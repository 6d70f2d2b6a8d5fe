"""Several environments in one run (RAGEN's ``es_manager.{train,val}.env_configs``: tags and
``n_groups``).

A run's envs are ``EnvSlot``s in order (``config.schema.env_specs``: the ``env.mix`` entries, or the
one env plus its ``env.val_extra`` validation envs). A training step's ``rollout.env_groups``
groups are the slots' ``groups`` in order: slot k plays groups ``[first_k, first_k + groups_k)``
of the step, on those groups' seeds of ``train_seeds`` (so with one env, exactly what a
single-env run plays). Validation plays each slot's ``val_groups`` groups on the fixed seeds
``rollout.val.seed + i``, the first ``val_groups`` seeds of a single-env run of that env, so a
mixed run's per-tag validation is comparable with that env's own runs.

Each slot has its own ``RolloutConfig``: the run's, with the entry's ``rollout`` values
(``config.schema.MIX_ROLLOUT_FIELDS``: turn and action budgets, response length, prompt wording, e.g.
a one-step env such as Countdown mixed with multi-turn grids). Each slot is played by its own
``AgentRollout.collect`` call (its env driver: a JAX env's
jitted ``vmap``, a host env's threads; its own generation batches), and the batches are
concatenated into one ``RolloutBatch`` (``concat_batches``): rows in slot order, token
arrays padded to the widest, ``tag_ids`` the slot index of each row. The update then trains
on all groups at once. Generation does not pay for the mix (each slot decodes its own rows);
the update and every pass over the batch do: short rows are padded to the longest env's
width (``rollout/pad_fraction``).

Sampling keys: a training row draws from the step's key folded with its row index in the
slot-ordered batch (``row_offset``), so a process playing its share of each slot plays it as
one process playing everything would; validation slot k uses its own key (``val_key(k)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ragen_jax.rollout.agent import AgentRollout, train_seeds
from ragen_jax.rollout.batch import RolloutBatch, concat_batches
from ragen_jax.rollout.config import RolloutConfig


class EnvSlot(NamedTuple):
    """One env of a run with its share of the groups."""

    rollout: AgentRollout
    groups: int  # env groups per training step (0: validation only)
    val_groups: int  # validation groups

    @property
    def tag(self) -> str:
        return self.rollout.tag


def whole(n: int, _what: str = "") -> slice:
    """Every one of ``n`` groups (one process); ``distributed.share`` splits them instead."""
    return slice(0, n)


def collect_train(slots: Sequence[EnvSlot], policy: Any, config: RolloutConfig, iteration: int,
                  key: jax.Array, share: Callable[[int, str], slice] = whole) -> RolloutBatch:
    """Training iteration ``iteration``'s batch: every slot's groups (this process's
    ``share`` of each), concatenated (``tag_ids``: the slot index)."""
    seeds = train_seeds(config, iteration)
    batches, tags, first = [], [], 0
    for i, slot in enumerate(slots):
        if slot.groups:
            part = share(slot.groups, f"groups of env {slot.tag}")
            batches.append(slot.rollout.collect(
                policy, seeds[first:first + slot.groups][part], key,
                row_offset=(first + part.start) * config.group_size))
            tags.append(i)
        first += slot.groups
    return concat_batches(batches, tags)


def collect_val(slots: Sequence[EnvSlot], policy: Any, config: RolloutConfig,
                val_key: Callable[[int], jax.Array],
                share: Callable[[int, str], slice] = whole) -> RolloutBatch:
    """The validation batch: every slot's ``val_groups`` groups (this process's ``share``) on
    the fixed seeds, at the validation temperature (each slot's own response length), slot k
    sampled with ``val_key(k)``."""
    batches, tags = [], []
    for i, slot in enumerate(slots):
        if slot.val_groups:
            part = share(slot.val_groups, f"validation groups of env {slot.tag}")
            seeds = config.val.seed + np.arange(slot.val_groups)
            batches.append(slot.rollout.collect(
                policy, seeds[part], val_key(i), group_size=config.val.group_size,
                sampling=slot.rollout.config.val_sampling_params(),
                row_offset=part.start * config.val.group_size, held_out=False))
            tags.append(i)
    return concat_batches(batches, tags)


def validation_levels(slots: Sequence[EnvSlot], config: RolloutConfig) -> np.ndarray:
    """``[N] uint64``: the distinct held-out ids (``AgentRollout.holdout_ids``: the level, or
    Sokoban's room) of every slot's validation levels (the seeds ``collect_val`` plays): what
    the training stream and the prior's data hold out."""
    ids = [slot.rollout.holdout_ids(config.val.seed + np.arange(slot.val_groups), held_out=False)
           for slot in slots if slot.val_groups]
    ids = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    return np.unique(ids[ids != 0])


def tag_metrics(metrics: dict[str, float], tags: Sequence[str], prefix: str) -> dict[str, float]:
    """``metrics`` with the per-tag keys (``<tag>/...``) prefixed by ``prefix``."""
    return {(prefix + k if k.split("/", 1)[0] in tags else k): v for k, v in metrics.items()}
