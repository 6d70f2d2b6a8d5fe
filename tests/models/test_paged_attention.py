"""The paged KV cache and its attention: the portable loop equals dense ``attend`` over the same
keys laid out contiguously, stops at the longest row, round-trips writes, shares prompt blocks;
the host allocator keeps its counts; the Pallas kernels (interpret mode) agree with the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragen_jax.models import QwenConfig
from ragen_jax.models.attention import attend, mask_causal
from ragen_jax.models.paged_attention import (
    chunk_count,
    paged_attention_xla,
    paged_decode_attention,
    resolve_impl,
)
from ragen_jax.models.paged_cache import (
    BlockAllocator,
    OutOfBlocks,
    PagedKVCache,
    blocks_for_budget,
    bytes_per_block,
    right_pad,
    write_tokens,
)

TOL = 2e-5


def _pools(rng, k, n, p, d, dtype=np.float32):
    return (rng.normal(size=(k, n, p, d)).astype(dtype), rng.normal(size=(k, n, p, d)).astype(dtype))


def _dense(k_pages, v_pages, table):
    """The rows' keys [B, K, D, M * P] and values [B, K, M * P, D], contiguous (``KVCache``)."""
    kh, _, p, d = k_pages.shape
    b, m = table.shape
    k = np.asarray(k_pages)[:, table].reshape(kh, b, m * p, d)  # [K, B, S, D]
    v = np.asarray(v_pages)[:, table].reshape(kh, b, m * p, d)
    return k.transpose(1, 0, 3, 2), v.transpose(1, 0, 2, 3)


def _dense_attend(q, k_pages, v_pages, table, lengths, counts=None):
    """``attend`` over the contiguous layout: q [B, T, H, D], query j of row b at position
    lengths - counts + j seeing the positions at or before it. -> [B, T, H, D]."""
    b, t, h, d = q.shape
    kh = k_pages.shape[0]
    counts = np.full(b, t) if counts is None else np.asarray(counts)
    k, v = _dense(k_pages, v_pages, table)
    s = k.shape[-1]
    q_pos = np.asarray(lengths)[:, None] - counts[:, None] + np.arange(t)[None]  # [B, T]
    mask = (np.arange(s)[None, None, :] <= q_pos[:, :, None]) & (q_pos[:, :, None] >= 0)
    qg = jnp.asarray(q).reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4)
    out = attend(qg, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    return np.asarray(out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d))


_decode = jax.jit(paged_attention_xla, static_argnames=("chunk_blocks",))


