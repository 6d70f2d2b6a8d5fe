"""The run config's typed schema: every default of a training run, written once.

Each section of the run config is a frozen dataclass; its defaults are RAGEN's (its
``config/base.yaml`` on veRL v0.6.1) wherever RAGEN has the setting, and each field carries a
one-line comment that is the user documentation (``config.reference`` builds the reference
page from them). ``config.loading`` turns a ConfigDict into a ``RunConfig`` and back,
``config.resolve`` computes the settings the pieces consume.

Sections whose settings belong to one library module live there: ``config.rollout`` is
``rollout.config.RolloutConfig``, ``config.filter`` is ``starpo.filtering.FilterConfig``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from ragen_jax.config.fields import (
    ConfigError,
    at_least,
    choice,
    dotted,
    learning_rate,
    read_section,
)
from ragen_jax.metrics import NO_OP_SINKS, SINKS
from ragen_jax.models.attention import ATTENTION_IMPLS
from ragen_jax.models.qwen_config import REMAT_POLICIES
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.starpo.advantages import GIGPO_EPISODE_STATS
from ragen_jax.starpo.estimators import ESTIMATORS, GIGPO_PENALTIES
from ragen_jax.starpo.filtering import FilterConfig
from ragen_jax.starpo.normalization import GROUPINGS, METHODS
from ragen_jax.starpo.update import SAMPLE_UNITS

# Seeds and step numbers become uint32 random-key data (jax.random.key, fold_in); past that
# they failed deep in JAX as an OverflowError traceback.
MAX_SEED = 2**32 - 1
MAX_STEP = 2**31 - 1
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # a dtype's name -> JAX dtype
COMPUTE_DTYPES = ("auto", *DTYPES)  # model.dtype's values (auto: compute_dtype decides)
frozen = dataclasses.dataclass(frozen=True, kw_only=True)


def _mix_entry(i: int, entry: Any) -> MixEntry:
    """Entry ``i`` of ``env.mix`` (a dict, a ConfigDict or a ``MixEntry``) as a ``MixEntry``."""
    if isinstance(entry, MixEntry):
        return entry
    if isinstance(entry, ConfigDict):
        entry = entry.to_dict()
    if not isinstance(entry, dict):
        raise ConfigError(f"env.mix[{i}]: expected a dict of MixEntry fields, got {entry!r}")
    try:
        return read_section(f"env.mix[{i}]", MixEntry, entry)
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith("env.mix") else
                          f"env.mix[{i}].{message}") from None


# ModelConfig fields that only shape the tiny random model (a folder's config.json decides).
TINY_ONLY_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size",
                    "num_attention_heads", "num_key_value_heads")


@frozen
class ModelConfig:
    """The policy model (``config.model``): a Hugging Face folder or the tiny random model, its
    dtypes, memory policy and LoRA."""

    path: str = ""  # local Hugging Face folder (Qwen2/Qwen2.5, Llama, Qwen3), or a .gguf file (converted once into a cached folder); "" = the tiny random model
    dtype: str = "float32"  # compute dtype of activations, matmuls and sampling: float32 | bfloat16 | auto (bfloat16 on GPU/TPU, float32 on XLA:CPU, where bf16 matmuls are ~10x slower)
    param_dtype: str = "float32"  # storage dtype of the trained weights and optimizer state (keep float32: bf16 AdamW updates round away)
    remat: str = "none"  # what a layer keeps for the backward pass: none | full | dots (weight-matmul outputs)
    scan_layers: bool = True  # training forward runs the layers as one lax.scan (compile time flat in depth)
    attention_impl: str = "xla"  # attention of the training/scoring forward: xla (materialised scores) | cudnn (cuDNN flash attention, bf16 on an NVIDIA GPU) | auto (cudnn where it can run, else xla)
    hidden_size: int = 128  # tiny random model only: width
    num_hidden_layers: int = 4  # tiny random model only: depth
    intermediate_size: int = 384  # tiny random model only: MLP width
    num_attention_heads: int = 4  # tiny random model only: query heads
    num_key_value_heads: int = 2  # tiny random model only: KV heads (GQA)
    lora_rank: int = 0  # LoRA rank, 0 = full fine-tuning (RAGEN: 0)
    lora_alpha: float = 64.0  # LoRA alpha (RAGEN: 64)

    def __post_init__(self):
        choice("model.dtype", self.dtype, COMPUTE_DTYPES)
        choice("model.param_dtype", self.param_dtype, tuple(DTYPES))
        choice("model.remat", self.remat, tuple(REMAT_POLICIES))
        choice("model.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        # ("auto" is resolved only where the model is built: the backend is not up yet here)
        if self.attention_impl == "cudnn" and self.dtype == "float32":
            raise ConfigError("model.attention_impl='cudnn' needs bfloat16 compute, got "
                              "model.dtype='float32' (or use attention_impl 'auto')")
        at_least("model", self, TINY_ONLY_FIELDS, 1)
        at_least("model", self, ("lora_rank",), 0)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not a multiple of "
                              f"model.num_attention_heads={self.num_attention_heads}")
        if self.path.lower().endswith(".gguf"):  # runs from its converted folder, made once
            from ragen_jax.models.gguf import cached_folder
            from ragen_jax.models.hf_folder import CheckpointError
            try:
                object.__setattr__(self, "path", str(cached_folder(self.path)))
            except CheckpointError as e:
                raise ConfigError(f"model.path: {e}") from None
        if self.path and not Path(self.path).is_dir():
            raise ConfigError(f"model.path: no such folder: {self.path}")


def compute_dtype(model: ModelConfig, backend: str | None = None) -> tuple[str, str]:
    """``model.dtype`` resolved on ``backend`` (default: JAX's default backend, so call it
    where the run builds its model, not while reading the config) and the one line a run
    prints at its start saying which dtype it took and why.

    ``auto`` takes bfloat16 on GPU and TPU (their matrix units compute in bf16, at half the
    bytes) and float32 on XLA:CPU, which has no fast bf16 matmul: the 0.5B shape's MLPs ran
    ~10x slower in bf16 at decode's batch 1 and ~4x at batch 8, a 2048^3 matmul 1.5x
    (``experiments/results/bench_peers.md``, ``bench_sampler.md``). The weights' storage
    (``model.param_dtype``) is not changed.
    """
    backend = backend or jax.default_backend()
    on = "XLA:CPU" if backend == "cpu" else backend
    if model.dtype != "auto":
        hint = (" (slow there: model.dtype=auto takes float32 on XLA:CPU)"
                if backend == "cpu" and model.dtype == "bfloat16" else "")
        return model.dtype, f"compute dtype: {model.dtype} (model.dtype={model.dtype}, on {on}){hint}"
    if backend == "cpu":
        return "float32", ("compute dtype: float32 (model.dtype=auto, on XLA:CPU: its bfloat16 "
                           "matmuls run ~10x slower than float32 at decode batch sizes)")
    return "bfloat16", f"compute dtype: bfloat16 (model.dtype=auto, on {on}: bf16 matrix units)"


# rollout.<field>s an env.mix entry may set for itself (RAGEN's per-tag env settings and the
# per-env prompt); the others (groups, seeds, lengths of the shared batch, sampling) are the run's.
MIX_ROLLOUT_FIELDS = ("max_turn", "max_actions_per_traj", "max_actions_per_turn",
                      "response_length", "prompt.max_tokens_hint", "prompt.max_answer_chars",
                      "prompt.turn_template", "prompt.system_template", "prompt.format_penalty")


@frozen
class MixEntry:
    """One environment of ``env.mix`` (RAGEN's ``es_manager.*.env_configs``: a tag and its
    ``n_groups``). The run's envs play together: each step's ``rollout.env_groups`` groups
    are the entries' ``groups`` in order, trained in one batch; validation plays each
    entry's ``val_groups`` groups on the fixed seeds ``rollout.val.seed + i``."""

    name: str = ""  # registered env name (ragen_jax.envs.make)
    params: dict = dataclasses.field(default_factory=dict)  # env constructor / EnvParams fields
    tag: str = ""  # metric tag (train/<tag>/..., val-env/<tag>/...); "" = the env class name
    groups: int = 0  # its env groups per training step; the entries' sum is rollout.env_groups (RAGEN: n_groups); 0 = validation only
    val_groups: int | None = None  # its validation groups; None (every entry) = rollout.val.env_groups split in proportion to groups
    rollout: dict = dataclasses.field(default_factory=dict)  # this env's own rollout.<field> values, of MIX_ROLLOUT_FIELDS, a section's nested (e.g. a one-step env: max_turn=1, max_actions_per_traj=1; prompt={"turn_template": ...})

    def __post_init__(self):
        unknown = set(dotted(self.rollout)) - set(MIX_ROLLOUT_FIELDS)
        if unknown:
            raise ConfigError(f"rollout.{sorted(unknown)[0]}: not settable per env (one of "
                              f"{', '.join(MIX_ROLLOUT_FIELDS)})")
        if not self.name:
            raise ConfigError("name: required (a registered env name)")
        if "/" in self.tag:
            raise ConfigError(f"tag: no '/' in a metric tag, got {self.tag!r}")
        if self.groups < 0:
            raise ConfigError(f"groups must be >= 0, got {self.groups}")
        if self.val_groups is not None and self.val_groups < 0:
            raise ConfigError(f"val_groups must be >= 0 (or None: proportional), got {self.val_groups}")


