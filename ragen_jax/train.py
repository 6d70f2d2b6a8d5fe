"""The StarPO training loop: ``run(config)`` (what ``launch.py`` calls).

Per step: rollout (``AgentRollout`` on the step's train seeds) -> group filtering (StarPO-S /
SNR) -> old log-probs, reference log-probs and values (forward passes) -> advantages (GAE with
the critic, GRPO, Dr.GRPO or RLOO) -> critic update -> actor update, then every ``test_freq``
steps validation on the fixed seeds and every ``save_freq`` steps an orbax checkpoint.

Reproducibility: everything random is a function of ``(seed, step)`` (env seeds, sampling,
the duplicated rows that pad a filtered batch), and a checkpoint holds every array the next
step reads (actor, critic and reference parameters, optimizer states) plus the host-side
counters, so a run resumed from the checkpoint of step k computes exactly what the
uninterrupted run computed after step k. SIGINT/SIGTERM finish the current step, save, and
exit; a restart with the same ``output_dir`` resumes from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from ragen_jax import distributed as dist
from ragen_jax.checkpoint import CheckpointStore
from ragen_jax.envs import make
from ragen_jax.metrics import MetricsLogger
from ragen_jax.models import Qwen2ForCausalLM, Qwen2ForValue, QwenConfig, from_pretrained
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.models.lora import add_lora
from ragen_jax.models.qwen import shard_model
from ragen_jax.rollout.agent import (
    AgentRollout,
    RolloutBatch,
    RolloutConfig,
    train_seeds,
    val_seeds,
)
from ragen_jax.rollout.context import ContextConfig
from ragen_jax.rollout.sampler import Sampler
from ragen_jax.sharding import make_mesh, shard_batch
from ragen_jax.starpo import advantages as adv_lib
from ragen_jax.starpo.diagnostics import (
    collapse_metrics,
    cross_scores,
    first_turn_pairs,
    first_turn_validity,
    prompt_labels,
    trajectory_uniform_pairs,
    valid_thinking_counts,
)
from ragen_jax.starpo.filtering import FilterConfig, filter_groups
from ragen_jax.starpo.gradient_analysis import make_gradient_analysis, reward_std_buckets
from ragen_jax.starpo.losses import masked_mean
from ragen_jax.starpo.update import (
    CriticBatch,
    TrainBatch,
    UpdateConfig,
    critic_objective,
    make_optimizer,
    make_train_step,
    ppo_update,
    token_logprobs,
    token_values,
)

ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo")
# Rollout metrics that count (summed over processes); the others are per-episode means.
ROLLOUT_COUNTS = tuple(f"rollout/{k}" for k in (
    "num_trajectories", "num_groups", "tokens", "sampled_tokens", "length_truncated",
    "truncated", "unplaced_scores"))
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ConfigError(ValueError):
    """A bad config value or path; the message names the field."""


# ----------------------------------------------------------------------------------------------
# Config -> typed settings
# ----------------------------------------------------------------------------------------------


def _rollout_config(c: ConfigDict) -> RolloutConfig:
    r = c.rollout
    ctx = ContextConfig(enable_think=r.enable_think, max_actions_per_turn=r.max_actions_per_turn,
                        format_penalty=r.format_penalty,
                        **({"turn_template": r.turn_template} if r.turn_template else {}))
    return RolloutConfig(
        env_groups=r.env_groups, group_size=r.group_size, max_turn=r.max_turn,
        max_actions_per_traj=r.max_actions_per_traj, response_length=r.response_length,
        max_model_len=r.max_model_len, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
        use_turn_scores=r.use_turn_scores or c.algorithm.bi_level_gae, train_seed=r.train_seed,
        val_seed=r.val_seed, val_groups=r.val_groups, val_group_size=r.val_group_size,
        pad_multiple=r.pad_multiple, context=ctx)


def _update_config(c: ConfigDict, critic: bool = False) -> UpdateConfig:
    a, opt = c.algorithm, (c.critic if critic else c.actor)
    loss_agg = a.loss_agg_mode
    if a.adv_estimator == "drgrpo" and loss_agg == "token-mean":
        loss_agg = "seq-mean-token-sum"  # RAGEN's Dr.GRPO recipe
    return UpdateConfig(
        lr=opt.lr, lr_schedule=c.actor.lr_schedule if not critic else "constant",
        warmup_steps=c.actor.warmup_steps if not critic else 0,
        total_steps=c.trainer.total_steps * max(1, c.rollout.env_groups * c.rollout.group_size
                                                // c.actor.ppo_mini_batch_size),
        weight_decay=c.actor.weight_decay, grad_clip=opt.grad_clip, clip_low=a.clip_low,
        clip_high=a.clip_high, clip_c=a.clip_c,
        entropy_coeff=0.0 if critic else a.entropy_coeff, kl_coef=0.0 if critic else a.kl_coef,
        kl_estimator=a.kl_estimator, loss_agg_mode=loss_agg, micro_batches=c.actor.micro_batches,
        temperature=c.rollout.temperature, value_clip=c.critic.value_clip)


def validate(c: ConfigDict) -> None:
    """Raises ``ConfigError`` naming the first bad field."""
    if c.algorithm.adv_estimator not in ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator must be one of {ESTIMATORS}, got {c.algorithm.adv_estimator!r}")
    if c.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {tuple(DTYPES)}, got {c.model.dtype!r}")
    if c.preset != "tiny" and not c.model.path:
        raise ConfigError(f"model.path is required for preset {c.preset}: give "
                          f"--config.model.path=/path/to/a/local/Hugging-Face/folder")
    if c.model.path and not Path(c.model.path).is_dir():
        raise ConfigError(f"model.path: no such folder: {c.model.path}")
    if c.sft.steps and not Path(c.sft.data).is_file():
        raise ConfigError(f"sft.data: no such file: {c.sft.data!r}")
    for name in ("total_steps", "test_freq", "save_freq", "keep_checkpoints"):
        if c.trainer[name] < 1:
            raise ConfigError(f"trainer.{name} must be >= 1, got {c.trainer[name]}")
    if c.actor.ppo_mini_batch_size < 1 or c.actor.ppo_epochs < 1:
        raise ConfigError("actor.ppo_mini_batch_size and actor.ppo_epochs must be >= 1")
    if c.diagnostics.gradient_buckets < 1 or c.diagnostics.micro_batch_size < 1:
        raise ConfigError("diagnostics.gradient_buckets and diagnostics.micro_batch_size must be >= 1")
    d = c.distributed
    if d.coordinator_address and d.coordinator_address != "auto":
        for name in ("env_groups", "val_groups"):
            if c.rollout[name] % d.num_processes:
                raise ConfigError(f"rollout.{name}={c.rollout[name]} must be a multiple of "
                                  f"distributed.num_processes={d.num_processes}")
    try:
        _rollout_config(c)
        _update_config(c)
        _filter_config(c)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _filter_config(c: ConfigDict) -> FilterConfig:
    f = c.filter
    return FilterConfig(strategy=f.strategy, value=f.value, filter_type=f.filter_type,
                        metric=f.metric, include_zero=f.include_zero,
                        top_p_prob_mode=f.top_p_prob_mode, loss_scaling=f.loss_scaling)


def output_dir(c: ConfigDict) -> Path:
    return Path(c.trainer.output_dir or f"runs/{c.env.name}-{c.preset}")


# ----------------------------------------------------------------------------------------------
# Pure pieces of the step (jitted; each recompiles once per batch shape)
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 5))
def _logprobs(graphdef, params, rest, ids, attn_pos, temperature):
    model = nnx.merge(graphdef, params, rest)
    return token_logprobs(model, ids, attn_pos[0], attn_pos[1], temperature)[0]


@functools.partial(jax.jit, static_argnums=(0,))
def _values(graphdef, params, rest, ids, attn_pos):
    critic = nnx.merge(graphdef, params, rest)
    return token_values(critic, ids, attn_pos[0], attn_pos[1])


def compute_advantages(estimator: str, *, token_rewards, loss_mask, scores, group_ids,
                       num_groups: int, values=None, turn_end=None, gamma: float = 1.0,
                       lam: float = 1.0, norm_by_std: bool = True, bi_level: bool = False,
                       high_level_gamma: float = 0.95) -> tuple[jax.Array, jax.Array | None]:
    """``(advantages [B, L], returns [B, L] or None)`` for one filtered batch."""
    mask = loss_mask.astype(jnp.float32)
    if estimator == "gae":
        if bi_level:
            return adv_lib.bi_level_gae(token_rewards, values, mask, turn_end, gamma, lam,
                                        high_level_gamma)
        return adv_lib.gae(token_rewards, values, mask, gamma, lam)
    if estimator == "rloo":
        adv = adv_lib.rloo(scores, group_ids, num_groups)
    else:
        adv = adv_lib.grpo(scores, group_ids, num_groups,
                           norm_by_std=norm_by_std and estimator == "grpo")
    return adv_lib.broadcast(adv, mask), None


def _turn_ends(loss_mask: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """1 on the last sampled token of each turn (bi-level GAE's turn boundaries)."""
    sampled = loss_mask.astype(bool)
    nxt = np.concatenate([turn_ids[:, 1:], np.zeros_like(turn_ids[:, :1])], 1)
    nxt_sampled = np.concatenate([sampled[:, 1:], np.zeros_like(sampled[:, :1])], 1)
    return (sampled & ~(nxt_sampled & (nxt == turn_ids))).astype(np.float32)


def select_rows(keep_groups: np.ndarray, group_ids: np.ndarray, multiple: int,
                rng: np.random.Generator) -> np.ndarray:
    """Rows of the kept groups, padded to a multiple of ``multiple`` by duplicating random
    kept rows (RAGEN's ``batch_adjust_mode=copy``). Empty if nothing was kept."""
    rows = np.nonzero(keep_groups[group_ids])[0]
    if rows.size == 0:
        return rows
    short = (-rows.size) % multiple
    return np.concatenate([rows, np.sort(rng.choice(rows, size=short))]) if short else rows


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Models:
    """The trainable pieces, split NNX-style into graph definitions and states."""

    tokenizer: Any
    actor: Qwen2ForCausalLM
    graphdef: Any
    params: Any
    rest: Any
    critic_graphdef: Any = None
    critic_params: Any = None
    critic_rest: Any = None
    ref_params: Any = None


def build_models(c: ConfigDict, mesh) -> Models:
    """The actor (HF folder or tiny random), its critic and reference, sharded on ``mesh``."""
    dtype = DTYPES[c.model.dtype]
    if c.model.path:
        actor = from_pretrained(c.model.path, dtype=dtype, mesh=mesh)
        tok = tokenizers.load(c.model.path)
    else:
        m = c.model
        cfg = QwenConfig.tiny(hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                              intermediate_size=m.intermediate_size,
                              num_attention_heads=m.num_attention_heads,
                              num_key_value_heads=m.num_key_value_heads,
                              head_dim=m.hidden_size // m.num_attention_heads,
                              param_dtype=dtype, dtype=dtype)
        actor = shard_model(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(c.seed)), mesh)
        tok = tokenizers.load(None)
    trainable = nnx.Param
    if c.model.lora_rank:
        add_lora(actor, c.model.lora_rank, c.model.lora_alpha, seed=c.seed)
        trainable = nnx.LoRAParam
    models = Models(tok, actor, *nnx.split(actor, trainable, ...))
    if c.algorithm.adv_estimator == "gae":
        critic = Qwen2ForValue.from_actor(actor, seed=c.seed + 1)
        models.critic_graphdef, models.critic_params, models.critic_rest = nnx.split(
            critic, nnx.Param, ...)
    if c.algorithm.kl_coef:
        models.ref_params = jax.tree.map(jnp.zeros_like, models.params) if c.model.lora_rank \
            else jax.tree.map(jnp.copy, models.params)
    return models