@pytest.mark.parametrize("b,kh,g,d,p,m,chunk", [
    (5, 1, 1, 8, 4, 6, 1),     # MHA, one block per chunk
    (6, 2, 3, 16, 4, 7, 3),    # GQA, table width not a multiple of the chunk
    (4, 2, 7, 32, 8, 5, 2),    # the 0.5B grouping (14 heads over 2)
])
def test_decode_matches_dense(b, kh, g, d, p, m, chunk):
    rng = np.random.default_rng(b * 100 + g)
    n = b * m + 3
    k_pages, v_pages = _pools(rng, kh, n, p, d)
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)  # shuffled blocks
    lengths = rng.integers(1, m * p, size=b).astype(np.int32)
    lengths[0], lengths[1] = 0, m * p  # empty and full rows
    q = rng.normal(size=(b, kh * g, d)).astype(np.float32)
    got = np.asarray(_decode(q, k_pages, v_pages, table, lengths, chunk_blocks=chunk))
    ref = _dense_attend(q[:, None], k_pages, v_pages, table, lengths)[:, 0]
    np.testing.assert_allclose(got[1:], ref[1:], atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(got[0], 0.0)  # nothing to see: 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_decode_matches_dense_random_tables(data):
    b, kh, g, d, p, m = 4, 2, 2, 8, 4, 6  # one shape: one compile
    n = data.draw(st.integers(b * m, b * m + 8))
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    k_pages, v_pages = _pools(rng, kh, 32, p, d)
    # rows may point at the same blocks (a shared prompt), anywhere in the pool
    table = rng.integers(0, min(n, 32), size=(b, m)).astype(np.int32)
    lengths = np.asarray(data.draw(st.lists(st.integers(0, m * p), min_size=b, max_size=b)),
                         np.int32)
    q = rng.normal(size=(b, kh * g, d)).astype(np.float32)
    got = np.asarray(_decode(q, k_pages, v_pages, table, lengths, chunk_blocks=2))
    ref = _dense_attend(q[:, None], k_pages, v_pages, table, lengths)[:, 0]
    real = lengths > 0
    np.testing.assert_allclose(got[real], ref[real], atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(got[~real], 0.0)


def test_loop_stops_at_the_longest_row():
    """One compiled function: with short rows it never reads past the chunk holding the
    longest row (blocks there are NaN and the result stays exact); with long rows it reads
    them all."""
    rng = np.random.default_rng(1)
    b, kh, g, d, p, m, chunk = 3, 2, 2, 8, 4, 8, 2
    n = b * m + 1
    k_pages, v_pages = _pools(rng, kh, n, p, d)
    poison = n - 1
    k_pages[:, poison], v_pages[:, poison] = np.nan, np.nan
    table = rng.permutation(n - 1).reshape(b, m).astype(np.int32)
    q = rng.normal(size=(b, kh * g, d)).astype(np.float32)
    fn = jax.jit(lambda *a: paged_attention_xla(*a, chunk_blocks=chunk))

    short = np.array([3, 8, 5], np.int32)  # one chunk of 2 blocks (8 slots) covers every row
    assert int(chunk_count(jnp.asarray(short), p, chunk)) == 1
    poisoned = table.copy()
    poisoned[:, chunk:] = poison  # every block past the first chunk
    got = np.asarray(fn(q, k_pages, v_pages, poisoned, short))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _dense_attend(q[:, None], k_pages, v_pages, table,
                                                  short)[:, 0], atol=TOL, rtol=TOL)

    long = np.array([3, m * p, 17], np.int32)  # the same program runs all 4 chunks
    assert int(chunk_count(jnp.asarray(long), p, chunk)) == m // chunk
    got = np.asarray(fn(q, k_pages, v_pages, table, long))
    np.testing.assert_allclose(got, _dense_attend(q[:, None], k_pages, v_pages, table,
                                                  long)[:, 0], atol=TOL, rtol=TOL)
    assert np.isnan(np.asarray(fn(q, k_pages, v_pages, poisoned, long))[1]).all()
    assert fn._cache_size() == 1


def _cache_case(stacked, seed=0):
    cfg = QwenConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     dtype=jnp.float32)
    b, m, p = 4, 6, 4
    alloc = BlockAllocator(num_blocks=b * m + 2, block_size=p, rows=b, max_blocks_per_row=m)
    cache = PagedKVCache.init(cfg, b, alloc.num_blocks, m, p, stacked=stacked)
    return cfg, alloc, cache, np.random.default_rng(seed)


