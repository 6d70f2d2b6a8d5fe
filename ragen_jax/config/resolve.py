"""The settings a run's pieces consume, derived from its ``RunConfig`` in one place.

``resolve`` computes every derived value (``Resolved``; ``describe`` writes its notes to the
run folder's ``settings.txt``): the update's roles and optimizer settings
(``starpo.optimizer_step.UpdateConfig``, whose fields take their values from here, not from
defaults of their own), the reward normalisation, the envs with their groups, the run folder.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ragen_jax.config.fields import ConfigError, dotted
from ragen_jax.config.loading import run_folder
from ragen_jax.config.schema import AlgorithmConfig, MixEntry, RunConfig, env_specs
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.starpo.estimators import NEEDS_CRITIC, AdvantageSettings
from ragen_jax.starpo.optimizer_step import UpdateConfig
from ragen_jax.starpo.update import StepSettings


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the pieces of a run consume, with every derived value computed here.

    ``step.critic`` / ``step.reference`` are the optional roles, decided once: a critic iff
    the estimator needs values (GAE); a reference iff ``kl_coef > 0`` ("adapters_off": the
    actor with its LoRA adapters disabled; "frozen_copy": a frozen copy of the starting
    actor).
    """

    run: RunConfig
    rollout: RolloutConfig
    step: StepSettings  # the update's settings: roles, optimizers, advantages
    output_dir: Path
    notes: tuple[str, ...]  # one line per derived value (settings.txt; config.summary prints those that change a field)
    reward_norm: tuple[str, str] = ("state", "identity")  # (grouping, method), starpo.normalization
    envs: tuple[MixEntry, ...] = ()  # every env of the run with its groups (env_specs)

    def rollout_for(self, env: MixEntry) -> RolloutConfig:
        """The rollout settings of one env of the run: the run's, with the entry's own
        ``rollout`` values (``schema.MIX_ROLLOUT_FIELDS``)."""
        return self.rollout.replace(env.rollout) if env.rollout else self.rollout


def _roles(run: RunConfig, loss_agg: str) -> tuple[UpdateConfig, UpdateConfig | None]:
    """The actor's and (for estimators that need values) the critic's update settings."""
    a, act, c = run.algorithm, run.actor, run.critic
    if act.lr_schedule == "cosine" and run.trainer.total_steps <= act.warmup_steps:
        raise ConfigError("trainer.total_steps must exceed actor.warmup_steps for the cosine "
                          "schedule")
    common = dict(total_steps=run.trainer.total_steps, clip_low=a.clip_low,
                  clip_high=a.clip_high, clip_c=a.clip_c, kl_estimator=a.kl_estimator,
                  loss_agg_mode=loss_agg, temperature=run.rollout.sampling.temperature,
                  value_clip=c.value_clip)
    try:
        actor = UpdateConfig(lr=act.lr, lr_schedule=act.lr_schedule, warmup_steps=act.warmup_steps,
                             weight_decay=act.weight_decay, grad_clip=act.grad_clip,
                             entropy_coeff=a.entropy_coeff, kl_coef=a.kl_coef,
                             micro_batches=act.micro_batches, **common)
        critic = None
        if a.adv_estimator in NEEDS_CRITIC:
            # the critic's schedule is constant, without warmup; it has no entropy or KL term
            critic = UpdateConfig(lr=c.lr, lr_schedule="constant", warmup_steps=0,
                                  weight_decay=c.weight_decay, grad_clip=c.grad_clip,
                                  micro_batches=c.micro_batches, entropy_coeff=0.0, kl_coef=0.0,
                                  **common)
            if act.ppo_mini_batch_size % c.micro_batches:
                raise ConfigError(f"critic.micro_batches={c.micro_batches} must divide "
                                  f"actor.ppo_mini_batch_size={act.ppo_mini_batch_size}")
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return actor, critic