class Trainer:
    """Holds a run's state; ``train()`` runs it to ``trainer.total_steps``."""

    def __init__(self, config: ConfigDict, *, on_step: Callable[[int, dict], None] | None = None):
        validate(config)
        self.c = c = config
        self.on_step = on_step
        self.is_main = jax.process_index() == 0
        self.out = output_dir(c)
        self.mesh = make_mesh((c.mesh.data, c.mesh.fsdp, c.mesh.tensor))
        self.rcfg = _rollout_config(c)
        self.fcfg = _filter_config(c)
        env_kw = dict(c.env.params)
        try:
            self.env, self.env_params = make(c.env.name, **env_kw)
            self.val_envs = {}
            for tag, extra in c.env.val_extra.items():
                self.val_envs[tag] = make(c.env.name, **{**env_kw, **dict(extra)})
        except (ValueError, TypeError) as e:
            raise ConfigError(f"env: {e}") from None
        self.tag = c.env.tag or type(self.env).__name__

        self.m = build_models(c, self.mesh)
        # Rollouts are process-local: each process samples its share with a local replica.
        self.local_mesh = dist.local_mesh(self.mesh)
        self.policy = dist.local_replica(self.m.actor, self.mesh, self.local_mesh)
        self.sampler = Sampler(self.policy, pad_id=self.m.tokenizer.pad_token_id or 0,
                               bucket_multiple=self.rcfg.pad_multiple)
        self.rollout = AgentRollout(self.env, self.env_params, self.m.tokenizer, self.rcfg, tag=self.tag)
        self.val_rollouts = {self.tag: self.rollout} | {
            tag: AgentRollout(env, params, self.m.tokenizer, self.rcfg, tag=tag)
            for tag, (env, params) in self.val_envs.items()}

        self.ucfg = _update_config(c)
        self.optimizer = make_optimizer(self.ucfg)
        self.opt_state = dist.on_mesh(self.optimizer.init(self.m.params), self.mesh)
        self.actor_step = make_train_step(self.m.graphdef, self.ucfg, self.optimizer, mesh=self.mesh)
        if self.m.critic_graphdef is not None:
            self.ccfg = _update_config(c, critic=True)
            self.critic_optimizer = make_optimizer(self.ccfg)
            self.critic_opt_state = dist.on_mesh(self.critic_optimizer.init(self.m.critic_params), self.mesh)
            self.critic_step = make_train_step(self.m.critic_graphdef, self.ccfg,
                                               self.critic_optimizer, critic_objective, self.mesh)
        self.step = 0
        self.meta: dict[str, Any] = {"empty_streak": 0, "std_history": [], "std_low_streak": 0,
                                     "val_low_streak": 0, "warmstarted": False}
        self.store = CheckpointStore(self.out / "checkpoints", keep=c.trainer.keep_checkpoints)
        self._stop_signal: int | None = None
        self.logger: MetricsLogger | None = None
        self._grad_analysis: dict[tuple[int, int], Callable] = {}  # by (buckets, micro-batches)

    # -- state <-> checkpoint ------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        s = {"actor": self.m.params, "actor_opt": self.opt_state}
        if self.m.critic_graphdef is not None:
            s |= {"critic": self.m.critic_params, "critic_opt": self.critic_opt_state}
        if self.m.ref_params is not None:
            s["ref"] = self.m.ref_params
        return s

    def load_state(self, s: dict[str, Any]) -> None:
        self.m.params, self.opt_state = s["actor"], s["actor_opt"]
        if "critic" in s:
            self.m.critic_params, self.critic_opt_state = s["critic"], s["critic_opt"]
        if "ref" in s:
            self.m.ref_params = s["ref"]
        nnx.update(self.m.actor, self.m.params)
        self._refresh_sampler()

    def _refresh_sampler(self) -> None:
        self.policy = dist.local_replica(self.m.actor, self.mesh, self.local_mesh)
        self.sampler.update(self.policy)

    def save(self) -> None:
        """Checkpoints the current step (once: a step already saved is left as it is)."""
        if self.store.latest_step() == self.step:
            return
        self.store.save(self.step, self.state(), {**self.meta, "step": self.step})

    def maybe_resume(self) -> bool:
        last = self.store.latest_step()
        if last is None:
            return False
        s, meta = self.store.restore(last, self.state())
        self.load_state(s)
        self.meta.update({k: v for k, v in meta.items() if k != "step"})
        self.step = int(meta["step"])
        return True

    # -- pieces of a step ----------------------------------------------------------------------

    def _key(self, *path: int) -> jax.Array:
        key = jax.random.key(self.c.seed)
        for p in path:
            key = jax.random.fold_in(key, p)
        return key

    def warmstart(self, log: Callable[[str], None]) -> dict[str, float]:
        from ragen_jax.sft import conversation_data, train_sft, warmstart_data

        out: dict[str, float] = {}
        trainable = nnx.LoRAParam if self.c.model.lora_rank else nnx.Param
        if self.c.sft.steps:
            data = conversation_data(self.c.sft.data, self.m.tokenizer,
                                     max_len=self.rcfg.max_model_len)
            losses = train_sft(self.m.actor, data, steps=self.c.sft.steps,
                               batch_size=self.c.sft.batch_size, lr=self.c.sft.lr,
                               seed=self.c.seed, trainable=trainable, log=log)
            out["sft/loss_first"], out["sft/loss_last"] = losses[0], losses[-1]
        w = self.c.warmstart
        if w.steps:
            stats: dict = {}
            data = warmstart_data(self.env, self.env_params, self.m.tokenizer, self.rcfg,
                                  episodes=w.episodes, seed=self.c.seed,
                                  legal_only=w.legal_actions, metrics=stats)
            out["warmstart/action_is_effective"] = stats["action_is_effective"]
            losses = train_sft(self.m.actor, data, steps=w.steps, batch_size=w.batch_size,
                               lr=w.lr, seed=self.c.seed, trainable=trainable, log=log)
            out["warmstart/loss_first"], out["warmstart/loss_last"] = losses[0], losses[-1]
        _, self.m.params, self.m.rest = nnx.split(self.m.actor, trainable, ...)
        self.opt_state = dist.on_mesh(self.optimizer.init(self.m.params), self.mesh)
        if self.m.critic_graphdef is not None:  # the critic starts from the warm-started actor
            critic = Qwen2ForValue.from_actor(self.m.actor, seed=self.c.seed + 1)
            _, self.m.critic_params, self.m.critic_rest = nnx.split(critic, nnx.Param, ...)
            self.critic_opt_state = dist.on_mesh(self.critic_optimizer.init(self.m.critic_params), self.mesh)
        if self.m.ref_params is not None and not self.c.model.lora_rank:
            self.m.ref_params = jax.tree.map(jnp.copy, self.m.params)
        self._refresh_sampler()
        self.meta["warmstarted"] = True
        return out

    def evaluate(self) -> tuple[dict[str, float], RolloutBatch]:
        """Validation on the fixed seeds (``val-env/<tag>/...``); returns the main batch too."""
        metrics, main = {}, None
        sampling = self.rcfg.sampling(temperature=self.c.rollout.val_temperature)
        part = dist.share(self.rcfg.val_groups, "rollout.val_groups")
        for i, (tag, rollout) in enumerate(self.val_rollouts.items()):
            batch = rollout.collect(self.sampler, val_seeds(self.rcfg)[part],
                                    self._key(1, self.step, i), group_size=self.rcfg.val_group_size,
                                    sampling=sampling, row_offset=part.start * self.rcfg.val_group_size)
            metrics |= {f"val-env/{k}": v for k, v in batch.metrics.items() if k.startswith(tag + "/")}
            if main is None:
                main = batch
        return dist.mean_metrics(metrics), main

    @staticmethod
    def _balanced_rows(keep: np.ndarray, group_ids: np.ndarray, weights: np.ndarray,
                       multiple: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Multi-process row selection: this process's kept rows, padded by copies to the
        largest count any process has (rounded up to ``multiple / processes``), so that every
        process feeds the same number of rows. A process that kept nothing feeds copies of row
        0 with weight 0 (they add nothing to the loss)."""
        per = multiple // math.gcd(multiple, jax.process_count())
        rows = select_rows(keep, group_ids, 1, rng)
        target = int(dist.allgather(np.int64(rows.size)).max())
        target = -(-target // per) * per
        w = weights.astype(np.float32).copy()
        if rows.size == 0:
            w[0] = 0.0
            return np.zeros(target, np.int64), w
        extra = np.sort(rng.choice(rows, size=target - rows.size)) if target > rows.size else rows[:0]
        return np.concatenate([rows, extra]), w

    def diagnose(self, batch: RolloutBatch) -> dict[str, float]:
        """RAGEN V2's collapse diagnostics from the rollout batch before filtering, with the
        policy that sampled it: first-turn pairs (``collapse_first_turn_sample/*``),
        trajectory-uniform pairs (``collapse_trajectory_sample/*``), the first turns'
        format validity (``collapse/first_turn_{num_total,num_valid,valid_rate}``) and, with
        ``enable_think``, the share of turns with a non-blank reasoning
        (``collapse/valid_thinking_rate``)."""
        d = self.c.diagnostics
        per_process = d.num_samples // jax.process_count()
        rng = np.random.default_rng([self.c.seed, self.step, 1])
        first = first_turn_pairs(batch.input_ids, batch.loss_mask, batch.turn_ids,
                                 batch.group_ids, per_process, rng)[:3]
        rng = np.random.default_rng([self.c.seed, self.step, 2, jax.process_index()])
        traj = trajectory_uniform_pairs(batch.input_ids, batch.loss_mask, batch.turn_ids,
                                        d.trajectory_samples // jax.process_count(), rng)[:3]
        counts = [*first_turn_validity(batch.trajectories), *valid_thinking_counts(batch.trajectories)]
        parts = dist.allgather_json([[x[0], x[1], x[2].tolist()] for x in (first, traj)] + [counts])
        out: dict[str, float] = {}
        for i, kind in enumerate(("first_turn_sample", "trajectory_sample")):
            inputs, reasonings, cols = [], [], []
            for part in parts:  # every process scores every process's pairs
                xs, zs, cs = part[i]
                cols += [col + len(inputs) for col in cs]
                inputs, reasonings = inputs + xs, reasonings + zs
            out |= self._collapse(kind, inputs, reasonings, np.asarray(cols, np.int32))
        total, valid, turns, thinking = (sum(p[2][k] for p in parts) for k in range(4))
        out |= {"collapse/first_turn_num_total": float(total),
                "collapse/first_turn_num_valid": float(valid),
                "collapse/first_turn_valid_rate": valid / total if total else 0.0}
        if self.c.rollout.enable_think:
            out["collapse/valid_thinking_rate"] = thinking / turns if turns else 0.0
        return out

    def _collapse(self, kind: str, inputs: list[list[int]], reasonings: list[list[int]],
                  column: np.ndarray) -> dict[str, float]:
        """``collapse_<kind>/*``: the MI metrics of one set of pairs (sequence sums, plus
        per-token means of the entropies and MI) and the z-score's EMA, kept in ``self.meta``
        (so in checkpoints) per kind. Identical prompts share a label. Empty under 2 inputs."""
        if len(inputs) < 2:
            return {}
        d, prefix = self.c.diagnostics, f"collapse_{kind}/"
        labels = prompt_labels(inputs)
        per_token, per_seq = cross_scores(self.policy, inputs, reasonings, d.micro_batch_size)
        out = {prefix + k: v for k, v in collapse_metrics(per_seq, column, labels).items()}
        tok = collapse_metrics(per_token, column, labels)
        for k in ("conditional_entropy_est", "reasoning_entropy_est", "mi_estimate"):
            out[f"{prefix}per_token/{k}"] = tok[k]
        z, key = out[prefix + "mi_zscore"], f"mi_zscore_ema/{kind}"
        prev = self.meta.get(key)
        self.meta[key] = z if prev is None else d.ema * prev + (1 - d.ema) * z
        out[prefix + "mi_zscore_ema"] = self.meta[key]
        return out

    def gradient_analysis(self, tb: TrainBatch, scores: np.ndarray, group_ids: np.ndarray
                          ) -> dict[str, float]:
        """``collapse_grad/*``: the gradient norm of each actor-loss component on the whole
        update batch ``tb`` and on each reward-std bucket of groups, without stepping the
        optimizer (``starpo.gradient_analysis``). ``scores [B_local]`` are this process's
        rollout scores (before filtering), ``group_ids`` its update rows' global group ids;
        the buckets rank every process's groups by reward std."""
        d, g, s = self.c.diagnostics, self.rcfg.env_groups, self.rcfg.group_size
        bucket, mean_std = reward_std_buckets(dist.allgather(scores).reshape(g, s),
                                              d.gradient_buckets)
        rows = tb.input_ids.shape[0]
        chunk = max(1, self.c.actor.ppo_mini_batch_size // self.c.actor.micro_batches)
        micro = rows // chunk if rows % chunk == 0 else 1
        key = (d.gradient_buckets, micro)
        if key not in self._grad_analysis:
            self._grad_analysis[key] = make_gradient_analysis(self.m.graphdef, self.ucfg, *key)
        norms = self._grad_analysis[key](self.m.params, self.m.rest, tb,
                                         dist.global_rows(bucket[group_ids], self.mesh))
        norms = {k: float(v) for k, v in norms.items()}
        out = {f"collapse_grad/{k}_grad_norm": v for k, v in norms.items() if "/" not in k}
        for k in range(d.gradient_buckets):
            if norms[f"bucket{k}/rows"] == 0:  # empty, or every group of it filtered out
                continue
            p = f"collapse_grad/bucket{k}/"
            out |= {p + c.split("/")[1] + "_grad_norm": v for c, v in norms.items()
                    if c.startswith(f"bucket{k}/") and not c.endswith("/rows")}
            out |= {p + "num_rows": norms[f"bucket{k}/rows"], p + "reward_std_mean": float(mean_std[k])}
        return out

    def train_step(self) -> dict[str, float]:
        """One rollout + update; returns the step's metrics."""
        c, t = self.c, {}
        g, s = self.rcfg.env_groups, self.rcfg.group_size
        part = dist.share(g, "rollout.env_groups")  # this process's groups
        t0 = time.perf_counter()
        batch = self.rollout.collect(self.sampler, train_seeds(self.rcfg, self.step)[part],
                                     self._key(0, self.step), row_offset=part.start * s)
        t["timing_s/gen"] = time.perf_counter() - t0
        metrics = {("train/" + k if k.startswith(self.tag + "/") else k): v
                   for k, v in batch.metrics.items()}
        diagnose_now = bool(c.diagnostics.compute_freq) and self.step % c.diagnostics.compute_freq == 0
        if diagnose_now:
            t0 = time.perf_counter()
            metrics |= self.diagnose(batch)
            t["timing_s/diagnostics"] = time.perf_counter() - t0
        metrics = dist.mean_metrics(metrics, summed=ROLLOUT_COUNTS)

        # ---- filtering (whole groups, over every process's groups) ----
        scores = dist.allgather(batch.scores).reshape(g, s)
        lengths = dist.allgather(batch.loss_mask.sum(1)).reshape(g, s)
        keep, weights, fmetrics = filter_groups(jnp.asarray(scores), self.fcfg, jnp.asarray(lengths))
        metrics |= {k: float(v) for k, v in fmetrics.items()}
        keep = np.asarray(keep)[part]
        weights = np.asarray(weights).reshape(g, s)[part].reshape(-1)
        n_dev = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        multiple = math.lcm(c.actor.ppo_mini_batch_size, n_dev)
        rng = np.random.default_rng([c.seed, self.step, jax.process_index()])
        if dist.multiprocess():  # every process contributes the same number of rows
            rows, weights = self._balanced_rows(keep, batch.group_ids, weights, multiple, rng)
        else:
            rows = select_rows(keep, batch.group_ids, multiple, rng)
        if not dist.any_process(rows.size > 0):
            self.meta["empty_streak"] += 1
            metrics["train/update_skipped_empty"] = 1.0
            return metrics | t
        self.meta["empty_streak"] = 0

        # ---- forward passes: old / reference log-probs, values ----
        t0 = time.perf_counter()
        width = int(batch.attention_mask[rows].any(0).nonzero()[0].max()) + 1
        width = int(dist.allgather(np.int64(width)).max())
        width = -(-width // self.rcfg.pad_multiple) * self.rcfg.pad_multiple
        put = lambda x: dist.global_rows(x, self.mesh)  # noqa: E731  local rows -> global

        def cols(x):  # this process's rows, cut or zero-padded to the global width
            x = x[rows, :width]
            return np.pad(x, ((0, 0), (0, width - x.shape[1]))) if x.shape[1] < width else x

        sl = lambda x: put(cols(x))  # noqa: E731
        ids, attn, pos = (sl(x) for x in (batch.input_ids, batch.attention_mask, batch.position_ids))
        loss_mask = sl(batch.loss_mask.astype(np.float32) * weights[:, None])
        sampler_lp = sl(batch.model_logprobs)
        mb = c.actor.ppo_mini_batch_size
        n_rows = ids.shape[0]
        chunk = max(1, mb // c.actor.micro_batches)

        def chunked(fn, *args):  # forward passes in micro-batch rows, bounded memory
            parts = [fn(*args, ids[i:i + chunk], (attn[i:i + chunk], pos[i:i + chunk]))
                     for i in range(0, n_rows, chunk)]
            return jnp.concatenate(parts, 0)

        temp = self.ucfg.temperature
        if c.actor.recompute_logprobs:
            old_logp = chunked(lambda *a: _logprobs(self.m.graphdef, *a[:2], *a[2:], temp),
                               self.m.params, self.m.rest)
            metrics["rollout/logprob_gap"] = float(
                masked_mean(jnp.abs(old_logp - sampler_lp), loss_mask > 0))
        else:
            old_logp = sampler_lp
        ref_logp = jnp.zeros_like(old_logp)
        if self.m.ref_params is not None:
            ref_logp = chunked(lambda *a: _logprobs(self.m.graphdef, *a[:2], *a[2:], temp),
                               self.m.ref_params, self.m.rest)
            metrics["rollout/ref_kl"] = float(masked_mean(old_logp - ref_logp, loss_mask > 0))
        values = None
        if self.m.critic_graphdef is not None:
            values = chunked(lambda *a: _values(self.m.critic_graphdef, *a),
                             self.m.critic_params, self.m.critic_rest)
        t["timing_s/old_log_prob"] = time.perf_counter() - t0

        # ---- advantages ----
        a = c.algorithm
        scores = put(batch.scores[rows])
        adv, returns = compute_advantages(
            a.adv_estimator, token_rewards=sl(batch.token_rewards),
            loss_mask=loss_mask > 0, scores=scores,
            group_ids=put(batch.group_ids[rows] + part.start), num_groups=g, values=values,
            turn_end=put(_turn_ends(cols(batch.loss_mask), cols(batch.turn_ids))),
            gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_adv_by_std, bi_level=a.bi_level_gae,
            high_level_gamma=a.high_level_gamma)
        metrics["critic/advantages_mean"] = float(masked_mean(adv, loss_mask > 0))
        metrics["critic/score_mean"] = float(jnp.mean(scores))

        # ---- updates: critic, then actor ----
        t0 = time.perf_counter()
        epochs = c.actor.ppo_epochs
        if self.m.critic_graphdef is not None:
            cb = shard_batch(CriticBatch(ids, attn, pos, loss_mask, values, returns), self.mesh)
            self.m.critic_params, self.critic_opt_state, cm = ppo_update(
                self.critic_step, self.m.critic_params, self.m.critic_rest, self.critic_opt_state,
                cb, epochs=epochs, mini_batch_size=mb)
            metrics |= {k: v for k, v in cm.items() if k.startswith("critic/")}
            metrics["critic/values_mean"] = float(masked_mean(values, loss_mask > 0))
        t["timing_s/update_critic"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.step >= c.critic.warmup:
            tb = shard_batch(TrainBatch(ids, attn, pos, loss_mask, old_logp, adv, ref_logp), self.mesh)
            if c.diagnostics.gradient_analysis and diagnose_now:
                t1 = time.perf_counter()
                metrics |= self.gradient_analysis(tb, batch.scores, batch.group_ids[rows] + part.start)
                t["timing_s/gradient_analysis"] = time.perf_counter() - t1
            self.m.params, self.opt_state, am = ppo_update(
                self.actor_step, self.m.params, self.m.rest, self.opt_state, tb,
                epochs=epochs, mini_batch_size=mb)
            metrics |= am
            nnx.update(self.m.actor, self.m.params)
            self._refresh_sampler()
            if am.get("actor/update_skipped", 0.0) > 0:
                self.log(f"step {self.step + 1}: non-finite loss or gradient, update skipped")
        t["timing_s/update_actor"] = time.perf_counter() - t0
        metrics["train/batch_size"] = float(n_rows)
        return metrics | t

    # -- the loop ------------------------------------------------------------------------------

    def log(self, text: str) -> None:
        if self.logger is not None:
            self.logger.print(text)

    def _write_val(self, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        if not (self.is_main and self.c.trainer.save_trajectories):
            return
        from ragen_jax.eval import render_html

        d = self.out / "trajectories"
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"val_step{self.step:05d}.jsonl", "w", encoding="utf-8") as f:
            for traj in batch.trajectories:
                f.write(json.dumps(traj, ensure_ascii=False) + "\n")
        summary = {"model": f"step {self.step}", "env": self.tag, "metrics": metrics}
        (d / f"val_step{self.step:05d}.html").write_text(
            render_html(batch.trajectories[:64], summary), encoding="utf-8")

    def _handle_signal(self, signum, _frame):
        self._stop_signal = signum
        if signum == signal.SIGINT and getattr(self, "_sigint_seen", False):
            raise KeyboardInterrupt  # a second Ctrl-C stops at once (no save)
        self._sigint_seen = signum == signal.SIGINT

    def train(self) -> dict[str, Any]:
        """Runs (or resumes) to ``total_steps``; returns a summary."""
        c, tr = self.c, self.c.trainer
        resumed = self.maybe_resume()
        self.logger = MetricsLogger(self.out, total_steps=tr.total_steps, start_step=self.step,
                                    enabled=self.is_main, progress=tr.progress)
        old = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        summary: dict[str, Any] = {"output_dir": str(self.out), "resumed_from": self.step if resumed else None}
        try:
            if resumed:
                self.log(f"resumed from {self.store.path}/{self.step}")
            else:
                pre = self.warmstart(self.log) if (c.warmstart.steps or c.sft.steps) else {}
                metrics = dict(pre)
                if tr.val_before_train:
                    t0 = time.perf_counter()
                    vm, vb = self.evaluate()
                    metrics |= vm | {"timing_s/val": time.perf_counter() - t0}
                    self._write_val(vb, vm)
                    self.log(_val_line(0, vm, self.tag))
                self.logger.log(0, metrics)
                self.save()
            stop = None
            while self.step < tr.total_steps and self._stop_signal is None and stop is None:
                t0 = time.perf_counter()
                metrics = self.train_step()
                self.step += 1
                if self.step % tr.test_freq == 0 or self.step == tr.total_steps:
                    tv = time.perf_counter()
                    vm, vb = self.evaluate()
                    metrics |= vm | {"timing_s/val": time.perf_counter() - tv}
                    self._write_val(vb, vm)
                    self.log(_val_line(self.step, vm, self.tag))
                stop = early_stop_reason(tr, self.meta, metrics, self.tag)
                if stop:
                    metrics[f"early_stopped/{stop}"] = 1.0
                    self.log(f"early stop at step {self.step}: {stop}")
                metrics["timing_s/step"] = time.perf_counter() - t0
                self.logger.log(self.step, metrics)
                self.logger.advance(self.step, _progress_info(metrics, self.tag))
                if self.step % tr.save_freq == 0 or self.step == tr.total_steps or stop:
                    self.save()
                if self.on_step is not None:
                    self.on_step(self.step, metrics)
                if dist.any_process(self._stop_signal is not None):  # one stops, all stop
                    self._stop_signal = self._stop_signal or signal.SIGTERM
            if self._stop_signal is not None:
                self.save()
                self.log(f"stopped by signal {self._stop_signal} after step {self.step}; "
                         f"checkpoint saved, rerun the same command to resume")
                summary["interrupted"] = True
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.logger.close()
            self.store.close()
        summary["step"] = self.step
        return summary


def early_stop_reason(rules: Any, meta: dict[str, Any], metrics: dict[str, float],
                      tag: str) -> str | None:
    """RAGEN's early-stopping rules, each an option of ``rules`` (``config.trainer``):
    ``stop_empty_after_filter`` consecutive empty batches; ``stop_reward_std_collapse``: ten
    consecutive steps whose in-group reward std is below 0.1 x the mean of the first ten;
    ``stop_val_success_collapse``: validation success below 0.01 five times running.
    ``meta`` carries the streaks between calls (and in checkpoints)."""
    if rules["stop_empty_after_filter"] and meta["empty_streak"] >= rules["stop_empty_after_filter"]:
        return "empty_after_filter"
    std = metrics.get("rollout/in_group_reward_std")
    if rules["stop_reward_std_collapse"] and std is not None:
        hist = meta["std_history"]
        if len(hist) < 10:
            hist.append(float(std))
        else:
            low = std < 0.1 * float(np.mean(hist))
            meta["std_low_streak"] = meta["std_low_streak"] + 1 if low else 0
            if meta["std_low_streak"] >= 10:
                return "reward_std_collapse"
    val = metrics.get(f"val-env/{tag}/success")
    if rules["stop_val_success_collapse"] and val is not None:
        meta["val_low_streak"] = meta["val_low_streak"] + 1 if val < 0.01 else 0
        if meta["val_low_streak"] >= 5:
            return "val_success_collapse"
    return None


def _val_line(step: int, vm: dict[str, float], tag: str) -> str:
    parts = [f"{k.split('/')[1]} success {v:.3f}" for k, v in vm.items() if k.endswith("/success")]
    return f"validation at step {step}: " + ", ".join(parts)


def _progress_info(m: dict[str, float], tag: str) -> str:
    return (f"score {m.get(f'train/{tag}/score', float('nan')):+.3f}  "
            f"success {m.get(f'train/{tag}/success', float('nan')):.3f}  "
            f"{m.get('timing_s/step', 0):.1f} s/step")


def run(config: ConfigDict, **kw: Any) -> dict[str, Any]:
    """Builds the run from ``config`` and trains it (DESIGN: ``ragen_jax.train.run``)."""
    validate(config)
    dist.initialize(config.distributed)  # a no-op if launch.py already did it
    trainer = Trainer(config, **kw)
    if trainer.is_main:
        trainer.out.mkdir(parents=True, exist_ok=True)
        (trainer.out / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    try:
        return trainer.train()
    except jax.errors.JaxRuntimeError as e:
        if not dist.multiprocess():
            raise
        first = str(e).strip().splitlines()[0][:300]
        dist.abort(f"a collective failed, most likely another process of the job died (see its "
                   f"log): {first}. Rerun every process to resume from the last complete "
                   f"checkpoint")
        raise
