"""Attention over a paged KV cache (``paged_cache.py``): each row reads only the blocks it holds,
up to the longest row in flight, instead of a dense cache's whole capacity under a mask.

* ``paged_attention_xla``: the portable path (any backend). A ``lax.fori_loop`` over chunks of
  ``chunk_blocks`` blocks whose trip count is ``ceil(max(lengths) / (chunk_blocks * P))``, a
  traced bound: one compiled program serves every length, and its work follows what rows hold,
  not the capacity. Online softmax (flash-decoding style: running max, sum and accumulator in
  float32). Queries ``[B, T, H, D]``: T = 1 is decode, T > 1 is prefill into the pages (causal
  within the new tokens, each row at its own offset). Every row in flight runs the same number
  of chunks (the longest row's), masked past its own length.
* ``paged_decode_attention_pallas_gpu``: jax's Triton kernel
  (``jax.experimental.pallas.ops.gpu.paged_attention``), which stops each row at its own length.
* ``paged_decode_attention_pallas_tpu``: jax's Mosaic TPU kernel
  (``jax.experimental.pallas.ops.tpu.paged_attention``).
* ``paged_decode_attention``: the dispatcher (``impl`` "auto" takes the kernel of the backend,
  the portable path on a CPU).

Both Pallas kernels take the pool layout ``[K, N, P, D]`` this cache uses, so the adapters pass
it in place; they only pad the block table, scale the queries (neither kernel applies
``1/sqrt(D)``) and, on the TPU, zero rows of length 0 (the kernel skips them and leaves their
output unwritten). They take one layer's pool: with a stacked ``[L, K, N, P, D]`` cache the
layer is sliced out first (a copy of that layer's pool), so use per-layer pools with them.
jax's ``ragged_paged_attention`` (TPU, mixed prefill and decode) is not adapted: it takes keys
and values interleaved in one ``[N, P, 2K, D]`` pool, which our layout would have to be copied
into on every call, and on jax 0.10.2 it does not run in TPU interpret mode on a CPU
(``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``, raised from the
interpreter's ``get`` on the kernel's reshaped refs), so nothing here could check it.

Conventions: attention is called after the step's tokens are written (``write_tokens``), so
``lengths [B]`` counts the tokens each row holds, its new ones included; a decode query sees
positions ``< lengths[b]``. A row with nothing to see (length 0, or a padding query) gets 0.
Pools must hold finite values (they are zero-initialised and written with finite keys and
values): a masked score gets probability 0, and ``0 * inf`` would still be NaN.

Shapes: B rows, T queries per row, H query heads, K key/value heads, G = H // K, D head dim,
N pool blocks, P block size, M blocks per row (block table width), L layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ragen_jax.models.attention import _MASK_VALUE

PAGED_IMPLS = ("auto", "xla", "pallas_gpu", "pallas_tpu")
DEFAULT_CHUNK_BLOCKS = 4


def chunk_count(lengths: jax.Array, block_size: int, chunk_blocks: int) -> jax.Array:
    """How many chunks of ``chunk_blocks`` blocks the portable loop runs: enough for the longest
    row, ``ceil(max(lengths) / (chunk_blocks * block_size))`` (traced)."""
    span = chunk_blocks * block_size
    return (jnp.max(lengths) + span - 1) // span


def paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        block_table: jax.Array, lengths: jax.Array,
                        counts: jax.Array | None = None, *, layer: int | jax.Array | None = None,
                        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS) -> jax.Array:
    """Attention of new queries over the paged cache, portable XLA.

    ``q [B, T, H, D]`` (or ``[B, H, D]`` for decode, returned in the same shape); pools
    ``k_pages``/``v_pages`` ``[K, N, P, D]``, or ``[L, K, N, P, D]`` with ``layer`` the layer to
    read; ``block_table [B, M]`` int32; ``lengths [B]``: tokens held, this call's included.
    ``counts [B]``: this call's real (right-padded) queries per row, default all T: query
    ``j < counts[b]`` is at position ``lengths[b] - counts[b] + j`` and sees positions at or
    before it (causal within the new tokens); queries ``j >= counts[b]`` get 0. Returns
    ``[B, T, H, D]`` in ``q``'s dtype.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    block_table, lengths = jnp.asarray(block_table), jnp.asarray(lengths)
    decode = q.ndim == 3
    if decode:
        q = q[:, None]
    b, t, h, d = q.shape
    kh, _, p, _ = k_pages.shape[-4:]
    g = h // kh
    counts = jnp.full((b,), t, jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
    lengths = lengths.astype(jnp.int32)
    j = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_pos = jnp.where(j < counts[:, None], lengths[:, None] - counts[:, None] + j, -1)  # [B, T]

    table = _padded_table(block_table, chunk_blocks)  # [B, M'], whole chunks
    padded = table.shape[1]
    span = chunk_blocks * p
    scale = 1.0 / math.sqrt(d)
    qg = q.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]

    def gather(pages, ids):  # ids [B, C] -> [B, C, K, P, D]
        if layer is None:
            return pages[:, ids].transpose(1, 2, 0, 3, 4)  # [K, B, C, P, D] -> [B, C, K, P, D]
        return pages[layer, :, ids]  # layer, ids split by a slice: [B, C, K, P, D]

    def body(c, carry):
        m_run, l_run, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, D]
        ids = jax.lax.dynamic_slice_in_dim(table, c * chunk_blocks, chunk_blocks, axis=1)
        kc = gather(k_pages, ids)  # [B, C, K, P, D]
        vc = gather(v_pages, ids)  # [B, C, K, P, D]
        s = jnp.einsum("bkgtd,bckpd->bkgtcp", qg, kc.astype(q.dtype),
                       preferred_element_type=jnp.float32)
        s = s.reshape(b, kh, g, t, span) * scale  # [B, K, G, T, S]
        key_pos = c * span + jnp.arange(span, dtype=jnp.int32)  # [S]
        visible = ((key_pos[None, None, :] <= q_pos[:, :, None])
                   & (key_pos[None, None, :] < lengths[:, None, None]))  # [B, T, S]
        visible = visible[:, None, None]  # [B, 1, 1, T, S]
        m_new = jnp.maximum(m_run, jnp.where(visible, s, _MASK_VALUE).max(-1))
        probs = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)  # [B, K, G, T, S]
        correction = jnp.exp(m_run - m_new)
        l_new = l_run * correction + probs.sum(-1)
        probs = probs.reshape(b, kh, g, t, chunk_blocks, p).astype(vc.dtype)
        pv = jnp.einsum("bkgtcp,bckpd->bkgtd", probs, vc, preferred_element_type=jnp.float32)
        return m_new, l_new, acc * correction[..., None] + pv

    init = (jnp.full((b, kh, g, t), _MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g, t), jnp.float32),
            jnp.zeros((b, kh, g, t, d), jnp.float32))
    trips = jnp.minimum(chunk_count(lengths, p, chunk_blocks), padded // chunk_blocks)
    _, l_run, acc = jax.lax.fori_loop(0, trips, body, init)
    # a query that saw nothing has acc 0 and l 0: output 0 (a NaN still comes through)
    out = acc / jnp.where(l_run == 0, 1.0, l_run)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)  # [B, T, H, D]
    return out[:, 0] if decode else out