@frozen
class EnvConfig:
    """The environment (``config.env``): one registered env with its parameters, or several
    (``mix``)."""

    name: str = "sokoban"  # registered env name (ragen_jax.envs.make)
    params: dict = dataclasses.field(default_factory=dict)  # env constructor / EnvParams fields, e.g. dim_room
    tag: str = ""  # metric tag; "" = the env class name (RAGEN's tag, e.g. "Sokoban")
    val_extra: dict = dataclasses.field(default_factory=dict)  # extra validation envs: {tag: {param overrides}}
    mix: tuple = ()  # several envs in one run, each {name, params, tag, groups, val_groups} (MixEntry); () = the one env above (name, params, tag, val_extra)

    def __post_init__(self):
        entries = tuple(_mix_entry(i, e) for i, e in enumerate(self.mix))
        object.__setattr__(self, "mix", entries)
        if not entries:
            return
        if self.val_extra:
            raise ConfigError("env.val_extra: not used with env.mix (add a validation-only "
                              "entry to env.mix instead: groups=0, val_groups=N)")
        tags = [e.tag for e in entries if e.tag]
        if len(set(tags)) < len(tags):
            raise ConfigError(f"env.mix: two entries have the same tag ({tags})")
        if not any(e.groups for e in entries):
            raise ConfigError("env.mix: no entry has training groups (groups > 0)")
        given = [e.val_groups is not None for e in entries]
        if any(given) and not all(given):
            raise ConfigError("env.mix: give val_groups to every entry or to none (None: "
                              "rollout.val.env_groups split in proportion to groups)")