@pytest.mark.parametrize("stacked", [True, False])
def test_write_then_attend_round_trip(stacked):
    """Prefill (right-padded, per-row counts, a row with 0) and then decode steps written at
    each row's own length; attention over the pages equals attention over each row's tokens
    concatenated in order."""
    cfg, alloc, cache, rng = _cache_case(stacked)
    b, kh, d, h = cache.batch, 2, 8, 4
    layers = cfg.num_hidden_layers
    own_k = [[[] for _ in range(b)] for _ in range(layers)]  # per layer, row: [K, D] tokens
    own_v = [[[] for _ in range(b)] for _ in range(layers)]
    # scrambled free list, so rows' blocks are not in pool order
    alloc._free = list(rng.permutation(alloc.num_blocks))

    def step(t, counts):
        nonlocal cache
        for row in range(b):
            alloc.reserve(row, int(alloc.lengths[row]) + int(counts[row]))
        cache = cache.with_table(alloc.table)
        for layer in range(layers):
            k = rng.normal(size=(b, t, kh, d)).astype(np.float32)
            v = rng.normal(size=(b, t, kh, d)).astype(np.float32)
            cache = cache.write_layer(layer, jnp.asarray(k), jnp.asarray(v), jnp.asarray(counts))
            for row in range(b):
                own_k[layer][row] += list(k[row, :counts[row]])
                own_v[layer][row] += list(v[row, :counts[row]])
        cache = cache.advance(jnp.asarray(counts))

    step(7, np.array([7, 3, 0, 5], np.int32))  # prefill
    for _ in range(4):
        step(1, np.array([1, 1, 0, 1], np.int32))  # row 2 never starts
    step(3, np.array([2, 0, 3, 1], np.int32))  # a multi-token continuation
    lengths = np.asarray(cache.lengths)
    np.testing.assert_array_equal(lengths, [13, 7, 3, 10])
    np.testing.assert_array_equal(lengths, alloc.lengths)

    q = rng.normal(size=(b, h, d)).astype(np.float32)
    for layer in range(layers):
        s = int(lengths.max())
        k = np.zeros((b, kh, d, s), np.float32)
        v = np.zeros((b, kh, s, d), np.float32)
        for row in range(b):
            n = lengths[row]
            k[row, :, :, :n] = np.stack(own_k[layer][row], axis=-1)  # [K, D, n]
            v[row, :, :n] = np.stack(own_v[layer][row], axis=1)  # [K, n, D]
        mask = np.arange(s)[None, None, :] < lengths[:, None, None]  # [B, 1, S]
        ref = np.asarray(attend(jnp.asarray(q.reshape(b, kh, 2, 1, d)), k, v, mask))
        ref = ref.reshape(b, h, d)
        if stacked:
            got = paged_decode_attention(q, cache.k, cache.v, cache.block_table, cache.lengths,
                                         impl="xla", layer=jnp.int32(layer), chunk_blocks=2)
        else:
            got = paged_decode_attention(q, cache.k[layer], cache.v[layer], cache.block_table,
                                         cache.lengths, impl="xla", chunk_blocks=2)
        np.testing.assert_allclose(np.asarray(got), ref, atol=TOL, rtol=TOL)


def test_prefill_attention_is_causal_per_row():
    """T > 1 queries, each row at its own offset with its own count: equal to ``attend`` with
    the causal mask over the contiguous layout; padding queries get 0."""
    rng = np.random.default_rng(3)
    b, kh, g, d, p, m, t = 4, 2, 2, 8, 4, 6, 5
    k_pages, v_pages = _pools(rng, kh, b * m, p, d)
    table = rng.permutation(b * m).reshape(b, m).astype(np.int32)
    counts = np.array([5, 2, 0, 1], np.int32)
    lengths = np.array([5, 11, 9, 24], np.int32)  # row 0 is a fresh prefill
    q = rng.normal(size=(b, t, kh * g, d)).astype(np.float32)
    got = np.asarray(jax.jit(paged_attention_xla)(q, k_pages, v_pages, table, lengths, counts))
    ref = _dense_attend(q, k_pages, v_pages, table, lengths, counts)
    for row in range(b):
        np.testing.assert_allclose(got[row, :counts[row]], ref[row, :counts[row]], atol=TOL,
                                   rtol=TOL)
        np.testing.assert_array_equal(got[row, counts[row]:], 0.0)
    # a fresh prefill over the pages equals causal attention among the tokens themselves
    tokens_k, tokens_v = _dense(k_pages, v_pages, table[:1])
    mask = mask_causal(jnp.ones((1, t), bool))
    qg = jnp.asarray(q[:1]).reshape(1, t, kh, g, d).transpose(0, 2, 3, 1, 4)
    own = attend(qg, tokens_k[..., :t], tokens_v[:, :, :t], mask)
    np.testing.assert_allclose(got[0], np.asarray(own.transpose(0, 3, 1, 2, 4)).reshape(t, -1, d),
                               atol=TOL, rtol=TOL)


