"""Every default of a ragen_jax training run, one line of comment each.

RAGEN's values (``../shared/reference/RAGEN_FACTS.md`` §6 and §8: its ``config/base.yaml``
with veRL v0.6.1 defaults) are the defaults where they apply; the ``tiny`` preset changes
what a laptop CPU needs (``apply_preset``). An env file (``configs/sokoban.py``, ...) calls
``get_config(preset)`` and overrides its own part. Presets: ``tiny`` (default; random tiny
Qwen2 and the built-in tokenizer, no download), ``qwen2.5-0.5b``, ``qwen2.5-1.5b``,
``qwen2.5-3b`` (need ``--config.model.path`` to a local Hugging Face folder).
Algorithms by override: ``--config.algorithm.adv_estimator=gae`` (PPO, with critic),
``grpo``, ``drgrpo`` (GRPO without std normalisation, ``seq-mean-token-sum``); StarPO-S /
SNR filtering with ``--config.filter.strategy=top_p --config.filter.value=0.9`` etc.
"""

from __future__ import annotations

from ml_collections import ConfigDict

PRESETS = ("tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")


def get_config(preset: str = "tiny") -> ConfigDict:
    c = ConfigDict()
    c.preset = preset  # which preset built this config (informational)
    c.seed = 0  # one seed drives init, env seeds' noise, sampling and batch padding

    c.model = ConfigDict()
    c.model.path = ""  # local Hugging Face Qwen2/Qwen2.5 folder; "" = tiny random model
    c.model.dtype = "float32"  # parameter and compute dtype: float32 | bfloat16
    c.model.hidden_size = 256  # tiny model only: width
    c.model.num_hidden_layers = 4  # tiny model only: depth
    c.model.intermediate_size = 768  # tiny model only: MLP width
    c.model.num_attention_heads = 4  # tiny model only: query heads
    c.model.num_key_value_heads = 2  # tiny model only: KV heads (GQA)
    c.model.lora_rank = 0  # LoRA rank, 0 = full fine-tuning (RAGEN: 0)
    c.model.lora_alpha = 64.0  # LoRA alpha (RAGEN: 64)

    c.env = ConfigDict()
    c.env.name = "sokoban"  # registered env name (ragen_jax.envs.make)
    c.env.params = ConfigDict()  # env constructor / EnvParams fields, e.g. dim_room, num_boxes
    c.env.tag = ""  # metric tag; "" = the env class name (RAGEN's tag, e.g. "Sokoban")
    c.env.val_extra = ConfigDict()  # extra validation envs: {tag: {param overrides}}

    c.rollout = ConfigDict()
    c.rollout.env_groups = 8  # groups per training step (RAGEN: 8)
    c.rollout.group_size = 16  # envs per group, sharing an initial state (RAGEN: 16)
    c.rollout.max_turn = 5  # LLM calls per episode (RAGEN: 5)
    c.rollout.max_actions_per_traj = 10  # env actions per episode (RAGEN: 10)
    c.rollout.max_actions_per_turn = 2  # env actions parsed per answer (RAGEN: 2)
    c.rollout.response_length = 400  # max new tokens per turn (RAGEN: 400)
    c.rollout.max_model_len = 3600  # max tokens of a trajectory (RAGEN: 3600)
    c.rollout.temperature = 1.0  # training sampling temperature (RAGEN: 1)
    c.rollout.top_p = 1.0  # training nucleus (RAGEN: 1)
    c.rollout.top_k = 0  # training top-k, 0 = off (RAGEN: -1)
    c.rollout.enable_think = True  # <think>..</think><answer>..</answer>; False: answer only
    c.rollout.format_penalty = -0.1  # added once to a turn with a format error (RAGEN: -0.1)
    c.rollout.turn_template = ""  # per-turn user text ({turn} {state} {warning} {actions_left} {format} {max_tokens}); "" = RAGEN's
    c.rollout.use_turn_scores = False  # each turn's score on its last token (bi-level GAE)
    c.rollout.train_seed = 10000  # first training group seed (RAGEN: 10000)
    c.rollout.val_seed = 123  # first validation group seed (RAGEN: 123)
    c.rollout.val_groups = 256  # validation envs (RAGEN: 512 x 1; V1: 256)
    c.rollout.val_group_size = 1  # validation group size (RAGEN: 1)
    c.rollout.val_temperature = 0.5  # validation sampling temperature (RAGEN: 0.5)
    c.rollout.pad_multiple = 64  # batch length is rounded up to this (bounds recompiles)

    c.algorithm = ConfigDict()
    c.algorithm.adv_estimator = "gae"  # gae (PPO, critic) | grpo | drgrpo | rloo (RAGEN: gae)
    c.algorithm.gamma = 1.0  # GAE discount (RAGEN: 1)
    c.algorithm.lam = 1.0  # GAE lambda (RAGEN: 1)
    c.algorithm.bi_level_gae = False  # RAGEN's turn-then-token GAE (uses turn scores)
    c.algorithm.high_level_gamma = 0.95  # bi-level GAE turn discount (RAGEN: 0.95)
    c.algorithm.norm_adv_by_std = True  # GRPO: divide by the group std (RAGEN: True)
    c.algorithm.loss_agg_mode = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    c.algorithm.clip_low = 0.2  # PPO ratio clip below (RAGEN: 0.2)
    c.algorithm.clip_high = 0.28  # PPO ratio clip above, clip-higher (RAGEN: 0.28)
    c.algorithm.clip_c = 3.0  # dual clip for negative advantages (RAGEN: 3)
    c.algorithm.entropy_coeff = 0.001  # entropy bonus (RAGEN: 0.001)
    c.algorithm.kl_coef = 0.0  # KL-to-reference loss weight (RAGEN: 0, off)
    c.algorithm.kl_estimator = "k1"  # k1 | k3 | mse (RAGEN: kl = k1)

    c.filter = ConfigDict()
    c.filter.strategy = "top_p"  # top_p | top_k | top_k_abs | min_p (RAGEN: top_p)
    c.filter.value = 1.0  # 1.0 keeps every group (RAGEN base); StarPO-S V1: top_k 0.25
    c.filter.filter_type = "largest"  # keep the largest | smallest scores
    c.filter.metric = "reward_variance"  # reward_variance | reward | reward_sum | length
    c.filter.include_zero = True  # keep groups whose metric is zero (RAGEN: True)
    c.filter.top_p_prob_mode = "linear"  # linear | softmax (RAGEN: linear)
    c.filter.loss_scaling = "none"  # none | linear | sqrt: scale kept samples by kept ratio

    c.actor = ConfigDict()
    c.actor.lr = 1e-6  # AdamW learning rate (RAGEN: 1e-6)
    c.actor.lr_schedule = "constant"  # constant | cosine (RAGEN: constant)
    c.actor.warmup_steps = 0  # optimizer warmup steps (RAGEN: 0)
    c.actor.weight_decay = 0.01  # AdamW weight decay (RAGEN: 0.01)
    c.actor.grad_clip = 1.0  # global-norm clip (RAGEN: 1)
    c.actor.ppo_mini_batch_size = 32  # trajectories per optimizer step (RAGEN: 32)
    c.actor.ppo_epochs = 1  # passes over a batch (RAGEN: 1)
    c.actor.micro_batches = 1  # gradient-accumulation chunks per mini-batch (memory only)
    c.actor.recompute_logprobs = True  # old log-probs from a forward pass (RAGEN) vs sampler's

    c.critic = ConfigDict()
    c.critic.lr = 1e-5  # critic AdamW learning rate (RAGEN: 1e-5)
    c.critic.value_clip = 0.5  # clipped value loss range (RAGEN: 0.5)
    c.critic.grad_clip = 1.0  # critic global-norm clip (RAGEN: 1)
    c.critic.warmup = 0  # steps that train only the critic (RAGEN: critic_warmup 0)

    c.warmstart = ConfigDict()
    c.warmstart.steps = 0  # format-only SFT steps before RL (tiny preset: > 0)
    c.warmstart.batch_size = 16  # trajectories per warm-start step
    c.warmstart.lr = 1e-3  # warm-start learning rate
    c.warmstart.episodes = 256  # random-valid-action episodes generated for it
    c.warmstart.legal_actions = False  # draw only state-changing actions (no walking into walls)

    c.sft = ConfigDict()
    c.sft.data = ""  # JSONL of chat trajectories ({"messages": [...]}) for an SFT stage
    c.sft.steps = 0  # SFT optimizer steps (0 = off)
    c.sft.batch_size = 8  # conversations per SFT step
    c.sft.lr = 1e-5  # SFT learning rate

    c.diagnostics = ConfigDict()
    c.diagnostics.compute_freq = 5  # collapse diagnostics every k steps, 0 = off (RAGEN: 5)
    c.diagnostics.num_samples = 64  # first-turn pairs: episodes scored under every group's prompt (RAGEN: 64)
    c.diagnostics.trajectory_samples = 64  # trajectory-uniform pairs, each its own input; 0 = off (RAGEN: 64)
    c.diagnostics.micro_batch_size = 128  # rows per cross-scoring forward pass (RAGEN: 128)
    c.diagnostics.ema = 0.9  # EMA decay of the MI z-score (one EMA per pair kind)
    c.diagnostics.gradient_analysis = False  # per-component grad norms by reward-std bucket, every compute_freq steps (costly)
    c.diagnostics.gradient_buckets = 3  # reward-std buckets of groups for it (RAGEN: 4-6)

    c.trainer = ConfigDict()
    c.trainer.output_dir = ""  # run folder; "" = runs/<env>-<preset>
    c.trainer.total_steps = 200  # training steps (RAGEN: 200)
    c.trainer.test_freq = 10  # validate every k steps (RAGEN: 10)
    c.trainer.val_before_train = True  # validate at step 0 (RAGEN: True)
    c.trainer.save_freq = 100  # checkpoint every k steps (RAGEN: 100)
    c.trainer.keep_checkpoints = 3  # checkpoints kept (the last k)
    c.trainer.save_trajectories = True  # write validation trajectories (JSONL + HTML viewer)
    c.trainer.progress = True  # console progress bar
    c.trainer.stop_reward_std_collapse = False  # RAGEN: 10 steps of in-group std < 0.1 x early mean
    c.trainer.stop_empty_after_filter = 5  # stop after k consecutive empty batches (0 = never)
    c.trainer.stop_val_success_collapse = False  # RAGEN: val success < 0.01 five times running

    c.mesh = ConfigDict()
    c.mesh.data = -1  # data-parallel axis (-1 = every remaining device)
    c.mesh.fsdp = 1  # parameter-sharding axis
    c.mesh.tensor = 1  # tensor-parallel axis

    c.distributed = ConfigDict()
    c.distributed.coordinator_address = ""  # "host:port" of process 0; "auto" (TPU pod, SLURM); "" = one process
    c.distributed.num_processes = 1  # processes in the job
    c.distributed.process_id = 0  # this process's index
    c.distributed.initialization_timeout_s = 300  # give up if the job has not assembled by then
    c.distributed.heartbeat_timeout_s = 100  # a silent (dead) process ends the others after this

    apply_preset(c, preset)
    return c


