"""A paged KV cache: keys and values held in fixed-size blocks of a shared pool, each batch row
owning a list of blocks (its block table) and its own length, so a row writes at its own
position and decode reads only the blocks rows hold (``paged_attention.py``), not a dense
``[B, S]`` capacity.

Device side (``PagedKVCache``, a pytree, and pure jittable functions): the pools, the block
table and the per-row lengths; ``write_tokens`` writes ``T`` new tokens per row at each row's
own length; ``copy_blocks`` copies whole blocks (a shared prefix's partial last block, once per
row). Host side (``BlockAllocator``, numpy): which blocks are free, which rows hold which, and
reference counts for blocks several rows share.

Shapes: L layers, K key/value heads, N blocks in the pool, P block size (tokens per block), D
head dim, B rows, M blocks per row at most (``max_blocks_per_row``), T new tokens per row.

Layout. One layer's keys and values are each ``[K, N, P, D]``: the layout of jax's Pallas paged
attention kernels (``jax.experimental.pallas.ops.gpu.paged_attention``, Triton, and
``...ops.tpu.paged_attention``), so those kernels read the pool in place (a ``[N, K, P, D]``
pool would need a transpose of the whole pool per call: a full read and write of everything
held, the cost paging exists to avoid). A block of one head is ``P * D`` contiguous elements
(4 KiB at P = 16, D = 128, bf16), large enough for a gather of blocks to read at full
bandwidth. Keys are not transposed (unlike ``KVCache``): both kernels contract ``q . k`` over
the minor D of ``[P, D]``. A model with stacked layers keeps ``[L, K, N, P, D]`` (the portable
attention gathers a layer's blocks from it in place, ``layer=``); one with separate layers a
tuple of ``[K, N, P, D]`` (what the Pallas kernels take without slicing a layer out).

Writes. ``write_tokens`` takes right-padded new tokens: row b's first ``counts[b]`` tokens are
real and go to positions ``lengths[b] .. lengths[b] + counts[b] - 1``; the rest (and all of a
row with ``counts[b] == 0``) are dropped. A left-padded batch (the sampler's prompts) is first
moved to right padding by ``right_pad``. Every position written must lie in a block the row's
table holds (``BlockAllocator.reserve`` before the call); a position past the table is dropped.

Sharing. Rows may point at the same physical blocks (a group's prompt held once). Writes never
go to a shared block by this rule: a shared block is full and frozen, and a row's own tokens
start in a block of its own. A prefix ending mid-block has its partial last block copied per
row (``BlockAllocator.fork`` returns the copies, ``copy_blocks`` makes them), so no
copy-on-write is ever needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from ragen_jax.models.qwen_config import QwenConfig

DEFAULT_BLOCK_SIZE = 16


def bytes_per_block(layers: int, kv_heads: int, block_size: int, head_dim: int,
                    dtype) -> int:
    """Bytes one block takes over all layers, keys and values: 2 * L * K * P * D * itemsize."""
    return 2 * layers * kv_heads * block_size * head_dim * jnp.dtype(dtype).itemsize


def blocks_for_budget(gib: float, config: QwenConfig, block_size: int = DEFAULT_BLOCK_SIZE,
                      dtype=None) -> int:
    """How many blocks of ``config``'s model fit in ``gib`` GiB (``dtype`` defaults to the
    compute dtype)."""
    per = bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, block_size,
                          config.head_dim, dtype or config.dtype)
    return int(gib * (1 << 30)) // per


@flax.struct.dataclass
class PagedKVCache:
    """Pools of key/value blocks, the block table and per-row lengths; a pytree (donate it).

    Row b's token at position p lives in block ``block_table[b, p // P]`` at offset ``p % P``.
    Table entries past a row's blocks are ignored (any in-range index; the allocator writes 0).
    """

    k: jax.Array | tuple[jax.Array, ...]  # [L, K, N, P, D] or L x [K, N, P, D]
    v: jax.Array | tuple[jax.Array, ...]  # [L, K, N, P, D] or L x [K, N, P, D]
    block_table: jax.Array  # [B, M] int32: physical block of each row's logical block
    lengths: jax.Array  # [B] int32: tokens held per row, i.e. the next position to write

    @classmethod
    def init(cls, config: QwenConfig, batch: int, num_blocks: int, max_blocks_per_row: int,
             block_size: int = DEFAULT_BLOCK_SIZE, dtype=None, *, stacked: bool = True
             ) -> PagedKVCache:
        """An empty cache of ``num_blocks`` blocks of ``block_size`` tokens for ``batch`` rows
        of at most ``max_blocks_per_row`` blocks, stacked ``[L, ...]`` or per layer."""
        dtype = dtype or config.dtype
        n, kv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        shape = (kv, num_blocks, block_size, d)
        if stacked:
            k, v = jnp.zeros((n, *shape), dtype), jnp.zeros((n, *shape), dtype)
        else:
            k = tuple(jnp.zeros(shape, dtype) for _ in range(n))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(n))
        return cls(k=k, v=v, block_table=jnp.zeros((batch, max_blocks_per_row), jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def stacked(self) -> bool:
        return isinstance(self.k, jax.Array)

    @property
    def block_size(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-2]

    @property
    def num_blocks(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-3]

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    def layer_pages(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Layer ``layer``'s pools ``[K, N, P, D]`` (a slice, i.e. a copy, if stacked)."""
        return self.k[layer], self.v[layer]

    def write_layer(self, layer: int | jax.Array, k: jax.Array, v: jax.Array,
                    counts: jax.Array) -> PagedKVCache:
        """This cache with layer ``layer``'s new keys and values ``k, v [B, T, K, D]``
        (right-padded, ``counts [B]`` real tokens per row) written at each row's length.
        Lengths do not move (every layer writes at the same positions): ``advance`` after."""
        if self.stacked:
            ks, vs = write_tokens(self.k, self.v, self.block_table, self.lengths, k, v, counts,
                                  layer=layer)
            return self.replace(k=ks, v=vs)
        ks, vs = write_tokens(self.k[layer], self.v[layer], self.block_table, self.lengths, k,
                              v, counts)
        return self.replace(k=_set(self.k, layer, ks), v=_set(self.v, layer, vs))

    def advance(self, counts: jax.Array) -> PagedKVCache:
        """Lengths moved on by ``counts [B]`` (after every layer has written them)."""
        return self.replace(lengths=(self.lengths + counts).astype(jnp.int32))

    def with_table(self, block_table, lengths=None) -> PagedKVCache:
        """This cache with a new block table (and lengths) from the host allocator. Host arrays
        are copied: a CPU device array may otherwise alias the allocator's numpy buffer, which
        it goes on changing in place."""
        if lengths is not None:
            lengths = jnp.asarray(np.array(lengths, np.int32))
        return self.replace(block_table=jnp.asarray(np.array(block_table, np.int32)),
                            lengths=self.lengths if lengths is None else lengths)

    def copy_blocks(self, src: jax.Array, dst: jax.Array) -> PagedKVCache:
        """Blocks ``dst [C]`` set to blocks ``src [C]`` in every layer (``copy_blocks``)."""
        if self.stacked:
            return self.replace(k=copy_blocks(self.k, src, dst), v=copy_blocks(self.v, src, dst))
        return self.replace(k=tuple(copy_blocks(x, src, dst) for x in self.k),
                            v=tuple(copy_blocks(x, src, dst) for x in self.v))