def test_shared_prefix_blocks_equal_copied_prompts():
    """Rows forked from a prompt ending mid-block share its full blocks (one copy in the
    pool) and get a copy of its partial block; after each writes its own tokens, attention
    equals rows that hold their own copy of the prompt."""
    cfg, alloc, cache, rng = _cache_case(stacked=False, seed=5)
    kh, d, h, p = 2, 8, 4, alloc.block_size
    prompt = 10  # two full blocks and a partial one
    prompt_k = rng.normal(size=(1, prompt, kh, d)).astype(np.float32)
    prompt_v = rng.normal(size=(1, prompt, kh, d)).astype(np.float32)

    def write(cache, rows, k, v, counts):
        """``k, v [R, T, K, D]`` for ``rows`` only (the others write nothing)."""
        b, t = cache.batch, k.shape[1]
        full_k = np.zeros((b, t, kh, d), np.float32)
        full_v = np.zeros((b, t, kh, d), np.float32)
        all_counts = np.zeros(b, np.int32)
        full_k[rows], full_v[rows], all_counts[rows] = k, v, counts
        for layer in range(cfg.num_hidden_layers):
            cache = cache.write_layer(layer, jnp.asarray(full_k), jnp.asarray(full_v),
                                      jnp.asarray(all_counts))
        return cache.advance(jnp.asarray(all_counts))

    # shared: row 0 holds the prompt, rows 1..3 fork from it, row 0 ends
    alloc.reserve(0, prompt)
    shared = write(cache.with_table(alloc.table), [0], prompt_k, prompt_v, [prompt])
    copies = alloc.fork(0, [1, 2, 3])
    assert len(copies) == 3 and len({dst for _, dst in copies}) == 3
    src, dst = map(jnp.asarray, zip(*copies, strict=True))
    shared = shared.copy_blocks(src, dst)
    full_blocks = alloc.table[0, :prompt // p].copy()
    alloc.release(0)
    assert (alloc.refcount[full_blocks] == 3).all()  # held once, by three rows
    shared = shared.with_table(alloc.table, alloc.lengths)
    alloc.check()

    # copied: every row writes the prompt itself, in blocks of its own
    solo = BlockAllocator(alloc.num_blocks, p, 4, alloc.max_blocks_per_row)
    for row in (1, 2, 3):
        solo.reserve(row, prompt)
    copied = write(cache.with_table(solo.table), [1, 2, 3], np.repeat(prompt_k, 3, 0),
                   np.repeat(prompt_v, 3, 0), [prompt] * 3)

    own = rng.normal(size=(2, 3, 5, kh, d)).astype(np.float32)  # each row's own tokens
    counts = np.array([5, 1, 3], np.int32)
    for a in (alloc, solo):
        for row, c in zip((1, 2, 3), counts, strict=True):
            a.reserve(row, prompt + int(c))
    shared = write(shared.with_table(alloc.table), [1, 2, 3], own[0], own[1], counts)
    copied = write(copied.with_table(solo.table), [1, 2, 3], own[0], own[1], counts)
    assert (alloc.refcount[full_blocks] == 3).all()  # the frozen blocks were not written
    np.testing.assert_array_equal(np.asarray(shared.lengths), np.asarray(copied.lengths))

    q = rng.normal(size=(4, h, d)).astype(np.float32)
    for layer in range(cfg.num_hidden_layers):
        a = paged_decode_attention(q, shared.k[layer], shared.v[layer], shared.block_table,
                                   shared.lengths, impl="xla")
        c = paged_decode_attention(q, copied.k[layer], copied.v[layer], copied.block_table,
                                   copied.lengths, impl="xla")
        np.testing.assert_allclose(np.asarray(a)[1:], np.asarray(c)[1:], atol=TOL, rtol=TOL)
    # and the shared pool holds the prompt's full blocks once, not three times
    assert alloc.num_blocks - alloc.free_blocks < solo.num_blocks - solo.free_blocks


def test_right_pad():
    x = jnp.arange(12).reshape(2, 6)
    mask = jnp.array([[0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 0, 1]], bool)
    moved, counts = right_pad(x[..., None], mask)
    np.testing.assert_array_equal(counts, [3, 3])
    np.testing.assert_array_equal(moved[:, :3, 0], [[2, 3, 4], [6, 8, 11]])


def test_write_drops_padding_and_rows_with_nothing():
    rng = np.random.default_rng(7)
    k_pages = jnp.zeros((2, 6, 4, 8))
    table = jnp.asarray([[3, 1], [0, 2]], jnp.int32)
    new = jnp.asarray(rng.normal(size=(2, 3, 2, 8)), jnp.float32)
    k_out, _ = write_tokens(k_pages, k_pages, table, jnp.asarray([2, 0]), new, new,
                            jnp.asarray([3, 0]))
    k_out = np.asarray(k_out)
    # row 0: positions 2, 3 in block 3, position 4 in block 1 offset 0; row 1 writes nothing
    np.testing.assert_array_equal(k_out[:, 3, 2], np.asarray(new[0, 0]))
    np.testing.assert_array_equal(k_out[:, 3, 3], np.asarray(new[0, 1]))
    np.testing.assert_array_equal(k_out[:, 1, 0], np.asarray(new[0, 2]))
    written = np.zeros((6, 4), bool)
    written[3, 2:] = written[1, 0] = True
    assert (k_out[:, ~written] == 0).all()


# -- the host allocator ------------------------------------------------------------------------


def test_allocator_budget_and_exhaustion():
    cfg = QwenConfig.qwen2_5_0_5b(dtype=jnp.bfloat16)
    per = bytes_per_block(24, 2, 16, 64, jnp.bfloat16)
    assert per == 2 * 24 * 2 * 16 * 64 * 2
    assert blocks_for_budget(1.0, cfg, 16) == (1 << 30) // per
    alloc = BlockAllocator.from_budget(per * 5 / (1 << 30), cfg, rows=2, max_blocks_per_row=4,
                                       block_size=16)
    assert alloc.num_blocks == 5
    alloc.reserve(0, 64)  # 4 blocks
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks of 16 tokens, 1 of 5 are free"):
        alloc.reserve(1, 17)
    assert alloc.free_blocks == 1 and alloc.held[1] == 0  # a failed reserve changes nothing
    with pytest.raises(OutOfBlocks, match="a row holds at most 4"):
        alloc.reserve(0, 65)
    alloc.release(0)
    assert alloc.free_blocks == 5
    alloc.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "release", "fork"]), st.integers(0, 5),
                          st.integers(0, 40), st.integers(1, 3)), max_size=40))