@frozen
class AlgorithmConfig:
    """The RL algorithm (``config.algorithm``): advantage estimator, PPO clipping, KL and
    entropy terms, reward normalisation."""

    adv_estimator: str = "gae"  # gae (PPO, critic) | grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gigpo (per-turn: GRPO's episode advantage plus a step advantage among the group's turns from the same state) (RAGEN: gae)
    gamma: float = 1.0  # GAE discount (RAGEN: 1)
    lam: float = 1.0  # GAE lambda (RAGEN: 1)
    bi_level_gae: bool = False  # RAGEN's turn-then-token GAE (uses turn scores)
    high_level_gamma: float = 0.95  # bi-level GAE turn discount (RAGEN: 0.95)
    norm_adv_by_std: bool = True  # GRPO and GiGPO: divide by the group std (RAGEN: True; verl-agent's GiGPO default mode mean_norm is False)
    gigpo_gamma: float = 0.95  # GiGPO: discount of each turn's step return over its episode's later turns (the paper's and ROLL's 0.95)
    gigpo_step_weight: float = 1.0  # GiGPO: weight of the step advantage added to the episode advantage (verl-agent: step_advantage_w 1)
    gigpo_similarity: float = 1.0  # GiGPO: a host env's turns whose observation texts are at least this similar (difflib ratio) share an anchor state; 1 = equal texts (verl-agent: enable_similarity False, else similarity_thresh 0.95). JAX envs compare exact states
    gigpo_episode_stats: str = "episode"  # GiGPO: the episode advantage's group mean and std count each episode once: episode | once per turn it played, so longer episodes weigh more: turn (verl-agent's default, compute_mean_std_cross_steps=True)
    gigpo_penalty: str = "discounted"  # GiGPO: a turn's format penalty is part of its score, discounted into the earlier turns' step returns and summed into the episode score: discounted | subtracted from that turn's step return and episode score alone, undiscounted: own_turn (verl-agent's invalid-action penalty; exact with reward_norm_method=identity)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    clip_low: float = 0.2  # PPO ratio clip below (RAGEN: 0.2)
    clip_high: float = 0.28  # PPO ratio clip above, clip-higher (RAGEN: 0.28)
    clip_c: float = 3.0  # dual clip for negative advantages (RAGEN: 3)
    entropy_coeff: float = 0.001  # entropy bonus (RAGEN: 0.001)
    kl_coef: float = 0.0  # KL-to-reference loss weight; > 0 adds the reference role (RAGEN: 0)
    kl_estimator: str = "k1"  # k1 | k3 | mse (RAGEN: kl = k1)
    reward_norm_grouping: str = "state"  # trajectory-score normalisation within: state (env group) | batch | inductive (env tag) (RAGEN: state)
    reward_norm_method: str = "identity"  # identity | mean | mean_std | asym_clip (mean_std clamped to [-1, 3]) (RAGEN: identity). RAGEN V1's names are pairs of these two: GRPO = state mean_std, BRPO = batch mean_std, ARPO = identity (starpo.normalization.PRESETS)
    sample_unit: str = "trajectory"  # a training row is a trajectory (its whole sequence) | a turn (its prompt, then its answer; the episode's advantage on every turn). rollout.window.mode limited / single_turn need turn

    def __post_init__(self):
        choice("algorithm.adv_estimator", self.adv_estimator, tuple(ESTIMATORS))
        choice("algorithm.sample_unit", self.sample_unit, SAMPLE_UNITS)
        choice("algorithm.reward_norm_grouping", self.reward_norm_grouping, GROUPINGS)
        choice("algorithm.reward_norm_method", self.reward_norm_method, METHODS)
        choice("algorithm.gigpo_episode_stats", self.gigpo_episode_stats, GIGPO_EPISODE_STATS)
        choice("algorithm.gigpo_penalty", self.gigpo_penalty, GIGPO_PENALTIES)
        if self.bi_level_gae and self.adv_estimator != "gae":
            raise ConfigError("algorithm.bi_level_gae needs algorithm.adv_estimator=gae")
        if self.kl_coef < 0 or self.entropy_coeff < 0:
            raise ConfigError("algorithm.kl_coef and algorithm.entropy_coeff must be >= 0")
        if not 0.0 <= self.gigpo_gamma <= 1.0:
            raise ConfigError(f"algorithm.gigpo_gamma must be in [0, 1], got {self.gigpo_gamma}")
        if not 0.0 < self.gigpo_similarity <= 1.0:
            raise ConfigError(f"algorithm.gigpo_similarity must be in (0, 1], got "
                              f"{self.gigpo_similarity}")


