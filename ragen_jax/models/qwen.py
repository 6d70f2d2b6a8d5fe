"""The Qwen2 / Qwen2.5 decoder in Flax NNX, in one file; with a few switches of its config
(``QwenConfig.model_type``) also Llama (SmolLM2, Llama 3.x) and dense Qwen3, which share its
structure and its checkpoints' names.

Module and parameter names follow the Hugging Face checkpoint exactly, and every weight keeps the
Hugging Face layout (``nn.Linear`` weights are ``[out, in]``). The decoder layers are stored
stacked, as MaxText does: one ``Qwen2DecoderLayer`` whose every variable has a leading layer
axis ``L``, so the checkpoint key ``model.layers.3.self_attn.q_proj.weight`` is row 3 of the
NNX variable ``("model", "layers", "self_attn", "q_proj", "weight")`` of shape ``[L, out, in]``
(``weights.py`` stacks and unstacks them, ``stacking.py`` builds and reads the stacked
layout). The layers then run as one loop over that axis (``lax.scan`` for training,
``lax.fori_loop`` with a cache), so compile time and the optimizer's program do not grow
with depth. The sampler decodes from ``compute_copy(model)``
(``copies.py``), whose layers are separate modules again (``per_layer``) with a per-layer KV cache: XLA:CPU
copies a layer's weights out of the stacked variable before each matmul of the loop, which
made batch-1 decoding of the 0.5B shape 2.2x slower; as separate arrays they are read in place.

Shapes in comments use: B batch, T new tokens in this call, S key/value slots (T without a
cache, the cache size with one), E hidden size, H query heads, K key/value heads, G = H // K,
D head dim, F MLP width, V vocabulary. The hyper-parameters are ``qwen_config.py``'s, the
attention kernels ``attention.py``'s, the Hugging Face ``config.json`` translation and
checkpoint keys ``hf_convert.py``'s.

The decoder has two paths: the forward path (``Qwen2Model.__call__``: training and scoring,
no cache, optionally continuing a ``SharedPrefix``) and the cached path
(``Qwen2Model.decode``: prefill and decoding with a ``KVCache``). ``Qwen2ForCausalLM`` takes
the one or the other.

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

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.attention import (
    attend,
    attend_compacted,
    attend_group_prefix,
    attention_blocks,
    mask_causal,
)
from ragen_jax.models.kv_cache import KVCache, write_cache
from ragen_jax.models.paged_attention import paged_attention_xla, paged_decode_attention
from ragen_jax.models.paged_cache import PagedKVCache
from ragen_jax.models.qwen_config import REMAT_POLICIES, QwenConfig
from ragen_jax.models.stacking import layer_at, stack_layers

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
    checkpoints); Qwen3: ``q_norm`` / ``k_norm``, RMSNorms over each head's D, before rope.

    ``__call__`` is the forward path (no cache: training, scoring), ``decode`` the path with
    a cache (prefill, decoding) or with ``rows``."""

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

    def _keys_values(self, x, positions, inv_freq):  # [B, T, E] -> 2 x [B, T, K, D]
        c = self.config
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rope(k, positions, inv_freq), v

    def _queries(self, x, positions, inv_freq):  # [B, T, E] -> [B, T, H, D]
        c = self.config
        q = self.q_proj(x).reshape(*x.shape[:2], c.num_attention_heads, c.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rope(q, positions, inv_freq)

    def _attend(self, q, k, v, attn_mask, blocks=1, group_prefix=None):
        """``attend`` (or ``attend_group_prefix``) and the output projection: q [B, T, H, D],
        k [B, K, D, S], v [B, K, S, D] -> [B, T, E]."""
        c = self.config
        b, t = q.shape[:2]
        groups = c.num_attention_heads // c.num_key_value_heads
        q = q.reshape(b, t, c.num_key_value_heads, groups, c.head_dim)
        q = q.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
        if group_prefix is None:
            out = attend(q, k, v, attn_mask, blocks)  # [B, K, G, T, D]
        else:
            out = attend_group_prefix(q, k, v, attn_mask, *group_prefix, blocks)
        out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, c.num_attention_heads * c.head_dim)
        return self.o_proj(out)

    def __call__(self, x, positions, attn_mask, prefix_kv=None, token_mask=None):
        """x [B, T, E], attn_mask [B, T, S] bool (True = may attend) -> (out [B, T, E],
        this call's keys and values ``(k [B, K, D, T], v [B, K, T, D])``, which
        ``Qwen2Model.prefix`` keeps).

        Keys are this call's tokens (S = T), or with ``prefix_kv`` (the same layout over P
        slots) those slots first and then this call's (S = P + T: a shared prefix, see
        ``Qwen2Model.prefix``). ``token_mask [B, T]`` (``attn_mask`` is then
        ``mask_causal(token_mask)``) lets ``config.fused_attention()`` replace ``attend`` by
        ``attend_compacted`` in a call without a prefix.
        """
        c = self.config
        b, t, _ = x.shape
        inv_freq = c.rope_inv_freq()  # [D/2]
        k, v = self._keys_values(x, positions, inv_freq)  # [B, T, K, D]
        fused = None
        if token_mask is not None and prefix_kv is None:
            fused = c.fused_attention()
        if fused is not None:
            q = self._queries(x, positions, inv_freq)  # [B, T, H, D]
            out = attend_compacted(q, k, v, token_mask, fused)  # [B, T, H, D]
            out = out.reshape(b, t, c.num_attention_heads * c.head_dim)
            return self.o_proj(out), (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
        k = k.transpose(0, 2, 3, 1)  # [B, K, D, T]
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        q = self._queries(x, positions, inv_freq)  # [B, T, H, D]
        own = (k, v)
        if prefix_kv is not None:
            k = jnp.concatenate([prefix_kv[0].astype(k.dtype), k], axis=-1)  # [B, K, D, P + T]
            v = jnp.concatenate([prefix_kv[1].astype(v.dtype), v], axis=-2)  # [B, K, P + T, D]
        return self._attend(q, k, v, attn_mask), own

    def decode(self, x, positions, attn_mask, layer_cache, index, blocks=1, rows=None,
               group_prefix=None):
        """x [B, T, E], attn_mask [B, T, S] bool -> (out [B, T, E], the updated cache).

        ``layer_cache = (k, v, layer)``: ``layer`` None and this layer's cache [B, K, D, S],
        [B, K, S, D], or the stacked cache [L, B, K, D, S], [L, B, K, S, D] and this layer's
        index; the new keys/values are written at slot ``index`` in place (``write_cache``).
        ``layer_cache`` None: keys are this call's tokens (S = T), nothing is kept (a call
        with ``rows`` only). ``blocks`` > 1 computes attention over that many blocks of batch
        rows, one after the other (see ``attend``). With ``rows`` [B], keys and values come
        from all T tokens but only token ``rows[b]`` of each row queries: the output is
        [B, 1, E]. ``group_prefix = (k [G, K, D, P], v [G, K, P, D], mask [G, P])`` (with a
        per-layer cache, ``KVCache.with_group_prefix``): slots every row of a group of B / G
        consecutive rows sees before its cache's (``attend_group_prefix``).
        """
        inv_freq = self.config.rope_inv_freq()  # [D/2]
        k, v = self._keys_values(x, positions, inv_freq)  # [B, T, K, D]
        k = k.transpose(0, 2, 3, 1)  # [B, K, D, T]
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        if rows is not None:
            x, positions, attn_mask = (take_rows(a, rows) for a in (x, positions, attn_mask))
        q = self._queries(x, positions, inv_freq)  # [B, T or 1, H, D]
        if layer_cache is not None:
            k, v, layer_cache = write_cache(layer_cache, k, v, index)  # [B, K, D, S], [B, K, S, D]
        return self._attend(q, k, v, attn_mask, blocks, group_prefix), layer_cache


    def decode_paged(self, x, positions, counts, cache: PagedKVCache, layer: int,
                     impl: str = "auto"):
        """``decode`` over a paged cache: x [B, T, E] right-padded (``counts [B]`` real
        tokens per row, at positions ``cache.lengths[b] + j``), written into layer ``layer``'s
        blocks, then attending to what each row holds (``paged_attention``) -> (out [B, T, E],
        the cache with this layer written; lengths advance after the last layer)."""
        c = self.config
        b, t, _ = x.shape
        inv_freq = c.rope_inv_freq()  # [D/2]
        k, v = self._keys_values(x, positions, inv_freq)  # [B, T, K, D]
        cache = cache.write_layer(layer, k, v, counts)
        q = self._queries(x, positions, inv_freq)  # [B, T, H, D]
        k_pages, v_pages = cache.layer_pages(layer)  # [K, N, P, D]
        held = cache.lengths + counts  # [B] this call's tokens included
        if t == 1:
            out = paged_decode_attention(q[:, 0], k_pages, v_pages, cache.block_table, held,
                                         impl=impl)[:, None]  # [B, 1, H, D]
        else:
            out = paged_attention_xla(q, k_pages, v_pages, cache.block_table, held, counts)
        return self.o_proj(out.reshape(b, t, c.num_attention_heads * c.head_dim)), cache


def take_rows(a: jax.Array, rows: jax.Array) -> jax.Array:
    """``a[b, rows[b]]`` for every b, keeping a length-1 axis: [B, T, ...] -> [B, 1, ...]."""
    index = rows.astype(jnp.int32).reshape(-1, 1, *([1] * (a.ndim - 2)))
    return jnp.take_along_axis(a, index, axis=1)


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
    """Pre-norm residual block: attention then MLP (``__call__`` and ``decode`` as
    ``Qwen2Attention``'s)."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.self_attn = Qwen2Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)
        self.mlp = Qwen2MLP(config, rngs=rngs)

    def _mlp_block(self, x, h):  # residual x [B, T, E] plus attention output h [B, T, E]
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, positions, attn_mask, prefix_kv=None, token_mask=None):
        h, kv = self.self_attn(self.input_layernorm(x), positions, attn_mask, prefix_kv,
                               token_mask)
        return self._mlp_block(x, h), kv

    def decode(self, x, positions, attn_mask, layer_cache, index, blocks=1, rows=None,
               group_prefix=None):
        h, layer_cache = self.self_attn.decode(self.input_layernorm(x), positions, attn_mask,
                                               layer_cache, index, blocks, rows, group_prefix)
        if rows is not None:  # only these tokens go on: [B, 1, E]
            x = take_rows(x, rows)
        return self._mlp_block(x, h), layer_cache

    def decode_paged(self, x, positions, counts, cache, layer, impl="auto"):
        h, cache = self.self_attn.decode_paged(self.input_layernorm(x), positions, counts,
                                               cache, layer, impl)
        return self._mlp_block(x, h), cache


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
    under jit) with a per-layer cache.

    Two paths: ``__call__`` (training, scoring, sequences continuing a ``SharedPrefix``) and
    ``decode`` (with a ``KVCache``: prefill and decoding, or hidden states at ``rows``)."""

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

    def _embed(self, tokens, attention_mask):  # [B, T] -> mask [B, T] bool, x [B, T, E]
        b, t = tokens.shape
        mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        return mask, self._constrain(self.embed_tokens(tokens))

    # -- forward: training and scoring -------------------------------------------------------

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 attention_mask: jax.Array | None = None, *,
                 prefix: SharedPrefix | None = None) -> jax.Array:
        """The final normed hidden states [B, T, E] of ``tokens`` [B, T] (``positions`` and
        ``attention_mask`` [B, T] as in ``Qwen2ForCausalLM.__call__``), no cache. With
        ``prefix`` (``Qwen2Model.prefix(...).take(...)``, one row per sequence) the tokens
        continue that prefix: they attend to its real tokens, and ``positions`` go on from
        it."""
        mask, x = self._embed(tokens, attention_mask)  # [B, T], [B, T, E]
        if prefix is None:
            x, _ = self._layers(x, positions, mask_causal(mask), token_mask=mask)
            return self.norm(x)
        b, t = tokens.shape
        attn_mask = jnp.concatenate(  # [B, T, P + T]
            [jnp.broadcast_to(prefix.mask[:, None, :], (b, t, prefix.mask.shape[1])),
             mask_causal(mask)], axis=2)
        x, _ = self._layers(x, positions, attn_mask, (prefix.k, prefix.v))
        return self.norm(x)

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
        x, (k, v) = self._layers(x, positions, mask_causal(mask), token_mask=mask)
        last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)  # [G]
        hidden = self.norm(take_rows(x, last))[:, 0]  # [G, E]
        return SharedPrefix(k=k, v=v, mask=mask, last_hidden=hidden)

    def _layers(self, x, positions, attn_mask, prefix_kv=None, token_mask=None):
        """All layers on ``x [B, T, E]`` without a cache: one ``lax.scan`` over the stacked
        layer variables (unrolled unless ``config.scan_layers``), each layer under the
        ``config.remat`` policy. Gradients come back stacked, like the weights. Returns the
        output and every layer's keys and values, stacked ``[L, ...]`` (dropped by XLA where
        unused). ``prefix_kv``: stacked keys and values every layer attends to before ``x``'s
        tokens (``Qwen2Model.prefix``). ``token_mask [B, T]``: the real tokens that
        ``attn_mask = mask_causal(token_mask)`` came from, for a fused attention
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

    # -- decode: with a KV cache ---------------------------------------------------------------

    def decode(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array | None,
               cache: KVCache | None, rows: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache | None]:
        """The final normed hidden states [B, T, E] of ``tokens`` [B, T] appended to ``cache``
        (see ``Qwen2ForCausalLM.__call__``), and the updated cache. With ``rows`` [B] the
        states of token ``rows[b]`` only, [B, 1, E]: the last layer then runs its queries,
        output projection and MLP on that token alone (every layer still fills the cache).
        ``cache`` None: a pass that keeps no cache (for ``rows``)."""
        b, t = tokens.shape
        mask, x = self._embed(tokens, attention_mask)  # [B, T], [B, T, E]
        blocks = last_blocks = 1
        if cache is None:
            attn_mask, index, kv = mask_causal(mask), None, None
        else:
            index = cache.index
            valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, index))  # [B, S]
            slots = jnp.arange(cache.size)  # [S]
            query_slot = index + jnp.arange(t)  # [T]
            attn_mask = (slots[None, :] <= query_slot[:, None])[None] & valid[:, None, :]
            kv = (cache.k, cache.v)  # stacked [L, B, ...] or per-layer tuples (KVCache)
            shards = self.batch_shards()
            slots = cache.size + (cache.prefix_valid.shape[1] if cache.groups else 0)
            blocks = attention_blocks(self.config, b, t, slots, shards)
            last_blocks = blocks if rows is None else attention_blocks(
                self.config, b, 1, slots, shards)
        args = (x, positions, attn_mask, kv, index, blocks, last_blocks, rows)
        if self.stacked:
            if cache is not None and cache.groups:
                raise ValueError("a cache with a group prefix is for per-layer models (per_layer)")
            x, kv = self._decode_stacked(*args)
        else:
            group_prefix = None
            if cache is not None and cache.groups:
                group_prefix = (cache.prefix_k, cache.prefix_v, cache.prefix_valid)
            x, kv = self._decode_per_layer(*args, group_prefix)
        if cache is None:
            return self.norm(x), None
        new_cache = cache.replace(  # a group prefix, if any, stays as it is
            k=kv[0],
            v=kv[1],
            valid=valid,
            index=(index + t).astype(jnp.int32),
            lengths=(cache.lengths + mask.sum(axis=1)).astype(jnp.int32),
        )
        return self.norm(x), new_cache

    def decode_paged(self, tokens: jax.Array, positions: jax.Array, counts: jax.Array,
                     cache: PagedKVCache, impl: str = "auto") -> tuple[jax.Array, PagedKVCache]:
        """The final normed hidden states [B, T, E] of right-padded ``tokens`` [B, T]
        (``counts [B]`` real per row, ``positions`` from ``cache.lengths``) appended to each
        row's blocks of a per-layer ``PagedKVCache``, and the cache with its lengths moved on.
        A row with ``counts[b] == 0`` writes nothing (a finished episode, a padding row)."""
        if self.stacked or cache.stacked:
            raise ValueError("the paged decode runs a per-layer model (per_layer) on a "
                             "per-layer PagedKVCache")
        counts = counts.astype(jnp.int32)
        _, x = self._embed(tokens, None)  # [B, T, E]
        for i, layer in enumerate(self.layers):
            x, cache = layer.decode_paged(x, positions, counts, cache, i, impl)
            x = self._constrain(x)
        return self.norm(x), cache.advance(counts)

    def _decode_stacked(self, x, positions, attn_mask, kv, index, blocks, last_blocks, rows):
        """``decode``'s layers, stacked: one ``lax.fori_loop`` over the stacked cache ``kv``
        ([L, B, ...] keys and values; None: no cache); with ``rows`` the last layer after it."""
        n = self.config.num_hidden_layers
        graphdef, state = nnx.split(self.layers)

        def run(i, x, kv, block_count, only_rows):
            layer_cache = None if kv is None else (*kv, i)
            x, layer_cache = layer_at(graphdef, state, i).decode(
                x, positions, attn_mask, layer_cache, index, block_count, only_rows)
            return self._constrain(x), None if kv is None else layer_cache[:2]

        last = n if rows is None else n - 1  # with rows, the last layer runs on its own
        x, kv = jax.lax.fori_loop(0, last, lambda i, c: run(i, *c, blocks, None), (x, kv))
        if rows is not None:
            x, kv = run(jnp.int32(n - 1), x, kv, last_blocks, rows)
        return x, kv

    def _decode_per_layer(self, x, positions, attn_mask, kv, index, blocks, last_blocks, rows,
                          group_prefix):
        """``decode``'s layers, separate: a Python loop over the per-layer cache ``kv`` (tuples
        of [B, ...] keys and values; None: no cache), every layer seeing its ``group_prefix``
        (per-layer keys and values, and their mask), if any."""
        n = self.config.num_hidden_layers
        ks, vs = (list(kv[0]), list(kv[1])) if kv is not None else ([None] * n, [None] * n)
        for i, layer in enumerate(self.layers):
            final = i == n - 1 and rows is not None
            layer_cache = None if kv is None else (ks[i], vs[i], None)
            shared = None
            if group_prefix is not None:
                shared = (group_prefix[0][i], group_prefix[1][i], group_prefix[2])
            x, layer_cache = layer.decode(x, positions, attn_mask, layer_cache, index,
                                          last_blocks if final else blocks,
                                          rows if final else None, shared)
            x = self._constrain(x)
            if kv is not None:
                ks[i], vs[i], _ = layer_cache
        return x, None if kv is None else (tuple(ks), tuple(vs))


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
        """Runs the decoder: ``Qwen2Model.__call__`` without a cache or ``logits_at``, else
        ``Qwen2Model.decode``.

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
        if cache is None and logits_at is None:
            return self.logits(self.model(tokens, positions, attention_mask)), None
        # [B, T, E], or [B, 1, E] with logits_at
        x, new_cache = self.model.decode(tokens, positions, attention_mask, cache, logits_at)
        return self.logits(x), new_cache

    def decode_paged(self, tokens: jax.Array, positions: jax.Array, counts: jax.Array,
                     cache: PagedKVCache, *, logits_at: jax.Array | None = None,
                     impl: str = "auto") -> tuple[jax.Array, PagedKVCache]:
        """``Qwen2Model.decode_paged`` then the output head: logits [B, T, V] float32, or
        [B, 1, V] at ``logits_at [B]``, and the cache with the tokens in it."""
        x, cache = self.model.decode_paged(tokens, positions, counts, cache, impl)
        if logits_at is not None:
            x = take_rows(x, logits_at)
        return self.logits(x), cache

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
        x = self.model(tokens, positions, attention_mask, prefix=prefix)
        return self.score(x)[..., 0].astype(jnp.float32)