def resolve(run: RunConfig) -> Resolved:
    """Computes every derived setting of ``run`` (see ``Resolved``)."""
    a, act, notes = run.algorithm, run.actor, []
    use_turn_scores = run.rollout.use_turn_scores or a.bi_level_gae
    if use_turn_scores != run.rollout.use_turn_scores:
        notes.append("rollout.use_turn_scores = True (algorithm.bi_level_gae places each "
                     "turn's score on its last token)")
    grouping, method = a.reward_norm_grouping, a.reward_norm_method
    if method != "identity" and use_turn_scores:
        raise ConfigError(f"algorithm.reward_norm_method={method} normalises the trajectory score "
                          "and needs rollout.use_turn_scores=False (and algorithm.bi_level_gae=False)")
    notes.append("reward normalisation: " + ("none (identity)" if method == "identity" else
                                             f"{method} within each {grouping} grouping"))
    loss_agg = a.loss_agg_mode
    if a.adv_estimator == "drgrpo" and loss_agg == "token-mean":
        loss_agg = "seq-mean-token-sum"
        notes.append("algorithm.loss_agg_mode = seq-mean-token-sum (Dr.GRPO's aggregation; "
                     "set another mode explicitly to keep it)")
    actor, critic = _roles(run, loss_agg)
    notes.append(f"critic: {'yes (GAE)' if critic else f'none ({a.adv_estimator} needs no values)'}")
    reference = None
    if a.kl_coef > 0:
        reference = "adapters_off" if run.model.lora_rank else "frozen_copy"
    notes.append(f"reference policy: {reference or 'none (algorithm.kl_coef = 0)'}")
    rows = run.rollout.env_groups * run.rollout.group_size
    mini = act.ppo_mini_batch_size
    notes.append(f"optimizer steps per training step: {act.ppo_epochs} epoch(s) x "
                 f"{math.ceil(rows / mini)} mini-batch(es) of {mini} when no group is filtered "
                 f"({rows} trajectories); the lr schedule counts training steps "
                 f"({run.trainer.total_steps})")
    envs = env_specs(run)
    if run.env.mix:
        notes.append("env mix, one batch per step: " + ", ".join(
            f"{e.tag or e.name} {e.groups} group(s) (validation {e.val_groups}"
            + "".join(f"; rollout.{k}={v!r}" for k, v in dotted(e.rollout).items()) + ")"
            for e in envs))
    out = run_folder(run)
    notes.append(f"output_dir: {out}")
    rollout = dataclasses.replace(run.rollout, use_turn_scores=use_turn_scores)
    advantages = AdvantageSettings(
        estimator=a.adv_estimator, gamma=a.gamma, lam=a.lam, norm_adv_by_std=a.norm_adv_by_std,
        bi_level_gae=a.bi_level_gae, high_level_gamma=a.high_level_gamma,
        num_groups=run.rollout.env_groups, step_gamma=a.gigpo_gamma,
        step_weight=a.gigpo_step_weight, episode_stats=a.gigpo_episode_stats,
        penalty=a.gigpo_penalty)
    if a.adv_estimator == "gigpo":
        notes.append(f"GiGPO: episode advantage + {a.gigpo_step_weight:g} x step advantage "
                     f"(step returns discounted by {a.gigpo_gamma:g} per turn; "
                     + ("/ group std" if a.norm_adv_by_std else "no std division")
                     + f"; episode statistics once per {a.gigpo_episode_stats}; penalty "
                     + ("on its own turn" if a.gigpo_penalty == "own_turn" else "discounted")
                     + "; anchors: exact JAX states, host observation texts"
                     + (f" at similarity >= {a.gigpo_similarity:g})" if a.gigpo_similarity < 1
                        else ")"))
    if a.sample_unit == "turn":
        notes.append(f"training rows: one per turn (rollout.window.mode="
                     f"{run.rollout.window.mode}); actor.ppo_mini_batch_size counts turn rows")
    step = StepSettings(actor=actor, critic=critic, reference=reference, advantages=advantages,
                        mini_batch_size=mini, epochs=act.ppo_epochs, sample_unit=a.sample_unit,
                        recompute_logprobs=act.recompute_logprobs,
                        gradient_buckets=run.diagnostics.gradient_buckets)
    return Resolved(run=run, rollout=rollout, step=step, output_dir=out, notes=tuple(notes),
                    reward_norm=(grouping, method), envs=envs)


def update_settings(role: str = "actor", **changes: Any) -> UpdateConfig:
    """The default run's update settings of ``role`` ("actor" or "critic", the defaults'
    estimator being GAE) with ``changes``: ``UpdateConfig`` for direct use (tests,
    benchmarks) without a second copy of the run config's defaults."""
    run = RunConfig(algorithm=AlgorithmConfig(adv_estimator="gae"))
    return dataclasses.replace(getattr(resolve(run).step, role), **changes)


def micro_batch_warning(step: StepSettings, devices: int) -> str | None:
    """A pass of the update spreads its rows (a mini-batch / ``micro_batches``) over the
    ``devices`` of the data-parallel axes (``mesh.data x mesh.fsdp``); with fewer rows than
    devices, some devices compute padding. The line to print then (naming the field), else
    None. Not an error: the update is still exact. ``step``: the run's ``resolve(run).step``."""
    for role, update in (("actor", step.actor), ("critic", step.critic)):
        n = update.micro_batches if update is not None else 1
        rows = step.mini_batch_size // n
        if n > 1 and rows < devices:
            most = max(1, step.mini_batch_size // devices)
            return (f"warning: {role}.micro_batches={n} leaves {rows} rows a pass for {devices} "
                    f"data-parallel devices (mesh.data x mesh.fsdp), so some compute padding: "
                    f"{most} would do (the Qwen2.5 presets' counts are for one device)")
    return None


def describe(resolved: Resolved) -> str:
    """The derived settings, one per line (the run folder's ``settings.txt``)."""
    return "derived settings:\n" + "\n".join(f"  {line}" for line in resolved.notes)
