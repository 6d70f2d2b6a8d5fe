"""The Hugging Face side of the model's names: a ``config.json`` dict <-> ``QwenConfig``, and
an NNX variable path <-> its checkpoint keys. ``weights.py`` reads and writes the folders
with these.

Parameters keep the Hugging Face names and layouts (see ``qwen.py``); the decoder layers are
stacked, so the safetensors key ``model.layers.3.mlp.up_proj.weight`` is row 3 of the NNX
variable ``("model", "layers", "mlp", "up_proj", "weight")`` ``[L, F, E]``, and every other key
is its NNX path joined by dots.
"""

from __future__ import annotations

import jax.numpy as jnp

from ragen_jax.models.qwen_config import MODEL_TYPES, QwenConfig

# Keys some hub checkpoints carry that the model does not need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _path_key(path) -> str:
    return ".".join(str(p) for p in path)


def is_stacked(path) -> bool:
    """Whether an NNX variable path is one of the stacked decoder layers' ``[L, ...]``."""
    return tuple(path[:2]) == ("model", "layers")


def checkpoint_keys(path, num_layers: int) -> list[str]:
    """The checkpoint keys of one NNX variable: one per layer for the stacked decoder layers
    (``model.layers.<i>.<rest>``), else its dotted path."""
    if is_stacked(path):
        rest = _path_key(path[2:])
        return [f"model.layers.{i}.{rest}" for i in range(num_layers)]
    return [_path_key(path)]


def config_from_hf(d: dict, *, dtype=jnp.float32, param_dtype=None, **options) -> QwenConfig:
    """Builds a config from the dict of a Hugging Face ``config.json`` of a Qwen2/Qwen2.5,
    Llama (SmolLM2, Llama 3.x) or Qwen3 (dense) model (``MODEL_TYPES``).

    Reads ``rope_theta`` from the top level (hub folders) or from the ``rope_parameters``
    dict that transformers 5 writes, and Llama 3's ``llama3`` rope scaling. Raises
    ``ValueError`` for features this port does not implement (sliding-window attention,
    other rope scalings, activations other than SiLU). ``dtype`` is the compute dtype,
    ``param_dtype`` the storage dtype (default: ``dtype``); ``options`` sets the fields
    that are not in the checkpoint (``remat``, ``scan_layers``, ...).
    """
    model_type = d.get("model_type", "qwen2")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    llama3 = None
    if rope_type == "llama3" and model_type == "llama":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise ValueError(f"unsupported rope_type {rope_type!r} for {model_type} "
                         "(only 'default' rope, and 'llama3' for llama)")
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    if d.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true (sliding-window attention) is not supported")
    act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    if d.get("pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp={d['pretraining_tp']} is not supported (only 1)")
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return QwenConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"),
        rope_theta=float(theta),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        initializer_range=d.get("initializer_range", 0.02),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
        model_type=model_type,
        attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
        mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
        rope_llama3=llama3,
        param_dtype=dtype if param_dtype is None else param_dtype,
        dtype=dtype,
        **options,
    )


def config_to_hf(config: QwenConfig) -> dict:
    """The ``config.json`` dict that ``transformers`` reads back as ``config``'s architecture."""
    rope = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_llama3 is not None:
        factor, low, high, old_len = config.rope_llama3
        rope.update(rope_type="llama3", factor=factor, low_freq_factor=low,
                    high_freq_factor=high, original_max_position_embeddings=old_len)
    d = {
        "architectures": [MODEL_TYPES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "dtype": jnp.dtype(config.param_dtype).name,
        "torch_dtype": jnp.dtype(config.param_dtype).name,  # the name older readers use
    }
    if config.model_type == "llama":
        d.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, pretraining_tp=1)
    else:
        d.update(use_sliding_window=False, sliding_window=None,
                 max_window_layers=config.num_hidden_layers)
    if config.model_type == "qwen3":
        d.update(attention_bias=config.attention_bias)
    return d
