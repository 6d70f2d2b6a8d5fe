"""Attention kernels of the decoder (``qwen.py``): softmax attention over a batch's own slots
(``attend``), over a group's shared prefix and then each row's slots (``attend_group_prefix``),
and through ``jax.nn.dot_product_attention`` on compacted rows (``attend_compacted``, cuDNN's
flash attention on a GPU), with the masks, the choice of implementation and the row blocks
they run in.

Shapes: B batch, T queries, S key/value slots, P prefix slots, H query heads, K key/value
heads, G = H // K, D head dim. Queries come grouped by key/value head, ``[B, K, G, T, D]``;
keys transposed, ``[B, K, D, S]``, and values ``[B, K, S, D]`` (the ``KVCache`` layout, so
both products contract over a non-minor dimension).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from ragen_jax.models.qwen_config import QwenConfig

# Large negative (not -inf) for masked attention scores, so a query with no visible key (a
# padding token before any real token) gets a finite, ignored output instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

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


def is_half(dtype) -> bool:
    """Whether ``dtype`` is bfloat16 or float16 (what cuDNN's flash attention computes in)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cuda() -> bool:
    """Whether the default backend is an NVIDIA GPU (cuDNN's attention needs one)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # an unusual client: do not guess
        return False


def fused_implementation(attention_impl: str, head_dim: int, dtype) -> str | None:
    """The ``jax.nn.dot_product_attention`` implementation that calls without a cache use
    under ``attention_impl`` (``ATTENTION_IMPLS``), or None for ``attend``'s materialised
    scores. "auto" decides here, when a model is traced: cuDNN on a CUDA GPU with a bf16/fp16
    compute ``dtype`` and a ``head_dim`` its kernels take on any such GPU (a multiple of 8, at
    most 128)."""
    fits = head_dim % 8 == 0 and head_dim <= FLASH_HEAD_DIM_MAX
    if attention_impl == "auto":
        return "cudnn" if fits and is_half(dtype) and _cuda() else None
    if attention_impl == "cudnn" and not fits:  # lengths are padded; a head dim is not
        note = (f"attention_impl 'cudnn': head dim {head_dim} is not one cuDNN's flash "
                f"attention takes (a multiple of 8, at most {FLASH_HEAD_DIM_MAX}); using xla")
        if note not in _said_fallback:
            _said_fallback.add(note)
            print(note, flush=True)
        return None
    return {"xla": None, "cudnn": "cudnn", "dpa_xla": "xla"}[attention_impl]


def flash_attention_problem(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype) -> str | None:
    """Why cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``,
    BTNH layout, with per-row lengths, in training) would refuse ``q [B, T, H, D]`` and ``k``/``v``
    ``[B, S, K, D]`` of ``dtype``, or None. Our own predicate, written from the conditions of
    jax's ``check_is_flash_attention`` (jax 0.10-0.11), on the safe side where they depend on
    the GPU: a bf16/fp16 dtype; a head dim that is a multiple of 8 and at most 128; even query
    and key lengths (a mask or lengths count as a bias there); query and key heads that divide
    (GQA); the same head dim for keys and values (no MLA)."""
    (_, t, h, d), (_, s, k, dv) = q_shape, kv_shape
    if not is_half(dtype):
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


def mask_causal(mask: jax.Array) -> jax.Array:
    """``[B, T]`` real-token mask -> ``[B, T, T]``: query t may see real tokens at or before t."""
    t = mask.shape[1]
    return jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, attn_mask: jax.Array,
           blocks: int = 1) -> jax.Array:
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


def attend_compacted(q: jax.Array, k: jax.Array, v: jax.Array, token_mask: jax.Array,
                     implementation: str = "cudnn") -> jax.Array:
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


def attend_group_prefix(q: jax.Array, k: jax.Array, v: jax.Array, attn_mask: jax.Array,
                        prefix_k: jax.Array, prefix_v: jax.Array, prefix_mask: jax.Array,
                        blocks: int = 1) -> jax.Array:
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
