"""The decoder's KV cache: per-layer keys and values in the layout decoding reads in place,
with the slot bookkeeping the sampler and the trainer share (see ``models/qwen.py`` for the
attention-mask semantics), one layer's write into it, and the rotary positions of a padded
chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from ragen_jax.models.qwen_config import QwenConfig


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values plus slot bookkeeping; a pytree (donate it to jitted calls).

    All sequences share the write index: a call with ``T`` tokens writes slots
    ``[index, index + T)`` of every row. ``valid`` records which slots hold real tokens, so a
    finished sequence or a short observation simply leaves invalid slots behind.
    """

    # Heads before slots, so the attention matmuls read the cache in place (batch dims B, K
    # leading), and keys transposed (slots last) so both products contract over a non-minor
    # dimension: q.k over D of [D, S], p.v over S of [S, D]. A [B, S, K, D] layout made XLA
    # CPU transpose the whole cache every step; keys as [S, D] made decode's q.k 5-10x slower.
    # Stacked [L, B, K, D, S] / [L, B, K, S, D] for a model with stacked layers, a tuple of
    # per-layer [B, K, D, S] / [B, K, S, D] for one with separate layers (``per_layer``).
    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    valid: jax.Array  # [B, S] bool: slot holds a real token
    index: jax.Array  # [] int32: next slot to write (shared by the batch)
    lengths: jax.Array  # [B] int32: real tokens so far, i.e. the next position id
    # A shared prefix held once per group (``with_group_prefix``): the B rows are G groups of
    # B / G consecutive rows, and every row of group g sees prefix g's real slots before its
    # own. Per-layer [G, K, D, P] / [G, K, P, D] (separate layers only), mask [G, P].
    prefix_k: tuple[jax.Array, ...] | None = None
    prefix_v: tuple[jax.Array, ...] | None = None
    prefix_valid: jax.Array | None = None

    @classmethod
    def init(cls, config: QwenConfig, batch: int, size: int, dtype=None, *,
             stacked: bool = True) -> KVCache:
        """An empty cache of ``size`` slots, in the layout of a model whose layers are
        ``stacked`` (else a tuple per layer). ``dtype`` defaults to the compute dtype."""
        dtype = dtype or config.dtype
        n, kv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        k_shape, v_shape = (batch, kv, d, size), (batch, kv, size, d)
        if stacked:
            k, v = jnp.zeros((n, *k_shape), dtype), jnp.zeros((n, *v_shape), dtype)
        else:
            k = tuple(jnp.zeros(k_shape, dtype) for _ in range(n))
            v = tuple(jnp.zeros(v_shape, dtype) for _ in range(n))
        return cls(
            k=k,
            v=v,
            valid=jnp.zeros((batch, size), bool),
            index=jnp.zeros((), jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def size(self) -> int:
        return self.valid.shape[1]

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def groups(self) -> int:
        """How many shared prefixes the rows continue (0: none)."""
        return 0 if self.prefix_valid is None else self.prefix_valid.shape[0]

    def row_valid(self) -> jax.Array:
        """``[B, P + S]``: the real slots each row attends to, its group prefix's first."""
        if not self.groups:
            return self.valid
        shared = jnp.repeat(self.prefix_valid, self.batch // self.groups, axis=0)
        return jnp.concatenate([shared, self.valid], axis=1)

    def with_group_prefix(self, prefix: KVCache) -> KVCache:
        """This (empty, per-layer) cache of ``B`` rows continuing ``prefix``'s ``G`` rows, each
        shared by ``B / G`` consecutive rows: its slots are attended in place, not copied per
        row (a group's common first prompt; decoding then reads it once per group)."""
        g, b = prefix.batch, self.batch
        if prefix.groups or g == 0 or b % g or isinstance(self.k, jax.Array):
            raise ValueError(f"a group prefix needs per-layer caches and {b} rows in groups of "
                             f"equal size over {g} prefixes (no nested prefix)")
        return self.replace(prefix_k=prefix.k, prefix_v=prefix.v, prefix_valid=prefix.valid,
                            lengths=jnp.repeat(prefix.lengths, b // g))

    def take(self, rows: jax.Array) -> KVCache:
        """The cache of batch rows ``rows [R]`` (a gather: rows may repeat)."""
        if self.groups:
            raise ValueError("rows of a cache with a group prefix cannot be taken apart")
        take = lambda x: jnp.take(x, rows, axis=-4)  # noqa: E731  (B is 4th from the end)
        return self.replace(k=jax.tree.map(take, self.k), v=jax.tree.map(take, self.v),
                            valid=self.valid[rows], lengths=self.lengths[rows])

    def grow(self, size: int) -> KVCache:
        """A copy with ``size`` slots (>= the current size); new slots are empty."""
        extra = size - self.size
        if extra < 0:
            raise ValueError(f"cannot shrink a cache of {self.size} slots to {size}")
        if extra == 0:
            return self
        pad_k = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, extra),))  # noqa: E731
        pad_v = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 2) + ((0, extra), (0, 0)))  # noqa: E731
        return self.replace(
            k=jax.tree.map(pad_k, self.k),
            v=jax.tree.map(pad_v, self.v),
            valid=jnp.pad(self.valid, ((0, 0), (0, extra))),
        )


def write_cache(layer_cache: tuple, k: jax.Array, v: jax.Array, index: jax.Array
                ) -> tuple[jax.Array, jax.Array, tuple]:
    """Writes one layer's new keys k [B, K, D, T] and values v [B, K, T, D] at slot ``index``
    of ``layer_cache = (k, v, layer)`` (see ``qwen.Qwen2Attention.decode``). Returns the layer's
    keys [B, K, D, S] and values [B, K, S, D] to attend to, and the updated cache."""
    ck, cv, layer = layer_cache
    if layer is None:  # this layer's own cache [B, K, D, S], [B, K, S, D]
        ck = k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, index))
        cv = v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, index, 0))
    else:  # the stacked cache [L, B, K, D, S], [L, B, K, S, D]
        ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), (layer, 0, 0, 0, index))
        cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (layer, 0, 0, index, 0))
        k = jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False)  # [B, K, D, S]
        v = jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False)  # [B, K, S, D]
    return k, v, (ck, cv, layer)


def positions_from_mask(mask: jax.Array, start: jax.Array | None = None) -> jax.Array:
    """Rotary positions that count real tokens only.

    ``mask[B, T]`` marks real tokens; ``start[B]`` is the number of real tokens already seen
    (``cache.lengths``). Real token j of row b gets ``start[b] + (#real tokens before j)``;
    padding gets the position of the next real token (any value works, it is masked).
    """
    mask = mask.astype(jnp.int32)
    pos = jnp.cumsum(mask, axis=-1) - mask  # [B, T] real tokens strictly before each slot
    if start is not None:
        pos = pos + start[:, None]
    return pos.astype(jnp.int32)
