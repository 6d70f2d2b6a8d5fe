"""A run's models and ``TrainState``, built from its config; a trained policy from a checkpoint.

* ``build_actor(model_config, seed, mesh)``: the policy network, a Hugging Face folder or the
  tiny random model, with LoRA adapters when ``model.lora_rank > 0``; ``load_tokenizer`` and
  ``stop_ids``: the folder's tokenizer and end-of-sequence ids.
* ``build_state(settings, actor, seed)``: splits the actor (and the critic made from it, if
  the run has that role) into ``Networks`` (what is never trained) and the step-0
  ``TrainState``, placed where the actor's parameters are.
* ``load_policy(run_dir, step)``: the actor of a run's checkpoint, for export and
  evaluation: restores only the actor's arrays, into the shapes of an abstract model
  (``nnx.eval_shape``), without envs, samplers or optimizers.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from ragen_jax.checkpoint import CheckpointStore
from ragen_jax.config.loading import from_config_dict, load_run_config
from ragen_jax.config.schema import DTYPES, ModelConfig, RunConfig, compute_dtype
from ragen_jax.models import (
    CheckpointError,
    Qwen2ForCausalLM,
    Qwen2ForValue,
    QwenConfig,
    from_pretrained,
    hf_folder,
)
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.models.lora import add_lora
from ragen_jax.models.placement import shard_model
from ragen_jax.models.weights import load_config as load_model_config
from ragen_jax.models.weights import tensor_files
from ragen_jax.starpo.update import Networks, StepSettings, TrainState, init_state


def _numerics(model: ModelConfig) -> dict[str, Any]:
    """The ``QwenConfig`` fields the run config decides (dtypes, ``auto`` resolved for this
    backend by ``compute_dtype``; remat, scan, attention)."""
    return dict(dtype=DTYPES[compute_dtype(model)[0]], param_dtype=DTYPES[model.param_dtype],
                remat=model.remat, scan_layers=model.scan_layers,
                attention_impl=model.attention_impl)


def tiny_config(model: ModelConfig) -> QwenConfig:
    """The architecture of the tiny random model (``model.path == ""``)."""
    return QwenConfig.tiny(hidden_size=model.hidden_size, num_hidden_layers=model.num_hidden_layers,
                           intermediate_size=model.intermediate_size,
                           num_attention_heads=model.num_attention_heads,
                           num_key_value_heads=model.num_key_value_heads,
                           head_dim=model.hidden_size // model.num_attention_heads,
                           **_numerics(model))


def build_actor(model: ModelConfig, seed: int, mesh: Mesh | None = None, *,
                abstract: bool = False, weights: bool = True) -> Qwen2ForCausalLM:
    """The policy network (see the module docstring), its weights stored in
    ``model.param_dtype`` (the trainer's master copy; sample with ``compute_copy``).
    ``abstract``: shapes only, no weights read or initialised; ``weights=False``: random
    weights in the folder's architecture (a checkpoint will replace them). A LoRA actor
    always reads its base weights, which its checkpoints do not hold."""
    abstract = abstract and not model.lora_rank
    weights = weights or bool(model.lora_rank)
    if model.path and hf_folder.is_snapshot(model.path) and weights and not abstract:
        raise CheckpointError(
            f"model.path={model.path} is a run folder's copy of the model folder, without "
            "weights; give --config.model.path=<the Hugging Face folder with the weights>"
            + (" (a LoRA run's checkpoints hold only the adapters)" if model.lora_rank else ""))
    if model.path and weights and not abstract:
        actor = from_pretrained(model.path, mesh=mesh, **_numerics(model))
    else:
        config = load_model_config(model.path, **_numerics(model)) if model.path else tiny_config(model)
        def make() -> Qwen2ForCausalLM:
            return Qwen2ForCausalLM(config, rngs=nnx.Rngs(seed))

        actor = nnx.eval_shape(make) if abstract else make()
        if mesh is not None and not abstract:
            actor = shard_model(actor, mesh)
    if model.lora_rank:
        add_lora(actor, model.lora_rank, model.lora_alpha, seed=seed)
    return actor


def load_tokenizer(model: ModelConfig) -> Any:
    """The model folder's tokenizer, or the built-in one for the tiny model. A tokenizer
    with more tokens than the model has embedding rows is a ``CheckpointError`` (its extra
    ids would index past the table: usually the tokenizer of another model)."""
    tok = tokenizers.load(model.path or None)
    if model.path:
        rows = load_model_config(model.path).vocab_size
        if len(tok) > rows:
            raise CheckpointError(f"{model.path}: the tokenizer has {len(tok)} tokens but the "
                                  f"model's embedding only {rows} rows (config.json vocab_size)")
    return tok


def check_model_folder(model: ModelConfig) -> None:
    """Checks a folder run's inputs before anything heavy starts: ``config.json`` (a supported
    architecture), the safetensors headers (a truncated file or a bad header fails here),
    the tokenizer (loadable, no larger than the embedding) and ``generation_config.json``
    (its stop ids); raises ``CheckpointError`` with one line naming the file."""
    if model.path:
        load_model_config(model.path)
        if not hf_folder.is_snapshot(model.path):
            tensor_files(Path(model.path))
        load_tokenizer(model)
        hf_folder.eos_ids(model.path)  # read again when the rollout is built, after the weights


def stop_ids(model: ModelConfig) -> tuple[int, ...]:
    """The end-of-sequence ids the model folder declares (``generation_config.json`` and
    ``config.json``), which end a turn besides the chat template's end-of-turn token; none
    for the tiny model."""
    return hf_folder.eos_ids(model.path) if model.path else ()


def trained(model: ModelConfig) -> Any:
    """The NNX filter of the actor's trained variables: the adapters under LoRA, else all."""
    return nnx.LoRAParam if model.lora_rank else nnx.Param