def _padded_table(block_table: jax.Array, multiple: int) -> jax.Array:
    """``block_table [B, M]`` padded with block 0 to a multiple of ``multiple`` columns."""
    m = block_table.shape[1]
    return jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, -m % multiple)))


def _scaled(q: jax.Array) -> jax.Array:
    """Queries times ``1/sqrt(D)``, which neither Pallas kernel applies."""
    return (q * (1.0 / math.sqrt(q.shape[-1]))).astype(q.dtype)


def paged_decode_attention_pallas_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                      block_table: jax.Array, lengths: jax.Array, *,
                                      pages_per_compute_block: int = 8, k_splits: int = 16,
                                      interpret: bool = False) -> jax.Array:
    """Decode attention through jax's Triton paged attention kernel. ``q [B, H, D]``, pools
    ``[K, N, P, D]`` (one layer), ``block_table [B, M]``, ``lengths [B]`` -> ``[B, H, D]``.
    The table is padded (with block 0) to a multiple of ``k_splits * pages_per_compute_block``
    as the kernel requires; it stops each row at ``cdiv(lengths[b], P)`` pages. ``interpret``:
    Pallas interpret mode (runs on a CPU)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

    m = block_table.shape[1]
    per_block = min(pages_per_compute_block, m)
    splits = max(1, min(k_splits, -(-m // per_block)))
    table = _padded_table(block_table, per_block * splits)
    return gpu_kernel.paged_attention(
        _scaled(q), k_pages, v_pages, table, lengths.astype(jnp.int32),
        pages_per_compute_block=per_block, k_splits=splits, interpret=interpret,
        mask_value=_MASK_VALUE)


def paged_decode_attention_pallas_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                      block_table: jax.Array, lengths: jax.Array, *,
                                      pages_per_compute_block: int = 8,
                                      interpret: bool = False) -> jax.Array:
    """Decode attention through jax's Mosaic TPU paged attention kernel; arguments as
    ``paged_decode_attention_pallas_gpu``. ``interpret``: TPU interpret mode
    (``pltpu.force_tpu_interpret_mode``, runs on a CPU). Rows of length 0 get 0."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel

    per_block = min(pages_per_compute_block, block_table.shape[1])
    table = _padded_table(block_table, per_block)
    lengths = lengths.astype(jnp.int32)

    def call():
        return tpu_kernel(_scaled(q), k_pages, v_pages, lengths, table,
                          pages_per_compute_block=per_block, mask_value=_MASK_VALUE)

    if interpret:
        with pltpu.force_tpu_interpret_mode():
            out = call()
    else:
        out = call()
    return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros((), out.dtype))


