"""The KV cache: prefill, one-token decode and chunked continuation equal a full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import KVCache, Qwen2ForCausalLM, QwenConfig, positions_from_mask
from ragen_jax.models.attention import attend, attend_group_prefix, attention_blocks

TOL = 1e-4
CFG = QwenConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


@pytest.fixture(scope="module")
def model():
    return Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(0))


@jax.jit
def _full_jit(graphdef, state, tokens, mask):
    out, _ = nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)
    return out


def _full(model, tokens, mask):
    """Full forward pass without cache over the whole slot sequence."""
    return np.asarray(_full_jit(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(mask)))


@jax.jit
def _step(graphdef, state, tokens, mask, cache):
    """One cached call (jitted so the test runs fast)."""
    model = nnx.merge(graphdef, state)
    pos = positions_from_mask(mask, cache.lengths)
    return model(tokens, pos, mask, cache)


def test_prefill_then_decode(model):
    rng = np.random.RandomState(0)
    b, p, n = 3, 6, 5
    tokens = rng.randint(0, 512, (b, p + n))
    mask = np.ones((b, p + n), np.int32)
    mask[0, :2] = 0  # left-padded prompt
    mask[1, 4:6] = 0  # right-padded prompt (padding before the generated tokens)
    ref = _full(model, tokens, mask)

    graphdef, state = nnx.split(model)
    cache = KVCache.init(CFG, b, 16)
    logits, cache = _step(graphdef, state, jnp.asarray(tokens[:, :p]), jnp.asarray(mask[:, :p]),
                          cache)
    got = [np.asarray(logits)]
    for t in range(p, p + n):
        logits, cache = _step(graphdef, state, jnp.asarray(tokens[:, t:t + 1]),
                              jnp.asarray(mask[:, t:t + 1]), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    real = mask.astype(bool)
    assert np.abs(got - ref)[real].max() <= TOL
    assert int(cache.index) == p + n
    np.testing.assert_array_equal(np.asarray(cache.lengths), mask.sum(1))
    np.testing.assert_array_equal(np.asarray(cache.valid[:, : p + n]), real)
    assert not np.asarray(cache.valid[:, p + n:]).any()


def test_chunked_continuation_with_padding(model):
    """Multi-turn: chunks with left, right and full padding appended to one cache."""
    rng = np.random.RandomState(1)
    b = 4
    chunks = []
    for t in (4, 2, 1, 4, 2):
        m = (rng.rand(b, t) < 0.7).astype(np.int32)
        m[:, -1] = np.maximum(m[:, -1], rng.rand(b) < 0.5)
        chunks.append((rng.randint(0, 512, (b, t)), m))
    chunks[0][1][:, 0] = 1  # every row starts with a real token
    tokens = np.concatenate([c[0] for c in chunks], axis=1)
    mask = np.concatenate([c[1] for c in chunks], axis=1)
    ref = _full(model, tokens, mask)

    graphdef, state = nnx.split(model)
    cache = KVCache.init(CFG, b, 8).grow(tokens.shape[1] + 3)  # grow keeps the semantics
    got = []
    for tk, m in chunks:
        logits, cache = _step(graphdef, state, jnp.asarray(tk), jnp.asarray(m), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    real = mask.astype(bool)
    err = np.abs(got - ref)[real].max()
    assert err <= TOL, err
    np.testing.assert_array_equal(np.asarray(cache.lengths), mask.sum(1))

    # The full forward over the cache's slot sequence is the trainer's recomputation.
    slots = tokens.shape[1]
    recomputed = _full(model, tokens, np.asarray(cache.valid[:, :slots]))
    assert np.abs(recomputed - got)[real].max() <= TOL


def test_logits_at_selects_positions(model):
    rng = np.random.RandomState(2)
    tokens = jnp.asarray(rng.randint(0, 512, (3, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (3, 7))
    full, _ = model(tokens, pos)
    idx = jnp.array([6, 2, 0])
    part, _ = model(tokens, pos, logits_at=idx)
    assert part.shape == (3, 1, 512)
    np.testing.assert_allclose(np.asarray(part[:, 0]), np.asarray(full)[np.arange(3), idx],
                               atol=1e-5)


def test_attention_blocks_divide_the_per_device_batch():
    cfg = CFG.replace(attention_block_bytes=4 * 4 * 8 * 8 * 3)  # 3 rows of [H, T=8, S=8] scores
    assert attention_blocks(cfg, 12, 8, 8) == 4  # 12 rows in blocks of 3
    assert attention_blocks(cfg, 10, 8, 8) == 5  # fewest blocks >= 10 / 3 that divide 10
    assert attention_blocks(cfg, 16, 8, 8, shards=4) == 2  # 4 rows per device: 2 blocks of 2
    assert attention_blocks(cfg, 2, 8, 8) == 1  # fits
    assert attention_blocks(cfg, 10, 8, 8, shards=4) == 1  # uneven shards: left to XLA
    assert attention_blocks(CFG.replace(attention_block_bytes=0), 64, 64, 64) == 1  # off


def test_attention_blocks_bound_memory_on_accelerators_by_default(monkeypatch):
    """Unset, the budget is 1 GiB of scores on a GPU or TPU: 64 contexts of 2560 tokens
    against 2960 slots on the 0.5B shape (27 GiB of float32 scores at once) run in blocks."""
    cfg = QwenConfig.qwen2_5_0_5b()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    blocks = attention_blocks(cfg, 64, 2560, 2960)
    row_bytes = 4 * cfg.num_attention_heads * 2560 * 2960
    assert 64 % blocks == 0 and (64 // blocks) * row_bytes <= 1 << 30
    assert attention_blocks(cfg, 128, 1, 3000) == 1  # a decode step: one block


def test_blocked_attention_equals_whole_batch():
    """Cached calls with attention in row blocks give the logits of the whole batch at once."""
    rng = np.random.RandomState(3)
    b, t = 6, 9
    tokens = jnp.asarray(rng.randint(0, 512, (b, t)))
    mask = jnp.asarray(rng.rand(b, t) < 0.8).at[:, -1].set(True)
    outs = []
    row_bytes = 4 * CFG.num_attention_heads * 5 * 16  # the prefill's [H, T, S] float32 scores
    for budget, blocks in ((0, 1), (1, b), (2 * row_bytes, 3)):  # off; 1 row, 2 rows per block
        cfg = CFG.replace(attention_block_bytes=budget)
        graphdef, state = nnx.split(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
        assert attention_blocks(cfg, b, 5, 16) == blocks
        prefill, cache = _step(graphdef, state, tokens[:, :5], mask[:, :5], KVCache.init(cfg, b, 16))
        chunk, _ = _step(graphdef, state, tokens[:, 5:], mask[:, 5:], cache)
        outs.append([np.asarray(prefill), np.asarray(chunk)])
    for whole, blocked, blocked2 in zip(*outs, strict=True):
        np.testing.assert_allclose(blocked2, whole, atol=1e-5, rtol=0)
        np.testing.assert_allclose(blocked, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_group_prefix_attention_equals_attending_to_copies(blocks):
    """``attend_group_prefix`` over 3 prefixes of 2 rows each equals ``attend`` on every row's
    copy of its group's prefix before its own slots (masked slots in both parts; in blocks
    of prefixes too, 3 -> 3 blocks for 2); a wrong group assignment does not."""
    rng = np.random.RandomState(5)
    n, r, kh, g, t, d, p, s = 3, 2, 2, 2, 3, 8, 7, 5
    f = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)  # noqa: E731
    q, k, v = f(n * r, kh, g, t, d), f(n * r, kh, d, s), f(n * r, kh, s, d)
    pk, pv = f(n, kh, d, p), f(n, kh, p, d)
    pmask = jnp.asarray(rng.rand(n, p) < 0.7).at[:, 0].set(True)
    mask = jnp.asarray(rng.rand(n * r, t, s) < 0.6)
    got = attend_group_prefix(q, k, v, mask, pk, pv, pmask, blocks)
    copies = lambda a: jnp.repeat(a, r, axis=0)  # noqa: E731
    want = attend(q, jnp.concatenate([copies(pk), k], -1), jnp.concatenate([copies(pv), v], -2),
                  jnp.concatenate([jnp.broadcast_to(copies(pmask)[:, None], (n * r, t, p)), mask], -1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    shifted = attend_group_prefix(q, k, v, mask, pk[::-1], pv[::-1], pmask[::-1], blocks)
    assert not np.allclose(np.asarray(shifted), np.asarray(want), atol=1e-3)


@jax.jit
def _at(graphdef, state, tokens, mask, rows, cache):
    model = nnx.merge(graphdef, state)
    return model(tokens, positions_from_mask(mask), mask, cache, logits_at=rows)[0]


def test_logits_at_equal_the_full_forward_there(model):
    """``logits_at`` (the last layer runs only the asked-for token) gives the full forward's
    logits at those tokens, with and without a cache."""
    rng = np.random.RandomState(5)
    b, t = 4, 10
    tokens = rng.randint(0, 512, (b, t))
    mask = np.ones((b, t), bool)
    mask[0, :3] = False  # left padding
    mask[1, 7:] = False  # right padding
    rows = np.array([9, 6, 0, 4])
    ref = _full(model, tokens, mask)[np.arange(b), rows]  # [B, V]
    graphdef, state = nnx.split(model)
    args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(rows))
    for cache in (None, KVCache.init(CFG, b, 16)):
        got = np.asarray(_at(graphdef, state, *args, cache))
        assert got.shape == (b, 1, CFG.vocab_size)
        assert np.abs(got[:, 0] - ref).max() <= TOL
