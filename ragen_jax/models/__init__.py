"""Qwen2 policy model: the NNX port, Hugging Face weights both ways, tokenizers.

The names below are imported on first use (PEP 562), so that the modules that need no JAX
(``gguf``, ``gguf_tokenizer``, ``tokenizer``, ``hf_folder``) import without it: the GGUF
converter runs, and its tokenizer test runs in a side environment holding only transformers
(``.ci/run``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragen_jax.models.copies import compute_copy
    from ragen_jax.models.hf_folder import CheckpointError
    from ragen_jax.models.kv_cache import KVCache, positions_from_mask
    from ragen_jax.models.placement import shard_model
    from ragen_jax.models.qwen import Qwen2ForCausalLM, Qwen2ForValue, QwenConfig
    from ragen_jax.models.weights import (
        from_pretrained,
        load_config,
        save_pretrained,
    )

# name -> the submodule that defines it
_EXPORTS = {
    "CheckpointError": "weights",
    "KVCache": "kv_cache",
    "Qwen2ForCausalLM": "qwen",
    "Qwen2ForValue": "qwen",
    "QwenConfig": "qwen",
    "compute_copy": "copies",
    "from_pretrained": "weights",
    "load_config": "weights",
    "positions_from_mask": "kv_cache",
    "save_pretrained": "weights",
    "shard_model": "placement",
}

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


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # once
        return value
    try:  # a submodule used as an attribute (``ragen_jax.models.qwen``) before its import
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
