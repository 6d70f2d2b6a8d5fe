"""The Qwen2 / Qwen2.5 decoder in Flax NNX, in one file; with a few switches of its config
(``QwenConfig.model_type``) also Llama (SmolLM2, Llama 3.x) and dense Qwen3, which share its
structure and its checkpoints' names.

Module and parameter names follow the Hugging Face checkpoint exactly, and every weight keeps the
Hugging Face layout (``nn.Linear`` weights are ``[out, in]``). The decoder layers are stored
stacked, as MaxText does: one ``Qwen2DecoderLayer`` whose every variable has a leading layer
axis ``L``, so the checkpoint key ``model.layers.3.self_attn.q_proj.weight`` is row 3 of the
NNX variable ``("model", "layers", "self_attn", "q_proj", "weight")`` of shape ``[L, out, in]``
(``weights.py`` stacks and unstacks). The layers then run as one loop over that axis
(``lax.scan`` for training, ``lax.fori_loop`` with a cache), so compile time and the
optimizer's program do not grow with depth. The sampler decodes from ``compute_copy(model)``
(``copies.py``), whose layers are separate modules again (``per_layer``) with a per-layer KV cache: XLA:CPU
copies a layer's weights out of the stacked variable before each matmul of the loop, which
made batch-1 decoding of the 0.5B shape 2.2x slower; as separate arrays they are read in place.

Shapes in comments use: B batch, T new tokens in this call, S key/value slots (T without a
cache, the cache size with one), E hidden size, H query heads, K key/value heads, G = H // K,
D head dim, F MLP width, V vocabulary.

Attention-mask semantics (shared by the sampler, the rollout code and the trainer):

* ``attention_mask[B, T]`` marks which of the ``T`` input tokens are real (1) and which are
  padding (0). A token attends to every *real* token at or before its own slot; padding tokens
  are never attended to. Padding may sit anywhere (left, right, or in the middle of a sequence).
* ``positions[B, T]`` are the rotary positions; they must count real tokens only
  (``positions_from_mask``). Positions of padding tokens do not matter.
* With a ``KVCache``, the ``T`` new tokens are written to slots ``[cache.index, cache.index+T)``
  for every sequence of the batch (one shared slot index), and their validity goes into
  ``cache.valid``. So a trajectory is one slot sequence, padding included, and a full forward
  pass over that slot sequence with ``attention_mask = cache.valid`` and the same positions
  reproduces, up to float error, every logit the incremental calls produced. That is what lets
  the trainer recompute the sampler's log-probs exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.kv_cache import KVCache

# Large negative (not -inf) for masked attention scores, so a query with no visible key (a
# padding token before any real token) gets a finite, ignored output instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# What a decoder layer saves for the backward pass under each ``QwenConfig.remat``; None: no
# rematerialisation at all.
# The Hugging Face families this decoder implements: model_type -> architecture class name.
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# How calls without a cache (training, scoring) compute attention (``QwenConfig.attention_impl``):
# "xla": ``attend``, the float32 scores materialised (the only path on a CPU, and the default);
# "cudnn": cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation=
# "cudnn")``, bf16/fp16 compute only) on rows whose real tokens are first moved to the front
# (``attend_compacted``); "auto": "cudnn" on a CUDA GPU with a bf16/fp16 compute dtype, else
# "xla"; "dpa_xla": the cudnn path's plumbing with JAX's own XLA implementation in place of
# cuDNN's kernel (a check of it that runs anywhere, not a faster path).
ATTENTION_IMPLS = ("xla", "cudnn", "auto", "dpa_xla")
# The fused path pads its sequences to a multiple of this: cuDNN's flash attention refuses odd
# lengths when it trains with a mask (per-row lengths are one), and whole 64-token tiles are
# its fastest shapes.
FLASH_MULTIPLE = 64
FLASH_HEAD_DIM_MAX = 128  # 256 on Hopper and later; 128 is what every cuDNN GPU takes
_said_fallback: set[str] = set()


def flash_attention_problem(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype) -> str | None:
    """Why cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``,
    BTNH layout, with per-row lengths, in training) would refuse ``q [B, T, H, D]`` and ``k``/``v``
    ``[B, S, K, D]`` of ``dtype``, or None. Our own predicate, written from the conditions of
    jax's ``check_is_flash_attention`` (jax 0.10-0.11), on the safe side where they depend on
    the GPU: a bf16/fp16 dtype; a head dim that is a multiple of 8 and at most 128; even query
    and key lengths (a mask or lengths count as a bias there); query and key heads that divide
    (GQA); the same head dim for keys and values (no MLA)."""
    (_, t, h, d), (_, s, k, dv) = q_shape, kv_shape
    if not _half(dtype):
        return f"dtype {jnp.dtype(dtype).name} (cuDNN's flash attention takes bfloat16 or float16)"
    if d % 8 or d > FLASH_HEAD_DIM_MAX:
        return f"head dim {d} (a multiple of 8, at most {FLASH_HEAD_DIM_MAX})"
    if dv != d:
        return f"value head dim {dv} != query head dim {d}"
    if t % 2 or s % 2:
        return f"sequence lengths Q {t}, KV {s} (even lengths in training with a mask)"
    if h % k:
        return f"{h} query heads over {k} key/value heads"
    return None


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


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
        if self.attention_impl == "cudnn" and not _half(self.dtype):
            raise ValueError("attention_impl 'cudnn' needs a bfloat16 or float16 compute dtype, "
                             f"got {jnp.dtype(self.dtype).name}")

    def replace(self, **kw) -> QwenConfig:
        return dataclasses.replace(self, **kw)

    def fused_attention(self) -> str | None:
        """The ``jax.nn.dot_product_attention`` implementation that calls without a cache use
        (``attention_impl``), or None for ``attend``'s materialised scores. "auto" decides
        here, when a model is traced: cuDNN on a CUDA GPU with a bf16/fp16 compute dtype and a
        head dim its kernels take on any such GPU (a multiple of 8, at most 128)."""
        fits = self.head_dim % 8 == 0 and self.head_dim <= FLASH_HEAD_DIM_MAX
        if self.attention_impl == "auto":
            return "cudnn" if fits and _half(self.dtype) and _cuda() else None
        if self.attention_impl == "cudnn" and not fits:  # lengths are padded; a head dim is not
            note = (f"attention_impl 'cudnn': head dim {self.head_dim} is not one cuDNN's flash "
                    f"attention takes (a multiple of 8, at most {FLASH_HEAD_DIM_MAX}); using xla")
            if note not in _said_fallback:
                _said_fallback.add(note)
                print(note, flush=True)
            return None
        return {"xla": None, "cudnn": "cudnn", "dpa_xla": "xla"}[self.attention_impl]

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

    # -- Hugging Face config.json ---------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict, *, dtype=jnp.float32, param_dtype=None, **options) -> QwenConfig:
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
        return cls(
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

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict that ``transformers`` reads back as this architecture."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_llama3 is not None:
            factor, low, high, old_len = self.rope_llama3
            rope.update(rope_type="llama3", factor=factor, low_freq_factor=low,
                        high_freq_factor=high, original_max_position_embeddings=old_len)
        d = {
            "architectures": [MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": jnp.dtype(self.param_dtype).name,
            "torch_dtype": jnp.dtype(self.param_dtype).name,  # the name older readers use
        }
        if self.model_type == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias, pretraining_tp=1)
        else:
            d.update(use_sliding_window=False, sliding_window=None,
                     max_window_layers=self.num_hidden_layers)
        if self.model_type == "qwen3":
            d.update(attention_bias=self.attention_bias)
        return d

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


def _half(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cuda() -> bool:
    """Whether the default backend is an NVIDIA GPU (cuDNN's attention needs one)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # an unusual client: do not guess
        return False


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


def _param(value, spec) -> nnx.Param:
    # Specs are metadata only; placement happens in `shard_model` / `weights.from_pretrained`.
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


class Linear(nnx.Module):
    """``y = x @ weight.T + bias`` with the Hugging Face ``[out, in]`` weight layout, plus an
    optional LoRA term ``lora_scale * x @ lora_a.T @ lora_b.T``. A ``transposed`` Linear
    stores ``weight`` as ``[in, out]`` and computes the same ``y`` (the CPU decoding layout:
    ``decode_layout``).

    The adapter is off (``lora_a = lora_b = None``) until ``models.lora.add_lora`` sets the two
    ``nnx.LoRAParam`` matrices ``lora_a [r, in]`` and ``lora_b [out, r]`` and ``lora_scale``;
    ``models.lora.merge_lora`` folds them into ``weight`` and turns the adapter off again.
    The adapter slots are declared as NNX data (``nnx.data(None)``), so they may later hold
    Variables; while they are None they add nothing to the model's state, and the base weights
    keep their Hugging Face names.
    """

    def __init__(self, d_in, d_out, *, bias, spec, config: QwenConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(config.initializer_range)
        self.weight = _param(init(rngs.params(), (d_out, d_in), config.param_dtype), spec)
        self.bias = _param(jnp.zeros((d_out,), config.param_dtype), spec[:1]) if bias else None
        self.dtype = config.dtype
        self.lora_a: nnx.LoRAParam | None = nnx.data(None)  # [r, in]
        self.lora_b: nnx.LoRAParam | None = nnx.data(None)  # [out, r]
        self.lora_scale: float = 0.0  # alpha / r
        self.transposed: bool = False  # weight [in, out] instead of [out, in]
        self.out_dtype: Any = None  # the matmul's result type (None: dtype); the LM head: float32

    def __call__(self, x):  # [..., in] -> [..., out]
        x = x.astype(self.dtype)
        out = self.out_dtype
        y = jnp.einsum("...i,io->...o" if self.transposed else "...i,oi->...o", x,
                       self.weight[...].astype(self.dtype), preferred_element_type=out)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        if self.lora_a is not None:
            h = jnp.einsum("...i,ri->...r", x, self.lora_a[...].astype(self.dtype))  # [..., r]
            y = y + self.lora_scale * jnp.einsum("...r,or->...o", h,
                                                 self.lora_b[...].astype(self.dtype),
                                                 preferred_element_type=out)
        return y


class Embedding(nnx.Module):
    """Token embedding table ``weight[V, E]`` (also the tied output head)."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(config.initializer_range)
        shape = (config.vocab_size, config.hidden_size)
        self.weight = _param(init(rngs.params(), shape, config.param_dtype), ("tensor", "fsdp"))
        self.dtype = config.dtype

    def __call__(self, tokens):  # [B, T] -> [B, T, E]
        return jnp.take(self.weight[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x):  # [..., E] -> [..., V] float32
        # The tied output head: bf16 operands accumulate into float32 logits (as veRL's
        # float32 log-probs), never rounded to bf16 on the way.
        return jnp.einsum("...e,ve->...v", x.astype(self.dtype), self.weight[...].astype(self.dtype),
                          preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """Qwen2RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, config: QwenConfig):
        self.weight = _param(jnp.ones((dim,), config.param_dtype), (None,))
        self.eps = config.rms_norm_eps

    def __call__(self, x):  # [..., E]
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dtype) * x32.astype(dtype)


