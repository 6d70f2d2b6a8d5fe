"""The decoder's hyper-parameters (``QwenConfig``): the fields of a Hugging Face
``config.json`` for the three families ``qwen.py`` implements, the options that shape its calls
(attention, layer loop, rematerialisation), and presets. ``hf_convert.py`` translates
``config.json`` both ways.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ragen_jax.models.attention import ATTENTION_IMPLS, fused_implementation, is_half

# The Hugging Face families this decoder implements: model_type -> architecture class name.
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# What a decoder layer saves for the backward pass under each ``QwenConfig.remat``; None: no
# rematerialisation at all.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture hyper-parameters, named as in a Hugging Face ``config.json``.

    One decoder covers three families, told apart by ``model_type`` and the few switches that
    differ between them (everything else, the names and layouts of the weights included, is
    shared):

    ============  ==================  ==============================  ====================
    model_type    q/k/v bias          per-head q/k RMSNorm            rope
    ============  ==================  ==============================  ====================
    ``qwen2``     yes                 no                              default
    ``llama``     ``attention_bias``  no                              default or ``llama3``
    ``qwen3``     ``attention_bias``  yes (``q_norm``, ``k_norm``)    default
    ============  ==================  ==============================  ====================

    ``param_dtype`` is the storage dtype of the weights, ``dtype`` the compute dtype of the
    activations (matmuls); norms, softmax and logits are always computed in float32.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "qwen2"  # "qwen2" | "llama" | "qwen3": MODEL_TYPES
    attention_bias: bool | None = None  # biases on q/k/v (and o for llama and qwen3); None: the family's
    mlp_bias: bool = False  # llama's biases on gate/up/down
    # llama3 rope scaling (Llama 3.1+): (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None: plain rope.
    rope_llama3: tuple[float, float, float, int] | None = None
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    # Not a checkpoint field: calls with a KV cache (sampling, scoring on a cached prefix)
    # compute attention over blocks of batch rows whose float32 scores take at most this many
    # bytes per device, so a block stays in the CPU's cache (prefill attention ~3x faster on
    # 2 cores). None: 4 MiB on CPU, 1 GiB on accelerators (a bound on memory there: 64
    # scored 2.5k-token contexts of the 0.5B shape would otherwise ask for 27 GiB of scores
    # at once); 0: never block. Calls without a cache (training) never block: under autodiff
    # the blocks cost 5-16% on CPU.
    attention_block_bytes: int | None = None
    # Not checkpoint fields either; they shape calls without a cache (training, scoring).
    # scan_layers: run the layers as a rolled `lax.scan` over their stacked weights, so compile
    # time does not grow with depth (False: the same scan fully unrolled, which XLA may
    # schedule better on a CPU at the cost of compile time). remat: what a layer keeps for the backward pass
    # (REMAT_POLICIES): "none" everything, "full" only its input, "dots" also the outputs of
    # its weight matmuls (the attention's batched products are recomputed).
    scan_layers: bool = True
    remat: str = "none"
    # attention_impl: how calls without a cache (and without a shared prefix) compute
    # attention, one of ATTENTION_IMPLS; calls with a cache always use ``attend``.
    attention_impl: str = "xla"

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {tuple(MODEL_TYPES)}, got {self.model_type!r}")
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", self.model_type == "qwen2")
        if self.rope_llama3 is not None and self.model_type != "llama":
            raise ValueError("llama3 rope scaling is a llama model's (model_type 'llama')")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        if self.attention_impl == "cudnn" and not is_half(self.dtype):
            raise ValueError("attention_impl 'cudnn' needs a bfloat16 or float16 compute dtype, "
                             f"got {jnp.dtype(self.dtype).name}")

    def replace(self, **kw) -> QwenConfig:
        return dataclasses.replace(self, **kw)

    def fused_attention(self) -> str | None:
        """The ``jax.nn.dot_product_attention`` implementation that calls without a cache use,
        or None for ``attend``'s materialised scores (``attention.fused_implementation``)."""
        return fused_implementation(self.attention_impl, self.head_dim, self.dtype)

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head before rope (Qwen3)."""
        return self.model_type == "qwen3"

    @property
    def o_bias(self) -> bool:
        """Whether ``o_proj`` has a bias: ``attention_bias`` covers it in Llama and Qwen3,
        while Qwen2 has q/k/v biases but none on ``o_proj``."""
        return self.model_type != "qwen2" and bool(self.attention_bias)

    def rope_inv_freq(self) -> jax.Array:
        """Rotary inverse frequencies [D/2] float32, as transformers computes them: the
        default ``theta ** -(2i / D)``, or Llama 3's scaled version (long wavelengths divided
        by ``factor``, short ones kept, a smooth blend between)."""
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        if self.rope_llama3 is None:
            return inv_freq
        factor, low, high, old_len = self.rope_llama3
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return jnp.where(medium, smoothed, scaled)


    # -- presets ---------------------------------------------------------------------------------

    @classmethod
    def tiny(cls, vocab_size: int | None = None, **kw) -> QwenConfig:
        """The CPU preset: 4 layers, width 256, GQA 4:2, tied embeddings.

        Its vocabulary is the built-in tokenizer's (``tokenizer.TINY_VOCAB_SIZE``).
        """
        if vocab_size is None:
            from ragen_jax.models.tokenizer import TINY_VOCAB_SIZE

            vocab_size = TINY_VOCAB_SIZE
        base = dict(
            vocab_size=vocab_size,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def qwen2_5_0_5b(cls, **kw) -> QwenConfig:
        """Shapes of Qwen2.5-0.5B(-Instruct) (for random-weight benchmarks)."""
        base = dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            bos_token_id=151643,
            eos_token_id=151645,
        )
        base.update(kw)
        return cls(**base)