def resolve_impl(impl: str = "auto") -> str:
    """The implementation ``impl`` names on this backend: "auto" is "pallas_gpu" on a CUDA
    GPU, "pallas_tpu" on a TPU, else "xla"."""
    if impl not in PAGED_IMPLS:
        raise ValueError(f"paged attention impl {impl!r}: one of {PAGED_IMPLS}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "tpu":
        return "pallas_tpu"
    if backend == "gpu":
        from ragen_jax.models.attention import _cuda

        return "pallas_gpu" if _cuda() else "xla"
    return "xla"


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_table: jax.Array, lengths: jax.Array, *, impl: str = "auto",
                           layer: int | jax.Array | None = None,
                           chunk_blocks: int = DEFAULT_CHUNK_BLOCKS, interpret: bool = False,
                           pages_per_compute_block: int = 8) -> jax.Array:
    """Decode attention ``q [B, H, D]`` over the paged cache -> ``[B, H, D]`` (see the module
    docstring), by ``impl`` (``PAGED_IMPLS``, ``resolve_impl``). Pools ``[K, N, P, D]``, or
    ``[L, K, N, P, D]`` with ``layer``; ``lengths [B]``: tokens held, the current one included.
    ``chunk_blocks``: the portable loop's blocks per chunk; ``pages_per_compute_block``: the
    kernels'; ``interpret``: run a Pallas kernel in interpret mode (tests on a CPU)."""
    impl = resolve_impl(impl)
    if impl == "xla":
        return paged_attention_xla(q, k_pages, v_pages, block_table, lengths, layer=layer,
                                   chunk_blocks=chunk_blocks)
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    kernel = (paged_decode_attention_pallas_gpu if impl == "pallas_gpu"
              else paged_decode_attention_pallas_tpu)
    return kernel(q, k_pages, v_pages, block_table, lengths, interpret=interpret,
                  pages_per_compute_block=pages_per_compute_block)