@frozen
class ActorConfig:
    """The policy's optimizer and update batching (``config.actor``)."""

    lr: float = 1e-6  # AdamW learning rate (RAGEN: 1e-6)
    lr_schedule: str = "constant"  # constant | cosine, over trainer.total_steps training steps (RAGEN: constant)
    warmup_steps: int = 0  # linear learning-rate warmup, in training steps (RAGEN: 0)
    weight_decay: float = 0.01  # AdamW weight decay (RAGEN: 0.01)
    grad_clip: float = 1.0  # global-norm clip (RAGEN: 1)
    ppo_mini_batch_size: int = 32  # trajectories per optimizer step (RAGEN: 32)
    ppo_epochs: int = 1  # passes over a batch (RAGEN: 1)
    micro_batches: int = 1  # gradient-accumulation chunks per mini-batch (memory only)
    recompute_logprobs: bool = True  # old log-probs from a forward pass (RAGEN) vs the sampler's
    share_prompt_forward: bool = True  # a group's common first prompt runs once per forward pass of the update, not once per row (exact)
    row_pad_multiple: int = 0  # the update's rows (and shared prefixes) are cut to the longest, rounded up to this (and never narrower than earlier steps': ragen_jax.shapes); 0 = an eighth of rollout.max_model_len, rounded up to 64. Smaller pads less, compiles more shapes
    long_rows_apart: bool = True  # one device: a mini-batch's longest rows train as its last micro-batch, the others cut to their own width (exact; micro_batches >= 2)

    def __post_init__(self):
        learning_rate("actor.lr", self.lr)
        choice("actor.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        at_least("actor", self, ("ppo_mini_batch_size", "ppo_epochs", "micro_batches"), 1)
        at_least("actor", self, ("row_pad_multiple",), 0)
        at_least("actor", self, ("warmup_steps",), 0)
        if self.ppo_mini_batch_size % self.micro_batches:
            raise ConfigError(f"actor.micro_batches={self.micro_batches} must divide "
                              f"actor.ppo_mini_batch_size={self.ppo_mini_batch_size}")


@frozen
class CriticConfig:
    """The value model's optimizer (``config.critic``); used only by estimators that need
    values (GAE)."""

    lr: float = 1e-5  # critic AdamW learning rate (RAGEN: 1e-5)
    weight_decay: float = 0.01  # critic AdamW weight decay (RAGEN: 0.01)
    value_clip: float = 0.5  # clipped value loss range (RAGEN: 0.5)
    grad_clip: float = 1.0  # critic global-norm clip (RAGEN: 1)
    micro_batches: int = 1  # critic gradient-accumulation chunks per mini-batch (memory only)
    warmup: int = 0  # first training steps that train only the critic (RAGEN: critic_warmup 0)

    def __post_init__(self):
        learning_rate("critic.lr", self.lr)
        at_least("critic", self, ("micro_batches",), 1)
        at_least("critic", self, ("warmup",), 0)


@frozen
class TurnRowsConfig:
    """The warm-start's first phase (``config.warmstart.turns``): single-turn rows, each
    answered turn's user block and answer cut from scripted episodes (short rows that teach
    reading the state), before ``warmstart.steps`` on whole episodes. Its data are the
    whole-episode data's unless ``solver_share``, ``episodes`` or ``system_prompt`` ask for
    episodes of its own."""

    steps: int = 0  # steps on single-turn rows before warmstart.steps on whole episodes (0 = none)
    batch_size: int = 64  # single-turn rows per such step
    system_prompt: bool = False  # rows start with the system message (the rollout's first prompt), run once per step for the batch
    solver_share: float | None = None  # the rows' share of optimal moves, from episodes of their own; None = warmstart.solver_share (rows cut from the whole-episode data)
    episodes: int = 0  # the rows' own episodes, each on a level of its own (0 = as the whole-episode data: warmstart.episodes, a group per level)

    def __post_init__(self):
        if self.solver_share is not None and not 0.0 <= self.solver_share <= 1.0:
            raise ConfigError(f"warmstart.turns.solver_share must be None or in [0, 1], got "
                              f"{self.solver_share}")
        at_least("warmstart.turns", self, ("steps", "episodes"), 0)
        at_least("warmstart.turns", self, ("batch_size",), 1)


@frozen
class WarmstartConfig:
    """The supervised warm-start before RL (``config.warmstart``): scripted episodes that teach
    the answer format (and, with ``solver_share``, a little of the task), so a tiny random
    model starts from a policy that can act; first on single-turn rows (``turns``), then on
    whole episodes."""

    steps: int = 0  # supervised warm-start steps on whole episodes before RL (tiny presets: > 0)
    batch_size: int = 16  # trajectories per warm-start step
    lr: float = 1e-3  # warm-start learning rate
    episodes: int = 256  # episodes generated for it
    legal_actions: bool = False  # draw only state-changing actions (no walking into walls)
    solver_share: float = 0.0  # share of actions that are the env's optimal move (BFS), the rest random legal; 0 = format only
    seed: int | None = None  # seed of its data and of the model it starts from; None = the run's seed (set it to share one starting policy across runs)
    cache: bool = True  # tiny model: keep the result under $RAGEN_JAX_CACHE (default ~/.cache/ragen_jax) and reuse it
    turns: TurnRowsConfig = TurnRowsConfig()

    def __post_init__(self):
        learning_rate("warmstart.lr", self.lr)
        if not 0.0 <= self.solver_share <= 1.0:
            raise ConfigError(f"warmstart.solver_share must be in [0, 1], got {self.solver_share}")
        at_least("warmstart", self, ("steps",), 0)
        at_least("warmstart", self, ("batch_size", "episodes"), 1)

    @property
    def turn_share(self) -> float:
        """The single-turn rows' solver share (``turns.solver_share``, None resolved)."""
        return self.solver_share if self.turns.solver_share is None else self.turns.solver_share

    @property
    def own_turn_data(self) -> bool:
        """Whether the single-turn rows come from episodes of their own share."""
        t = self.turns
        return t.steps > 0 and (self.turn_share != self.solver_share or t.system_prompt
                                or t.episodes > 0)

    def seed_for(self, run_seed: int) -> int:
        """The seed of the warm-start's data and starting model in a run seeded ``run_seed``."""
        return run_seed if self.seed is None else self.seed


@frozen
class SFTConfig:
    """An optional SFT stage on chat transcripts before RL (``config.sft``)."""

    data: str = ""  # JSONL of chat trajectories ({"messages": [...]}) for an SFT stage
    steps: int = 0  # SFT optimizer steps (0 = off)
    batch_size: int = 8  # conversations per SFT step
    lr: float = 1e-5  # SFT learning rate

    def __post_init__(self):
        learning_rate("sft.lr", self.lr)
        if self.steps and not Path(self.data).is_file():
            raise ConfigError(f"sft.data: no such file: {self.data!r}")


@frozen
class DiagnosticsConfig:
    """The collapse diagnostics (``config.diagnostics``): RAGEN V2's mutual-information
    estimates of whether answers still depend on their inputs."""

    compute_freq: int = 5  # collapse diagnostics every k steps, 0 = off (RAGEN: 5)
    num_samples: int = 64  # first-turn pairs: episodes scored under every group's prompt (RAGEN: 64)
    trajectory_samples: int = 64  # trajectory-uniform pairs, each its own input; 0 = off (RAGEN: 64)
    micro_batch_size: int = 128  # rows per cross-scoring forward pass (RAGEN: 128)
    micro_batch_tokens: int = 65536  # and at most this many cache slots (rows x (input + reasoning)) per pass: bounds memory on long contexts (veRL's log_prob_max_token_len_per_gpu role)
    ema: float = 0.9  # EMA decay of the marginal's std that mi_zscore_ema divides by (RAGEN: 0.9; one per pair kind)
    gradient_analysis: bool = False  # per-component grad norms by reward-std bucket, every compute_freq steps (costly)
    gradient_buckets: int = 3  # reward-std buckets of groups for it (RAGEN: 4-6)

    def __post_init__(self):
        at_least("diagnostics", self, ("gradient_buckets", "micro_batch_size", "micro_batch_tokens"), 1)
        at_least("diagnostics", self, ("compute_freq", "num_samples", "trajectory_samples"), 0)


@frozen
class TrainerConfig:
    """The run's loop (``config.trainer``): steps, validation, checkpoints, logging and early
    stopping."""

    output_dir: str = ""  # run folder; "" = runs/<env>-<preset>
    total_steps: int = 200  # training steps (RAGEN: 200)
    test_freq: int = 10  # validate every k steps (RAGEN: 10)
    val_before_train: bool = True  # validate at step 0 (RAGEN: True)
    save_freq: int = 100  # checkpoint every k steps (RAGEN: 100)
    keep_checkpoints: int = 3  # checkpoints kept (the last k)
    save_trajectories: bool = True  # write validation trajectories (JSONL + HTML viewer)
    progress: bool = True  # console progress bar
    logger: tuple = ("tensorboard", "jsonl")  # metric sinks: tensorboard, jsonl, wandb (console is always on)
    project_name: str = "ragen_jax"  # Weights & Biases project (RAGEN: trainer.project_name)
    experiment_name: str = ""  # Weights & Biases run name; "" = the run folder's name
    stop_reward_std_collapse: bool = False  # RAGEN: 10 steps of in-group std < 0.1 x early mean
    stop_empty_after_filter: int = 5  # stop after k consecutive empty batches (0 = never)
    stop_val_success_collapse: bool = False  # RAGEN: val success < 0.01 five times running

    def __post_init__(self):
        at_least("trainer", self, ("total_steps", "test_freq", "save_freq", "keep_checkpoints"), 1)
        if self.total_steps > MAX_STEP:
            raise ConfigError(f"trainer.total_steps must be <= {MAX_STEP} (steps fold into JAX's "
                              f"32-bit random keys), got {self.total_steps}")
        for name in self.logger:  # before the run folder gets its config.json
            choice("trainer.logger", name, (*SINKS, *NO_OP_SINKS))


@frozen
class MeshConfig:
    """The device mesh (``config.mesh``): data, FSDP and tensor-parallel axes."""

    data: int | None = None  # data-parallel axis (None = every remaining device)
    fsdp: int = 1  # parameter-sharding axis
    tensor: int = 1  # tensor-parallel axis

    def __post_init__(self):
        if self.data is not None and self.data < 1:
            raise ConfigError(f"mesh.data must be >= 1, or None (every remaining device), got "
                              f"{self.data}")
        at_least("mesh", self, ("fsdp", "tensor"), 1)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` as ``sharding.make_mesh`` takes it (-1: the rest)."""
        return (-1 if self.data is None else self.data, self.fsdp, self.tensor)


@frozen
class DistributedConfig:
    """A multi-process (multi-host) job (``config.distributed``)."""

    coordinator_address: str = ""  # "host:port" of process 0; "auto" (TPU pod, SLURM); "" = one process
    num_processes: int = 1  # processes in the job
    process_id: int = 0  # this process's index
    initialization_timeout_s: int = 300  # give up if the job has not assembled by then
    heartbeat_timeout_s: int = 100  # a silent (dead) process ends the others after this

    def __post_init__(self):
        at_least("distributed", self, ("num_processes", "initialization_timeout_s",
                                       "heartbeat_timeout_s"), 1)
        if self.coordinator_address != "auto" and not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"distributed.process_id must be in [0, distributed.num_processes="
                              f"{self.num_processes}), got {self.process_id}")

    @property
    def enabled(self) -> bool:
        return bool(self.coordinator_address) and (
            self.num_processes > 1 or self.coordinator_address == "auto")


@frozen
class RunConfig:
    """A whole run: ``config.<section>.<field>`` on the command line."""

    preset: str = "tiny"  # which preset built this config (informational)
    seed: int = 0  # one seed drives init, env seeds' noise, sampling and batch padding
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    filter: FilterConfig = FilterConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    sft: SFTConfig = SFTConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    trainer: TrainerConfig = TrainerConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be in [0, {MAX_SEED}] (it seeds JAX's uint32 random "
                              f"keys and numpy's generators), got {self.seed}")
        self._check_sample_unit()
        self._check_mix()
        self._check_lengths()
        d = self.distributed
        if d.enabled and d.coordinator_address != "auto":
            for name, groups in (("env_groups", self.rollout.env_groups),
                                 ("val.env_groups", self.rollout.val.env_groups)):
                if groups % d.num_processes:
                    raise ConfigError(f"rollout.{name}={groups} must be a multiple of "
                                      f"distributed.num_processes={d.num_processes}")
            for i, e in enumerate(env_specs(self) if self.env.mix else ()):
                for name in ("groups", "val_groups"):  # each process plays its share of each env
                    if getattr(e, name) % d.num_processes:
                        raise ConfigError(f"env.mix[{i}].{name}={getattr(e, name)} must be a "
                                          f"multiple of distributed.num_processes={d.num_processes}")
        if self.preset != "tiny" and not self.model.path:
            raise ConfigError(f"model.path is required for preset {self.preset}: give "
                              f"--config.model.path=/path/to/a/local/Hugging-Face/folder")

    def _check_mix(self) -> None:
        """RAGEN's rule: the entries' groups sum to ``rollout.env_groups`` (and explicit
        ``val_groups`` to ``rollout.val.env_groups``)."""
        mix, r = self.env.mix, self.rollout
        if not mix:
            return
        total = sum(e.groups for e in mix)
        if total != r.env_groups:
            raise ConfigError(f"env.mix: the entries' groups sum to {total}, but "
                              f"rollout.env_groups={r.env_groups} (they must be equal)")
        for i, e in enumerate(mix):
            try:
                r.replace(e.rollout)
            except (ValueError, TypeError) as err:
                raise ConfigError(f"env.mix[{i}].{err}") from None
        if mix[0].val_groups is not None and sum(e.val_groups for e in mix) != r.val.env_groups:
            raise ConfigError(f"env.mix: the entries' val_groups sum to "
                              f"{sum(e.val_groups for e in mix)}, but rollout.val.env_groups="
                              f"{r.val.env_groups} (they must be equal)")

    def _check_lengths(self) -> None:
        """A turn's prompt and its answer share a trajectory's ``max_model_len`` tokens, so an
        answer budget (``response_length``, the run's or an ``env.mix`` entry's) must leave
        room for a prompt; without this a huge one reached the update's row builder as a
        traceback. (The model's own limit, ``max_position_embeddings``, is checked where its
        ``config.json`` is read: ``budget.check_run``.)"""
        r = self.rollout
        own = [(f"env.mix[{i}].rollout.response_length", e.rollout["response_length"])
               for i, e in enumerate(self.env.mix) if "response_length" in e.rollout]
        for field, length in [("rollout.response_length", r.response_length), *own]:
            if length >= r.max_model_len:
                raise ConfigError(f"{field}={length} must be below rollout.max_model_len="
                                  f"{r.max_model_len} (a turn's prompt and its answer share "
                                  f"them)")

    def _check_sample_unit(self) -> None:
        """Windows other than ``full`` and cut prompts have no single trajectory sequence:
        they train turn-wise (as RAGEN's limited_multi_turn and single_turn modes do)."""
        r, a = self.rollout, self.algorithm
        if a.sample_unit == "turn":
            if a.bi_level_gae or r.use_turn_scores:
                raise ConfigError("algorithm.sample_unit=turn trains each turn on its episode's "
                                  "score: it does not combine with algorithm.bi_level_gae or "
                                  "rollout.use_turn_scores")
            return
        if r.window.mode != "full":
            raise ConfigError(f"algorithm.sample_unit must be 'turn' with rollout.window.mode="
                              f"{r.window.mode} (each turn saw its own prompt, so each turn is "
                              f"its own training row), got {a.sample_unit!r}")
        if r.window.overlong == "truncate":
            raise ConfigError(f"algorithm.sample_unit must be 'turn' with rollout.window.overlong="
                              f"truncate (a cut history is no longer one sequence), got "
                              f"{a.sample_unit!r}")


def env_specs(run: RunConfig) -> tuple[MixEntry, ...]:
    """Every env of the run in order, as ``MixEntry``s with ``val_groups`` resolved: the
    ``env.mix`` entries (``val_groups=None``: ``rollout.val.env_groups`` split in proportion
    to ``groups``, largest remainders first, ties to the earlier entry); without a mix, the
    one env (all ``rollout.env_groups`` and ``rollout.val.env_groups``) and then each
    ``env.val_extra`` env (validation only, ``rollout.val.env_groups`` groups each). Tags may be
    "" (the env class name, known once the env is built)."""
    r, env = run.rollout, run.env
    if not env.mix:
        main = MixEntry(name=env.name, params=env.params, tag=env.tag, groups=r.env_groups,
                        val_groups=r.val.env_groups)
        return (main, *(MixEntry(name=env.name, params={**env.params, **dict(extra)}, tag=tag,
                                 groups=0, val_groups=r.val.env_groups)
                        for tag, extra in env.val_extra.items()))
    if env.mix[0].val_groups is not None:
        return env.mix
    val = r.val.env_groups
    exact = [val * e.groups / r.env_groups for e in env.mix]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])[:val - sum(shares)]:
        shares[i] += 1
    return tuple(dataclasses.replace(e, val_groups=n) for e, n in zip(env.mix, shares, strict=True))