def _set(xs: tuple, i: int, x) -> tuple:
    return xs[:i] + (x,) + xs[i + 1:]


def token_slots(block_table: jax.Array, lengths: jax.Array, counts: jax.Array, t: int,
                block_size: int, num_blocks: int) -> tuple[jax.Array, jax.Array]:
    """Where each of ``t`` right-padded new tokens goes: ``(block [B, T], offset [B, T])``;
    padding, and tokens past a row's table, get block ``num_blocks`` (out of range: dropped)."""
    m = block_table.shape[1]
    pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    logical = pos // block_size  # [B, T]
    real = (jnp.arange(t)[None, :] < counts[:, None]) & (logical < m)
    block = jnp.take_along_axis(block_table, jnp.minimum(logical, m - 1), axis=1)  # [B, T]
    return jnp.where(real, block, num_blocks), pos % block_size


def write_tokens(k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                 lengths: jax.Array, k: jax.Array, v: jax.Array, counts: jax.Array,
                 layer: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes right-padded new keys/values ``k, v [B, T, K, D]`` into the pools at positions
    ``lengths[b] + j`` for ``j < counts[b]`` (nothing for a row with ``counts[b] == 0``).
    Pools ``[K, N, P, D]``, or ``[L, K, N, P, D]`` with ``layer`` the layer written. Returns
    the updated pools (donate them so XLA scatters in place)."""
    t = k.shape[1]
    p, n = k_pages.shape[-2], k_pages.shape[-3]
    block, offset = token_slots(block_table, lengths, counts.astype(jnp.int32), t, p, n)
    if layer is None:
        kt = k.transpose(2, 0, 1, 3).astype(k_pages.dtype)  # [K, B, T, D]
        vt = v.transpose(2, 0, 1, 3).astype(v_pages.dtype)  # [K, B, T, D]
        return (k_pages.at[:, block, offset].set(kt, mode="drop"),
                v_pages.at[:, block, offset].set(vt, mode="drop"))
    # layer, block and offset are advanced indices split by a slice: the indexed view is
    # [B, T, K, D] (numpy's rule), the new tokens' own layout
    return (k_pages.at[layer, :, block, offset].set(k.astype(k_pages.dtype), mode="drop"),
            v_pages.at[layer, :, block, offset].set(v.astype(v_pages.dtype), mode="drop"))


def copy_blocks(pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``pages [..., N, P, D]`` with blocks ``dst [C]`` set to blocks ``src [C]`` (a ``dst`` of
    ``N`` or more is dropped, so a padded list of copies is fine)."""
    return pages.at[..., dst, :, :].set(pages[..., jnp.minimum(src, pages.shape[-3] - 1), :, :],
                                        mode="drop")


def right_pad(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [B, T, ...]`` with each row's real tokens (``mask [B, T]``) moved to its front in
    their order, padding after (a stable partition), and the counts ``[B]`` ``write_tokens``
    takes."""
    mask = mask.astype(bool)
    order = jnp.argsort(~mask, axis=1, stable=True)  # real first, in order
    index = order.reshape(*order.shape, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, index, axis=1), mask.sum(axis=1).astype(jnp.int32)


# -- host side ---------------------------------------------------------------------------------


class OutOfBlocks(RuntimeError):
    """The block pool cannot hold what was asked of it."""


class BlockAllocator:
    """Host bookkeeping of a ``PagedKVCache``'s blocks (numpy): a free list, each row's block
    table and length, and a reference count per block (rows sharing a prompt's blocks).

    ``reserve(row, n)`` gives a row the blocks to hold ``n`` tokens; ``release(row)`` ends its
    episode (its blocks go back once no row holds them); ``fork(src, dsts)`` lets rows continue
    a row's tokens, sharing its full blocks and each getting a copy of a partial last block.
    ``table`` and ``lengths`` are what ``PagedKVCache.with_table`` takes. The device lengths
    follow ``write_tokens`` calls; the host ``lengths`` here are the tokens a row was given
    room for (``reserve``), kept in step by the caller.
    """

    def __init__(self, num_blocks: int, block_size: int, rows: int, max_blocks_per_row: int):
        if num_blocks <= 0 or block_size <= 0 or rows <= 0 or max_blocks_per_row <= 0:
            raise ValueError("a block pool needs positive sizes")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks_per_row = max_blocks_per_row
        self.refcount = np.zeros(num_blocks, np.int32)  # [N]
        self.table = np.zeros((rows, max_blocks_per_row), np.int32)  # [B, M]
        self.lengths = np.zeros(rows, np.int32)  # [B] tokens each row has room for
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first

    @classmethod
    def from_budget(cls, gib: float, config: QwenConfig, rows: int, max_blocks_per_row: int,
                    block_size: int = DEFAULT_BLOCK_SIZE, dtype=None) -> BlockAllocator:
        """An allocator over the blocks of ``config``'s model that fit in ``gib`` GiB."""
        return cls(blocks_for_budget(gib, config, block_size, dtype), block_size, rows,
                   max_blocks_per_row)

    @property
    def held(self) -> np.ndarray:
        """``[B]`` blocks each row's table holds: enough for its ``lengths``, no more (a
        row only ever gets the blocks its tokens need)."""
        return -(-self.lengths // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self, count: int, why: str) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"{why}: needs {count} more blocks of {self.block_size} tokens, "
                              f"{len(self._free)} of {self.num_blocks} are free")
        got = [self._free.pop() for _ in range(count)]
        self.refcount[got] = 1
        return got

    def reserve(self, row: int, tokens: int) -> None:
        """Gives ``row`` the blocks to hold ``tokens`` tokens in all (no-op if it has them).
        Raises ``OutOfBlocks`` (changing nothing) when the pool or the row's table is full."""
        need = self.blocks_needed(tokens)
        if need > self.max_blocks_per_row:
            raise OutOfBlocks(f"row {row}: {tokens} tokens need {need} blocks, a row holds at "
                              f"most {self.max_blocks_per_row}")
        have = int(self.held[row])
        if need > have:
            got = self._take(need - have, f"row {row} growing to {tokens} tokens")
            self.table[row, have:need] = got
        self.lengths[row] = max(int(self.lengths[row]), tokens)

    def trim(self, row: int, tokens: int) -> None:
        """Cuts ``row`` to the blocks ``tokens`` tokens need (it holds at least that many),
        giving back those it was given room in and did not fill (an answer shorter than its
        budget)."""
        need, have = self.blocks_needed(tokens), int(self.held[row])
        if tokens > self.lengths[row]:
            raise ValueError(f"row {row} has room for {self.lengths[row]} tokens, not {tokens}")
        for block in self.table[row, need:have][::-1]:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free.append(int(block))
        self.table[row, need:have] = 0
        self.lengths[row] = tokens

    def release(self, row: int) -> None:
        """Ends ``row``'s episode: its blocks are dropped (freed once no row holds them), its
        table zeroed and its length 0."""
        for block in self.table[row, :self.held[row]][::-1]:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free.append(int(block))
        self.table[row] = 0
        self.lengths[row] = 0

    def fork(self, src: int, dsts: list[int]) -> list[tuple[int, int]]:
        """Rows ``dsts`` (empty) continue ``src``'s ``lengths[src]`` tokens: they share its
        full blocks (reference counts go up) and each gets a fresh copy of its partial last
        block, if any. Returns the ``(src_block, dst_block)`` copies to make on the device
        (``PagedKVCache.copy_blocks``) before any of these rows writes."""
        length = int(self.lengths[src])
        full, partial = divmod(length, self.block_size)
        for dst in dsts:
            if self.held[dst]:
                raise ValueError(f"row {dst} holds blocks; release it before forking into it")
        if partial and len(dsts) > len(self._free):
            raise OutOfBlocks(f"forking row {src} into {len(dsts)} rows: needs {len(dsts)} "
                              f"more blocks, {len(self._free)} are free")
        copies = []
        shared = self.table[src, :full]
        for dst in dsts:
            self.table[dst, :full] = shared
            self.refcount[shared] += 1
            if partial:
                (block,) = self._take(1, f"row {dst}")
                self.table[dst, full] = block
                copies.append((int(self.table[src, full]), block))
            self.lengths[dst] = length
        return copies

    def check(self) -> None:
        """Asserts the bookkeeping is consistent (for tests): every block is free or held as
        many times as its count says."""
        counts = np.zeros(self.num_blocks, np.int32)
        for row in range(self.table.shape[0]):
            np.add.at(counts, self.table[row, :self.held[row]], 1)
        assert (counts == self.refcount).all(), (counts, self.refcount)
        free = np.zeros(self.num_blocks, bool)
        free[self._free] = True
        assert len(set(self._free)) == len(self._free)
        assert (free == (self.refcount == 0)).all()