def build_state(settings: StepSettings, actor: Qwen2ForCausalLM, model: ModelConfig,
                seed: int) -> tuple[Networks, TrainState]:
    """``(networks, step-0 state)`` of ``actor`` (and of a critic built from it when
    ``settings.critic`` is set: its backbone copied, RAGEN's initialisation)."""
    graphdef, actor_vars, actor_rest = nnx.split(actor, trained(model), ...)
    networks = Networks(graphdef, actor_rest)
    critic_vars = None
    if settings.critic is not None:
        critic = Qwen2ForValue.from_actor(actor, seed=seed + 1)
        critic_graph, critic_vars, critic_rest = nnx.split(critic, nnx.Param, ...)
        networks = Networks(graphdef, actor_rest, critic_graph, critic_rest)
    state = _jitted_init_state(settings)(actor_vars, critic_vars)
    return networks, state


@functools.lru_cache(maxsize=16)
def _jitted_init_state(settings: StepSettings) -> Any:
    """``init_state`` for ``settings``, jitted once per process (one program, not op by op)."""
    return jax.jit(functools.partial(init_state, settings))


def load_policy(run_dir: str | Path, step: int | None = None, overrides: Any = None
                ) -> tuple[Qwen2ForCausalLM, Any, RunConfig, int]:
    """``(actor, tokenizer, run config, step)`` of a run's checkpoint (default: the last).
    ``overrides`` is the run's config as a ConfigDict with changes (e.g. a moved
    ``model.path``); default: the saved one."""
    run = from_config_dict(overrides if overrides is not None else load_run_config(run_dir))
    tokenizer = load_tokenizer(run.model)  # first: it checks the folder against the config
    store = CheckpointStore(Path(run_dir) / "checkpoints")
    try:
        steps = store.all_steps()
        if not steps:
            raise FileNotFoundError(f"--checkpoint: no checkpoint under {store.path}")
        step = max(steps) if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"--checkpoint: no step {step} under {store.path} (have {steps})")
        actor = build_actor(run.model, run.seed, abstract=True)
        graphdef, abstract, rest = nnx.split(actor, trained(run.model), ...)
        device = SingleDeviceSharding(jax.devices()[0])
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
        items, _ = store.restore(step, {"actor": like})
        actor = nnx.merge(graphdef, items["actor"], rest)
    finally:
        store.close()
    return actor, tokenizer, run, step