def apply_preset(c: ConfigDict, preset: str) -> None:
    """Model-size presets; an env file adds its own tiny-preset choices after this."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    c.preset = preset
    if preset != "tiny":
        c.model.dtype = "bfloat16"
        return
    # A laptop CPU: a random 4-layer width-128 Qwen2 learns the answer format from a short
    # warm-start, then RL. Measured on 2 cores (experiments/learning_curves.py): Adam's
    # first steps are sign-like, so lr above ~3e-4 scrambles the warm-started policy; one
    # optimizer step per 64-episode batch; Dr.GRPO (no std division) because with the
    # bandit's rare payoffs GRPO's std division blows up groups that differ by 0.1 only.
    c.model.hidden_size = 128
    c.model.intermediate_size = 384
    c.rollout.enable_think = False  # a random model has no reasoning to show
    # A random model cannot read the per-turn format reminder (~35 tokens a turn): drop it,
    # which shortens FrozenLake trajectories by a fifth, ~800 -> ~650 tokens (the system prompt keeps RAGEN's
    # instructions; the env text and the action budget line are unchanged).
    c.rollout.turn_template = "\nTurn {turn}:\nState:\n{state}\n{warning}You have {actions_left} actions left.\n"
    c.rollout.response_length = 16  # a formatted answer is ~8 tokens
    c.rollout.max_model_len = 1024
    c.rollout.env_groups = 8
    c.rollout.group_size = 8
    c.rollout.val_groups = 256
    c.algorithm.adv_estimator = "drgrpo"
    c.actor.lr = 3e-4
    c.actor.weight_decay = 0.0
    c.actor.ppo_mini_batch_size = 64
    c.actor.micro_batches = 4  # bounds memory: [64, 1024] in one pass took ~10 GB
    c.actor.recompute_logprobs = False  # same model and numerics as the sampler: skip a pass
    c.critic.lr = 1e-4
    c.warmstart.steps = 120
    c.warmstart.lr = 2e-3
    c.diagnostics.compute_freq = 10
    c.diagnostics.num_samples = 32
    c.diagnostics.trajectory_samples = 32
    c.trainer.total_steps = 200
    c.trainer.test_freq = 10
    c.trainer.save_freq = 10
