"""Qwen2 policy model: the NNX port, Hugging Face weights both ways, tokenizers."""

from ragen_jax.models.copies import compute_copy
from ragen_jax.models.kv_cache import KVCache, positions_from_mask
from ragen_jax.models.placement import shard_model
from ragen_jax.models.qwen import Qwen2ForCausalLM, Qwen2ForValue, QwenConfig
from ragen_jax.models.weights import (
    CheckpointError,
    from_pretrained,
    load_config,
    save_pretrained,
)

__all__ = [
    "CheckpointError",
    "KVCache",
    "Qwen2ForCausalLM",
    "Qwen2ForValue",
    "QwenConfig",
    "compute_copy",
    "from_pretrained",
    "load_config",
    "positions_from_mask",
    "save_pretrained",
    "shard_model",
]