def test_allocator_property(ops):
    """Any sequence of reserve / release / fork keeps the counts consistent; a row's table
    holds blocks for its length; exhaustion raises and changes nothing; releasing every row
    frees the whole pool."""
    alloc = BlockAllocator(num_blocks=12, block_size=4, rows=6, max_blocks_per_row=6)
    for op, row, n, width in ops:
        before = (alloc.table.copy(), alloc.refcount.copy(), alloc.free_blocks)
        try:
            if op == "reserve":
                alloc.reserve(row, int(alloc.lengths[row]) + n)
            elif op == "release":
                alloc.release(row)
            else:
                dsts = [r for r in range(6) if r != row and alloc.held[r] == 0][:width]
                copies = alloc.fork(row, dsts)
                partial = alloc.lengths[row] % 4 != 0
                assert len(copies) == (len(dsts) if partial else 0)
                for r in dsts:
                    full = alloc.lengths[row] // 4
                    np.testing.assert_array_equal(alloc.table[r, :full], alloc.table[row, :full])
        except OutOfBlocks:
            np.testing.assert_array_equal(alloc.table, before[0])
            np.testing.assert_array_equal(alloc.refcount, before[1])
            assert alloc.free_blocks == before[2]
        alloc.check()
        assert (alloc.held == -(-alloc.lengths // 4)).all()
    for row in range(6):
        alloc.release(row)
    assert alloc.free_blocks == 12 and not alloc.refcount.any()


# -- Pallas kernels, interpret mode --------------------------------------------------------------


def _kernel_case(d, dtype=np.float32):
    rng = np.random.default_rng(11)
    b, kh, g, p, m = 3, 2, 2, 16, 4
    n = b * m + 2
    k_pages, v_pages = _pools(rng, kh, n, p, d)
    # the TPU kernel reads keys and values as bfloat16: pools that bfloat16 holds exactly
    k_pages = np.asarray(jnp.asarray(k_pages, jnp.bfloat16).astype(dtype))
    v_pages = np.asarray(jnp.asarray(v_pages, jnp.bfloat16).astype(dtype))
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
    lengths = np.array([0, 37, m * p], np.int32)
    q = rng.normal(size=(b, kh * g, d)).astype(dtype)
    ref = np.asarray(paged_decode_attention(q, k_pages, v_pages, table, lengths, impl="xla"))
    return q, k_pages, v_pages, table, lengths, ref


def test_pallas_gpu_interpret_matches_portable():
    q, k_pages, v_pages, table, lengths, ref = _kernel_case(d=32)
    got = paged_decode_attention(q, k_pages, v_pages, table, lengths, impl="pallas_gpu",
                                 interpret=True, pages_per_compute_block=2)
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=1e-5)


def test_pallas_tpu_interpret_matches_portable():
    q, k_pages, v_pages, table, lengths, ref = _kernel_case(d=128)
    got = paged_decode_attention(q, k_pages, v_pages, table, lengths, impl="pallas_tpu",
                                 interpret=True, pages_per_compute_block=2)
    # its probabilities stay float32 (the values are exact in bfloat16)
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=1e-5)