def rope(x, positions, inv_freq):
    """Rotary embedding, Hugging Face "rotate half" layout. x [B, T, N, D], positions [B, T],
    inv_freq [D/2] (``QwenConfig.rope_inv_freq``)."""
    d = x.shape[-1]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class Qwen2Attention(nnx.Module):
    """Grouped-query attention with rotary positions and an optional cache. Qwen2: q/k/v
    bias, no o bias; Llama and Qwen3: biases as ``attention_bias`` says (none in released
    checkpoints); Qwen3: ``q_norm`` / ``k_norm``, RMSNorms over each head's D, before rope."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        kw = dict(config=c, rngs=rngs)
        bias = c.attention_bias
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=bias,
                             spec=("tensor", "fsdp"), **kw)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias,
                             spec=("tensor", "fsdp"), **kw)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias,
                             spec=("tensor", "fsdp"), **kw)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias,
                             spec=("fsdp", "tensor"), **kw)
        self.q_norm = RMSNorm(c.head_dim, c) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c) if c.qk_norm else None

    def __call__(self, x, positions, attn_mask, layer_cache=None, index=None, blocks=1,
                 rows=None, prefix_kv=None, group_prefix=None, token_mask=None):
        """x [B, T, E]; attn_mask [B, T, S] bool (True = may attend).

        Without a cache, S = T and keys are this call's tokens, and the second output is this
        call's keys and values ``(k [B, K, D, T], v [B, K, T, D])`` (``Qwen2Model.prefix``
        keeps them); with ``prefix_kv`` (the same layout over P slots), S = P + T and the
        queries see those slots first (a shared prefix, see ``Qwen2Model.prefix``). With ``layer_cache = (k, v,
        layer)``: ``layer`` None and this layer's cache [B, K, D, S], [B, K, S, D], or the
        stacked cache [L, B, K, D, S], [L, B, K, S, D] and this layer's index; the new
        keys/values are written at slot ``index`` in place, and the updated
        ``(k, v, layer)`` is returned. ``blocks`` > 1 computes attention
        over that many blocks of batch rows, one after the other (see ``attend``). With
        ``rows`` [B], keys and values come from all T tokens but only token ``rows[b]`` of
        each row queries: the output is [B, 1, E]. ``group_prefix = (k [G, K, D, P], v [G, K,
        P, D], mask [G, P])`` (with a per-layer cache, ``KVCache.with_group_prefix``): slots
        every row of a group of B / G consecutive rows sees before its cache's
        (``attend_group_prefix``). ``token_mask [B, T]`` (calls without a cache: ``attn_mask``
        is then ``mask_causal(token_mask)``) lets ``config.fused_attention()`` replace
        ``attend`` by ``attend_compacted`` in a call with neither cache, rows nor prefix.
        """
        c = self.config
        b, t, _ = x.shape
        inv_freq = c.rope_inv_freq()  # [D/2]
        k = self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)  # [B, T, K, D]
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)  # [B, T, K, D]
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = rope(k, positions, inv_freq)  # [B, T, K, D]
        fused = None
        if token_mask is not None and layer_cache is None and rows is None \
                and prefix_kv is None and group_prefix is None:
            fused = c.fused_attention()
        if fused is not None:
            q = self.q_proj(x).reshape(b, t, c.num_attention_heads, c.head_dim)  # [B, T, H, D]
            if self.q_norm is not None:
                q = self.q_norm(q)
            q = rope(q, positions, inv_freq)
            out = attend_compacted(q, k, v, token_mask, fused)  # [B, T, H, D]
            out = out.reshape(b, t, c.num_attention_heads * c.head_dim)
            return self.o_proj(out), (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
        k = k.transpose(0, 2, 3, 1)  # [B, K, D, T]
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        if rows is not None:
            x, positions, attn_mask = (take_rows(a, rows) for a in (x, positions, attn_mask))
            t = 1
        q = self.q_proj(x).reshape(b, t, c.num_attention_heads, c.head_dim)  # [B, T, H, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = rope(q, positions, inv_freq)
        if layer_cache is not None:
            ck, cv, layer = layer_cache
            if layer is None:  # this layer's own cache [B, K, D, S], [B, K, S, D]
                ck = k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, index))
                cv = v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, index, 0))
            else:  # the stacked cache [L, B, K, D, S], [L, B, K, S, D]
                ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype),
                                                  (layer, 0, 0, 0, index))
                cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype),
                                                  (layer, 0, 0, index, 0))
                k = jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False)  # [B, K, D, S]
                v = jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False)  # [B, K, S, D]
            layer_cache = (ck, cv, layer)
        else:
            layer_cache = (k, v)
            if prefix_kv is not None:
                k = jnp.concatenate([prefix_kv[0].astype(k.dtype), k], axis=-1)  # [B, K, D, P + T]
                v = jnp.concatenate([prefix_kv[1].astype(v.dtype), v], axis=-2)  # [B, K, P + T, D]
        groups = c.num_attention_heads // c.num_key_value_heads
        q = q.reshape(b, t, c.num_key_value_heads, groups, c.head_dim)
        q = q.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
        if group_prefix is None:
            out = attend(q, k, v, attn_mask, blocks)  # [B, K, G, T, D]
        else:
            out = attend_group_prefix(q, k, v, attn_mask, *group_prefix, blocks)
        out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, c.num_attention_heads * c.head_dim)
        return self.o_proj(out), layer_cache


def take_rows(a: jax.Array, rows: jax.Array) -> jax.Array:
    """``a[b, rows[b]]`` for every b, keeping a length-1 axis: [B, T, ...] -> [B, 1, ...]."""
    index = rows.astype(jnp.int32).reshape(-1, 1, *([1] * (a.ndim - 2)))
    return jnp.take_along_axis(a, index, axis=1)


def attend(q, k, v, attn_mask, blocks: int = 1):
    """Softmax attention. q [B, K, G, T, D], k [B, K, D, S], v [B, K, S, D], attn_mask
    [B, T, S] -> [B, K, G, T, D].

    ``blocks`` > 1 runs ``lax.map`` over that many blocks of rows, so the float32 scores
    [B, K, G, T, S] are never all in memory at once: on a CPU a block that fits in cache is
    ~3x faster than the whole batch. Block ``i`` holds rows ``i, i + blocks, ...``, so a
    batch sharded in contiguous per-device ranges stays sharded inside every block.
    """
    if blocks > 1:
        def split(a):  # [B, ...] -> [blocks, B / blocks, ...]
            return a.reshape(a.shape[0] // blocks, blocks, *a.shape[1:]).swapaxes(0, 1)

        out = jax.lax.map(lambda xs: attend(*xs), (split(q), split(k), split(v),
                                                  split(attn_mask)))
        return out.swapaxes(0, 1).reshape(q.shape)
    probs = jax.nn.softmax(_masked_scores(q, k, attn_mask), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(q.dtype))  # [B, K, G, T, D]


def attend_compacted(q, k, v, token_mask, implementation: str = "cudnn"):
    """Causal attention among each row's real tokens through ``jax.nn.dot_product_attention``
    (``implementation`` "cudnn": cuDNN's flash attention, which never writes the scores).
    q [B, T, H, D], k and v [B, T, K, D] (GQA: query head h reads key/value head h // (H / K)),
    token_mask [B, T] -> [B, T, H, D].

    The result equals ``attend`` with ``mask_causal(token_mask)`` at every real token (a
    token sees the real tokens at or before it), with padding anywhere in a row: each row's
    real tokens are moved to its front in their order (a stable partition), so the mask
    becomes cuDNN's causal mask with per-row lengths; the outputs are moved back. Padding
    tokens' outputs are 0 (``attend`` gives them a finite average nobody reads), and no
    gradient flows through them: the inputs and outputs past a row's length are zeroed by a
    select, whatever a kernel leaves there. The compacted rows are padded to a multiple of
    ``FLASH_MULTIPLE`` tokens (lengths cuDNN's kernel takes, ``flash_attention_problem``)
    and cut back after.
    """
    b, t = token_mask.shape
    mask = token_mask.astype(bool)
    lengths = mask.sum(axis=1).astype(jnp.int32)  # [B]
    # where token p goes: the real ones to 0..len-1 in order, the padding after them
    dest = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1,
                     lengths[:, None] + jnp.cumsum(~mask, axis=1) - 1).astype(jnp.int32)
    source = jnp.argsort(dest, axis=1)  # its inverse: compacted slot j holds token source[j]
    real = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T] in compacted order

    def move(a, index):  # [B, T, N, D] rows reordered by index [B, T]
        return jnp.take_along_axis(a, index[:, :, None, None], axis=1)

    padded = -(-t // FLASH_MULTIPLE) * FLASH_MULTIPLE

    def compact(a):  # [B, T, N, D] -> [B, padded, N, D]
        a = jnp.where(real[:, :, None, None], move(a.astype(q.dtype), source),
                      jnp.zeros((), q.dtype))
        return jnp.pad(a, ((0, 0), (0, padded - t), (0, 0), (0, 0)))

    out = jax.nn.dot_product_attention(
        compact(q), compact(k), compact(v), is_causal=True, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths, implementation=implementation)[:, :t]
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
    return move(out, dest)


def _masked_scores(q, k, attn_mask):
    """Scaled float32 scores of q [B, K, G, T, D] against k [B, K, D, S], masked by attn_mask
    [B, T, S] -> [B, K, G, T, S]."""
    scores = jnp.einsum("bkgtd,bkds->bkgts", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(q.shape[-1]))
    return jnp.where(attn_mask[:, None, None, :, :], scores, _MASK_VALUE)


def attend_group_prefix(q, k, v, attn_mask, prefix_k, prefix_v, prefix_mask, blocks: int = 1):
    """``attend`` over a group's shared prefix, then each row's own slots: one softmax over
    both. q [B, K, G, T, D], k [B, K, D, S], v [B, K, S, D], attn_mask [B, T, S]; rows
    ``g * R .. g * R + R - 1`` (R = B / N) continue prefix g of prefix_k [N, K, D, P],
    prefix_v [N, K, P, D], prefix_mask [N, P] -> [B, K, G, T, D].

    Equal (up to float rounding) to ``attend`` on each row's copy of its prefix concatenated
    before its slots, but the prefix is read once per group and its products are matmuls of
    R x G x T query rows, not R matrix-vector products. ``blocks`` > 1 runs ``lax.map`` over
    blocks of prefixes (the nearest count dividing N), as ``attend`` does over rows.
    """
    n = prefix_k.shape[0]
    b, kh, gq, t, d = q.shape
    r = b // n
    if blocks > 1 and n > 1:
        blocks = next(c for c in range(min(blocks, n), n + 1) if n % c == 0)

        def split(a, per_prefix):  # rows [B, ...] or prefixes [N, ...] -> [blocks, ..., ...]
            a = a.reshape(n, r, *a.shape[1:]) if not per_prefix else a
            a = a.reshape(n // blocks, blocks, *a.shape[1:]).swapaxes(0, 1)
            return a if per_prefix else a.reshape(blocks, (n // blocks) * r, *a.shape[3:])

        xs = (*(split(a, False) for a in (q, k, v, attn_mask)),
              *(split(a, True) for a in (prefix_k, prefix_v, prefix_mask)))
        out = jax.lax.map(lambda xs: attend_group_prefix(*xs), xs)  # [blocks, B / blocks, ...]
        out = out.reshape(blocks, n // blocks, r, *out.shape[2:]).swapaxes(0, 1)
        return out.reshape(q.shape)
    qg = q.reshape(n, r, kh, gq, t, d)
    s_pre = jnp.einsum("nrkgtd,nkdp->nrkgtp", qg, prefix_k.astype(q.dtype),
                       preferred_element_type=jnp.float32) * (1.0 / math.sqrt(d))
    s_pre = jnp.where(prefix_mask[:, None, None, None, None, :], s_pre, _MASK_VALUE)
    s_pre = s_pre.reshape(b, kh, gq, t, -1)  # [B, K, G, T, P]
    s_own = _masked_scores(q, k, attn_mask)  # [B, K, G, T, S]
    top = jnp.maximum(s_pre.max(-1, keepdims=True), s_own.max(-1, keepdims=True))
    e_pre, e_own = jnp.exp(s_pre - top), jnp.exp(s_own - top)
    total = e_pre.sum(-1, keepdims=True) + e_own.sum(-1, keepdims=True)
    p_pre = (e_pre / total).astype(q.dtype).reshape(n, r, kh, gq, t, -1)
    out = jnp.einsum("nrkgtp,nkpd->nrkgtd", p_pre, prefix_v.astype(q.dtype)).reshape(q.shape)
    return out + jnp.einsum("bkgts,bksd->bkgtd", (e_own / total).astype(q.dtype),
                            v.astype(q.dtype))


def attention_blocks(config: QwenConfig, batch: int, queries: int, slots: int,
                     shards: int = 1) -> int:
    """How many row blocks ``attend`` should use: the fewest whose float32 scores fit
    ``config.attention_block_bytes`` per device, dividing the per-device batch ``batch /
    shards`` evenly (so every block keeps the batch sharding)."""
    budget = config.attention_block_bytes
    if budget is None:
        budget = 4 << 20 if jax.default_backend() == "cpu" else 1 << 30
    per_device = batch // shards if shards and batch % shards == 0 else 0
    row_bytes = 4 * config.num_attention_heads * queries * slots
    if budget <= 0 or per_device <= 1 or row_bytes * per_device <= budget:
        return 1
    want = -(-row_bytes * per_device // budget)
    return next(n for n in range(min(want, per_device), per_device + 1) if per_device % n == 0)


class Qwen2MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); biases only in a Llama with ``mlp_bias``."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        c = config
        bias = c.mlp_bias
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=bias,
                                spec=("tensor", "fsdp"), config=c, rngs=rngs)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=bias,
                              spec=("tensor", "fsdp"), config=c, rngs=rngs)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=bias,
                                spec=("fsdp", "tensor"), config=c, rngs=rngs)

    def __call__(self, x):  # [B, T, E] -> [B, T, E] via [B, T, F]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.self_attn = Qwen2Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)
        self.mlp = Qwen2MLP(config, rngs=rngs)

    def __call__(self, x, positions, attn_mask, layer_cache=None, index=None, blocks=1,
                 rows=None, prefix_kv=None, group_prefix=None, token_mask=None):
        h, layer_cache = self.self_attn(self.input_layernorm(x), positions, attn_mask,
                                        layer_cache, index, blocks, rows, prefix_kv,
                                        group_prefix, token_mask)
        if rows is not None:  # only these tokens go on: [B, 1, E]
            x = take_rows(x, rows)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, layer_cache


def stack_layers(layers: list[nnx.Module]) -> nnx.Module:
    """One module with the structure of ``layers[0]`` whose every variable stacks the layers'
    values on a new leading axis ``[L, ...]`` (partition spec: the layer axis unsharded).

    Used at construction, so a stacked model is initialised exactly as ``L`` separate
    layers built one after the other from the same ``rngs``."""
    graphdef = nnx.graphdef(layers[0])
    if any(nnx.graphdef(layer) != graphdef for layer in layers[1:]):
        raise ValueError("stack_layers: the layers differ in structure")
    states = [nnx.state(layer) for layer in layers]

    def stack(*vs):
        spec = vs[0].get_metadata().get("out_sharding")
        spec = None if spec is None else (None, *spec)
        return vs[0].replace(jnp.stack([v[...] for v in vs]), out_sharding=spec)

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_var))


def unstack_layers(stacked: nnx.Module, n: int) -> nnx.List:
    """The inverse of ``stack_layers``: ``n`` separate modules, row ``i`` of every variable
    (partition specs without the layer axis)."""
    graphdef, state = nnx.split(stacked)

    def row(i):
        def one(v):
            spec = v.get_metadata().get("out_sharding")
            return v.replace(v[...][i], out_sharding=None if spec is None else tuple(spec[1:]))

        return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=_is_var))

    return nnx.List([row(i) for i in range(n)])


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def layer_at(graphdef, state, i) -> nnx.Module:
    """Layer ``i`` (traced or static) of a stacked layer state, as a module. The index is a
    dynamic slice, which XLA reads in place inside a loop (a static slice may copy)."""
    return nnx.merge(graphdef, jax.tree.map(
        lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), state))


@flax.struct.dataclass
class SharedPrefix:
    """What ``Qwen2Model.prefix`` keeps of ``G`` prefixes: every layer's keys and values
    (``k [L, G, K, D, P]``, ``v [L, G, K, P, D]``), the real-token ``mask [G, P]`` and the
    final normed hidden state at the last real token, ``last_hidden [G, E]`` (it predicts
    the first token after the prefix)."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    last_hidden: jax.Array

    def take(self, rows: jax.Array) -> SharedPrefix:
        """The prefix of each of ``B`` sequences: ``rows [B]`` indexes the ``G`` prefixes."""
        return SharedPrefix(k=jnp.take(self.k, rows, axis=1), v=jnp.take(self.v, rows, axis=1),
                            mask=jnp.take(self.mask, rows, axis=0),
                            last_hidden=jnp.take(self.last_hidden, rows, axis=0))


class Qwen2Model(nnx.Module):
    """Embedding, decoder layers and the final norm. The layers are one stacked
    ``Qwen2DecoderLayer`` (leading layer axis on every variable, see the module docstring),
    run by ``lax.scan`` without a cache and ``lax.fori_loop`` over the stacked cache with one;
    after ``per_layer`` they are an ``nnx.List`` of layers run by a Python loop (unrolled
    under jit) with a per-layer cache."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(config, rngs=rngs)
        self.layers = stack_layers(
            [Qwen2DecoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config)
        # Set by ``shard_model``: keeps activations [B, T, E] split over the batch axes, as
        # MaxText's activation constraints do; without it XLA may replicate them.
        self.activation_sharding = None

    @property
    def stacked(self) -> bool:
        """Whether the layers are stored stacked (else an ``nnx.List``, see ``per_layer``)."""
        return not isinstance(self.layers, nnx.List)

    def batch_shards(self) -> int:
        """How many ways ``activation_sharding`` splits the batch (1 without a mesh)."""
        sharding = self.activation_sharding
        if sharding is None:
            return 1
        return sharding.mesh.shape["data"] * sharding.mesh.shape["fsdp"]

    def _constrain(self, x):
        if self.activation_sharding is None:
            return x
        if x.shape[0] % self.batch_shards():  # e.g. a sampler batch of 1 on 8 devices: leave it to XLA
            return x
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)

    def _layers_no_cache(self, x, positions, attn_mask, prefix_kv=None, token_mask=None):
        """All layers on ``x [B, T, E]`` without a cache (training, scoring): one ``lax.scan``
        over the stacked layer variables (unrolled unless ``config.scan_layers``), each layer
        under the ``config.remat`` policy. Gradients come back stacked, like the weights.
        Returns the output and every layer's keys and values, stacked ``[L, ...]`` (dropped
        by XLA where unused). ``prefix_kv``: stacked keys and values every layer attends to
        before ``x``'s tokens (``Qwen2Model.prefix``). ``token_mask [B, T]``: the real tokens
        that ``attn_mask = mask_causal(token_mask)`` came from, for a fused attention
        (``QwenConfig.attention_impl``)."""
        graphdef = nnx.graphdef(self.layers if self.stacked else self.layers[0])

        def run(x, layer_state, pkv):
            x, kv = nnx.merge(graphdef, layer_state)(x, positions, attn_mask, prefix_kv=pkv,
                                                     token_mask=token_mask)
            return self._constrain(x), kv

        if self.config.remat != "none":
            run = jax.checkpoint(run, policy=REMAT_POLICIES[self.config.remat])
        if not self.stacked:
            kvs = []
            for i, layer in enumerate(self.layers):
                pkv = None if prefix_kv is None else jax.tree.map(lambda a, i=i: a[i], prefix_kv)
                x, kv = run(x, nnx.state(layer), pkv)
                kvs.append(kv)
            return x, jax.tree.map(lambda *a: jnp.stack(a), *kvs)
        return jax.lax.scan(lambda x, s: run(x, *s), x, (nnx.state(self.layers), prefix_kv),
                            unroll=1 if self.config.scan_layers else True)

    def prefix(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array
               ) -> SharedPrefix:
        """Runs ``G`` prefixes once (e.g. a group's shared prompt) and keeps what the
        sequences continuing them need: every layer's keys and values and the final hidden
        state at each prefix's last real token. ``tokens``, ``positions``, ``attention_mask``
        [G, P]. ``__call__(..., prefix=p.take(rows))`` then runs the continuations as if
        each were one sequence with its prefix, and gradients flow back through the prefix
        (the sum over its continuations)."""
        mask = attention_mask.astype(bool)
        x = self._constrain(self.embed_tokens(tokens))  # [G, P, E]
        x, (k, v) = self._layers_no_cache(x, positions, mask_causal(mask), token_mask=mask)
        last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)  # [G]
        hidden = self.norm(take_rows(x, last))[:, 0]  # [G, E]
        return SharedPrefix(k=k, v=v, mask=mask, last_hidden=hidden)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 attention_mask: jax.Array | None = None, cache: KVCache | None = None,
                 rows: jax.Array | None = None, *, prefix: SharedPrefix | None = None
                 ) -> tuple[jax.Array, KVCache | None]:
        """The final normed hidden states [B, T, E] and the updated cache (see
        ``Qwen2ForCausalLM.__call__`` for the arguments). With ``rows`` [B] the states of
        token ``rows[b]`` only, [B, 1, E]: the last layer then runs its queries, output
        projection and MLP on that token alone (every layer still fills the cache). With
        ``prefix`` (``Qwen2Model.prefix(...).take(...)``, one row per sequence; no cache),
        the tokens continue that prefix: they attend to its real tokens, and ``positions``
        go on from it."""
        b, t = tokens.shape
        mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        x = self._constrain(self.embed_tokens(tokens))  # [B, T, E]

        if prefix is not None:
            if cache is not None or rows is not None:
                raise ValueError("a shared prefix is for full forward passes (no cache or rows)")
            attn_mask = jnp.concatenate(  # [B, T, P + T]
                [jnp.broadcast_to(prefix.mask[:, None, :], (b, t, prefix.mask.shape[1])),
                 mask_causal(mask)], axis=2)
            x, _ = self._layers_no_cache(x, positions, attn_mask, (prefix.k, prefix.v))
            return self.norm(x), None
        if cache is None:
            if rows is None:
                x, _ = self._layers_no_cache(x, positions, mask_causal(mask), token_mask=mask)
                return self.norm(x), None
            attn_mask, index, kv = mask_causal(mask), None, None
        else:
            index = cache.index
            valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, index))  # [B, S]
            slots = jnp.arange(cache.size)  # [S]
            query_slot = index + jnp.arange(t)  # [T]
            attn_mask = (slots[None, :] <= query_slot[:, None])[None] & valid[:, None, :]
            kv = (cache.k, cache.v)  # stacked [L, B, ...] or per-layer tuples (KVCache)

        blocks = last_blocks = 1
        if cache is not None:
            shards = self.batch_shards()
            slots = cache.size + (cache.prefix_valid.shape[1] if cache.groups else 0)
            blocks = attention_blocks(self.config, b, t, slots, shards)
            last_blocks = blocks if rows is None else attention_blocks(
                self.config, b, 1, slots, shards)
            if cache.groups and self.stacked:
                raise ValueError("a cache with a group prefix is for per-layer models (per_layer)")

        n = self.config.num_hidden_layers
        last = n if rows is None else n - 1  # with rows, the last layer runs on its own
        if self.stacked:
            graphdef, state = nnx.split(self.layers)

            def run(i, x, kv, block_count, only_rows):
                layer_cache = None if kv is None else (*kv, i)
                x, layer_cache = layer_at(graphdef, state, i)(
                    x, positions, attn_mask, layer_cache, index, block_count, only_rows)
                return self._constrain(x), None if kv is None else layer_cache[:2]

            x, kv = jax.lax.fori_loop(0, last, lambda i, c: run(i, *c, blocks, None), (x, kv))
            if rows is not None:
                x, kv = run(jnp.int32(n - 1), x, kv, last_blocks, rows)
        else:
            ks, vs = (list(kv[0]), list(kv[1])) if kv is not None else ([None] * n, [None] * n)
            grouped = cache is not None and cache.groups
            for i, layer in enumerate(self.layers):
                final = i == n - 1 and rows is not None
                layer_cache = None if kv is None else (ks[i], vs[i], None)
                shared = (cache.prefix_k[i], cache.prefix_v[i], cache.prefix_valid) if grouped else None
                x, layer_cache = layer(x, positions, attn_mask, layer_cache, index,
                                       last_blocks if final else blocks, rows if final else None,
                                       group_prefix=shared)
                x = self._constrain(x)
                if kv is not None:
                    ks[i], vs[i], _ = layer_cache
            kv = None if kv is None else (tuple(ks), tuple(vs))

        new_cache = None
        if cache is not None:
            new_cache = cache.replace(  # a group prefix, if any, stays as it is
                k=kv[0],
                v=kv[1],
                valid=valid,
                index=(index + t).astype(jnp.int32),
                lengths=(cache.lengths + mask.sum(axis=1)).astype(jnp.int32),
            )

        return self.norm(x), new_cache


def mask_causal(mask: jax.Array) -> jax.Array:
    """``[B, T]`` real-token mask -> ``[B, T, T]``: query t may see real tokens at or before t."""
    t = mask.shape[1]
    return jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]


def output_head(config: QwenConfig, *, rngs: nnx.Rngs) -> Linear:
    """An untied model's ``lm_head``: hidden states [.., E] to float32 logits [.., V] (bf16
    operands accumulate into float32, never rounded to bf16), no bias."""
    head = Linear(config.hidden_size, config.vocab_size, bias=False, spec=("tensor", "fsdp"),
                  config=config, rngs=rngs)
    head.out_dtype = jnp.float32
    return head


class Qwen2ForCausalLM(nnx.Module):
    """The causal LM. ``model(tokens, positions, attention_mask, cache) -> (logits, cache)``."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen2Model(config, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = output_head(config, rngs=rngs)

    def init_cache(self, batch: int, size: int, dtype=None) -> KVCache:
        """An empty cache in this model's layout (stacked or per layer)."""
        return KVCache.init(self.config, batch, size, dtype, stacked=self.model.stacked)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Runs the decoder.

        Args:
          tokens: [B, T] int token ids.
          positions: [B, T] rotary positions (``positions_from_mask``).
          attention_mask: [B, T], 1 for real tokens, 0 for padding; None means all real.
          cache: optional ``KVCache``; the tokens are appended at ``cache.index`` (the caller
            must leave room: ``cache.index + T <= cache.size``, slots past the end are lost).
          logits_at: optional [B] index into T; then logits are computed only there and have
            shape [B, 1, V] (saves the vocabulary projection during prefill, and the last
            layer's work on every other token).

        Returns:
          ``(logits [B, T, V] float32, updated cache or None)``.
        """
        # [B, T, E], or [B, 1, E] with logits_at
        x, new_cache = self.model(tokens, positions, attention_mask, cache, logits_at)
        return self.logits(x), new_cache

    def logits(self, x: jax.Array) -> jax.Array:
        """The output head on final hidden states: [..., E] -> [..., V] float32. With
        ``self.model(...)`` it splits ``__call__`` in two, so a caller can compute the
        vocabulary projection on chunks of the hidden states (``starpo.token_scores``)."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)


class Qwen2ForValue(nnx.Module):
    """The critic: the Qwen2 backbone and a scalar value per token (Hugging Face's
    ``Qwen2ForTokenClassification`` with one label: ``model.*`` plus ``score.weight``).

    ``from_actor`` copies the actor's backbone (RAGEN initialises the critic from the same
    checkpoint); the value head starts random, as Hugging Face initialises ``score``."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen2Model(config, rngs=rngs)
        self.score = Linear(config.hidden_size, 1, bias=False, spec=(None, "fsdp"),
                            config=config, rngs=rngs)

    @classmethod
    def from_actor(cls, actor: Qwen2ForCausalLM, seed: int = 0) -> Qwen2ForValue:
        critic = cls(actor.config, rngs=nnx.Rngs(seed))
        base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # an adapted actor: its base weights
        nnx.update(critic.model, nnx.state(actor.model, base))
        return critic

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 attention_mask: jax.Array | None = None, *,
                 prefix: SharedPrefix | None = None) -> jax.Array:
        """Values [B, T] float32: the value of the state after reading token t (of the
        sequences continuing ``prefix``, when given: see ``Qwen2Model.__call__``)."""
        x, _ = self.model(tokens, positions, attention_mask, prefix=prefix)
        return self.score(x)[..., 0].astype(jnp.float32)
