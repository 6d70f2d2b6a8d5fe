"""Advantage estimators by registered name (``algorithm.adv_estimator``).

Each estimator is a function ``(settings, inputs, values) -> (advantages [B, L], returns
[B, L] or None)`` built from the pure pieces of ``starpo.advantages``; ``values`` are the
critic's (``None`` for the critic-free estimators, which are the ones not in
``NEEDS_CRITIC``). Registering a new name here makes it a valid config value. GiGPO also reads
the rows' turns (``AdvantageInputs.turns``; the estimators in ``NEEDS_TURNS``), which the
update's rows carry only for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from ragen_jax.starpo import advantages as adv_lib


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
    """The ``config.algorithm`` fields the estimators read (built by ``config.resolve.resolve``,
    whose dataclasses hold the defaults)."""

    estimator: str
    gamma: float
    lam: float
    norm_adv_by_std: bool
    bi_level_gae: bool
    high_level_gamma: float
    num_groups: int  # groups of the whole (global) batch, for the group estimators
    step_gamma: float  # GiGPO: discount of the step returns over turns
    step_weight: float  # GiGPO: weight of the step advantage
    episode_stats: str  # GiGPO: what the episode part's statistics count (advantages.gigpo)
    penalty: str  # GiGPO: "discounted" (in the turn's score) | "own_turn" (verl-agent's placement)


@flax.struct.dataclass
class TurnTable:
    """Every row's turns (``starpo.anchors.turn_table`` builds it on the host), for the
    per-turn estimators."""

    rewards: jax.Array  # [B, T] float32, each turn's score (reward + penalty), 0 after the last
    penalties: jax.Array  # [B, T] float32, each turn's penalty (in ``rewards`` too), 0 after the last
    anchors: jax.Array  # [B, T, 2] uint32, the anchor id of the state each turn acted from
    played: jax.Array  # [B, T] bool


@flax.struct.dataclass
class AdvantageInputs:
    token_rewards: jax.Array  # [B, L] float32, scores on sampled tokens
    loss_mask: jax.Array  # [B, L] bool, sampled tokens
    turn_end: jax.Array  # [B, L] float32, 1 on each turn's last sampled token
    scores: jax.Array  # [B] float32, trajectory scores
    group_ids: jax.Array  # [B] int32, global group of each row
    turns: TurnTable | None = None  # the rows' turns (GiGPO; None for the others)
    token_turns: jax.Array | None = None  # [B, L] int32, 1-based turn of each token (with ``turns``)


Estimator = Callable[[AdvantageSettings, AdvantageInputs, jax.Array | None],
                     tuple[jax.Array, jax.Array | None]]


def _gae(s: AdvantageSettings, x: AdvantageInputs, values: jax.Array | None):
    mask = x.loss_mask.astype(jnp.float32)
    if s.bi_level_gae:
        return adv_lib.bi_level_gae(x.token_rewards, values, mask, x.turn_end, s.gamma, s.lam,
                                    s.high_level_gamma)
    return adv_lib.gae(x.token_rewards, values, mask, s.gamma, s.lam)


def _per_trajectory(fn: Callable[[AdvantageSettings, AdvantageInputs], jax.Array]) -> Estimator:
    """An estimator from a per-trajectory advantage [B], broadcast on the sampled tokens."""

    def estimator(s, x, values):
        del values
        return adv_lib.broadcast(fn(s, x), x.loss_mask.astype(jnp.float32)), None

    return estimator


def _reinforce_plus_plus(s: AdvantageSettings, x: AdvantageInputs, values: jax.Array | None):
    del values
    return adv_lib.reinforce_plus_plus(x.token_rewards, x.loss_mask, s.gamma)


def _reinforce_plus_plus_baseline(s: AdvantageSettings, x: AdvantageInputs,
                                  values: jax.Array | None):
    del values
    adv = adv_lib.reinforce_plus_plus_baseline(x.scores, x.group_ids, s.num_groups, x.loss_mask)
    return adv, adv


def _gigpo(s: AdvantageSettings, x: AdvantageInputs, values: jax.Array | None):
    """GiGPO's per-turn advantages (``advantages.gigpo``) on each turn's tokens."""
    del values
    if x.turns is None or x.token_turns is None:
        raise ValueError("adv_estimator=gigpo needs the rows' turns (AdvantageInputs.turns and "
                         "token_turns: rows.build_step_batch(..., turns=anchors.turn_table(...)))")
    t = x.turns
    per_turn = adv_lib.gigpo(x.scores, x.group_ids, s.num_groups, t.rewards, t.anchors,
                             t.played, gamma=s.step_gamma, step_weight=s.step_weight,
                             norm_by_std=s.norm_adv_by_std, episode_stats=s.episode_stats,
                             turn_penalties=t.penalties if s.penalty == "own_turn" else None)
    turn = jnp.clip(x.token_turns - 1, 0, per_turn.shape[1] - 1)
    return jnp.take_along_axis(per_turn, turn, 1) * x.loss_mask.astype(jnp.float32), None


ESTIMATORS: dict[str, Estimator] = {
    "gae": _gae,
    "grpo": _per_trajectory(lambda s, x: adv_lib.grpo(x.scores, x.group_ids, s.num_groups,
                                                      norm_by_std=s.norm_adv_by_std)),
    "drgrpo": _per_trajectory(lambda s, x: adv_lib.grpo(x.scores, x.group_ids, s.num_groups,
                                                        norm_by_std=False)),
    "rloo": _per_trajectory(lambda s, x: adv_lib.rloo(x.scores, x.group_ids, s.num_groups)),
    "reinforce_plus_plus": _reinforce_plus_plus,
    "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
    "gigpo": _gigpo,
}
NEEDS_CRITIC = frozenset({"gae"})
# Where GiGPO puts a turn's penalty (AdvantageSettings.penalty): in the turn's score, or on that
# turn alone as verl-agent does (advantages.gigpo, turn_penalties).
GIGPO_PENALTIES = ("discounted", "own_turn")
NEEDS_TURNS = frozenset({"gigpo"})  # read AdvantageInputs.turns: the rows carry a turn table


def compute_advantages(settings: AdvantageSettings, inputs: AdvantageInputs,
                       values: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """``(advantages [B, L], returns [B, L] or None)`` by ``settings.estimator``."""
    return ESTIMATORS[settings.estimator](settings, inputs, values)