def test_pallas_tpu_ragged_interpret_probe():
    """jax's ragged_paged_attention (interleaved [N, P, 2K, D] pool) against the portable path;
    skipped while TPU interpret mode cannot run it on a CPU."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as ragged

    q, k_pages, v_pages, table, lengths, ref = _kernel_case(d=128)
    b, kh = q.shape[0], k_pages.shape[0]
    n, p, d = k_pages.shape[1:]
    kv = np.stack([k_pages, v_pages], axis=3).transpose(1, 2, 0, 3, 4).reshape(n, p, 2 * kh, d)
    live = lengths > 0
    try:
        with pltpu.force_tpu_interpret_mode():
            got = ragged.ragged_paged_attention(
                jnp.asarray(q[live]), jnp.asarray(kv), jnp.asarray(lengths[live]),
                jnp.asarray(table[live]), jnp.arange(live.sum() + 1, dtype=jnp.int32),
                jnp.asarray([live.sum()], jnp.int32), sm_scale=d ** -0.5,
                num_kv_pages_per_block=2, num_queries_per_block=1)
            got = np.asarray(got)
    except Exception as e:  # noqa: BLE001  (the interpreter's failure, whatever its type)
        if "ReshapeTransform" in str(e):
            pytest.skip(f"TPU interpret mode cannot run ragged_paged_attention: {e!s:.200}")
        raise
    np.testing.assert_allclose(got, ref[live], atol=1e-5, rtol=1e-5)
    del b


def test_dispatcher():
    assert resolve_impl("auto") == "xla"  # on the CPU
    with pytest.raises(ValueError, match="one of"):
        resolve_impl("flash")
