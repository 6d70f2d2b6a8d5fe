"""Shared prefixes: a group's common first prompt runs once per forward pass of the update,
and everything (log-probs, values, gradients, the whole update) equals every row running
its own copy."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.sharding import make_mesh
from ragen_jax.starpo.rows import (
    RowSettings,
    after_prefix,
    build_step_batch,
    group_prefix_lengths,
    short_width,
)
from ragen_jax.starpo.token_scores import token_logprobs
from ragen_jax.starpo.update import make_update
from tests.starpo.test_update import CFG, build, copy, settings

V = CFG["vocab_size"]


@pytest.mark.parametrize("scan", [False, True])
def test_prefix_forward_equals_full_sequences(scan):
    model = Qwen2ForCausalLM(QwenConfig.tiny(**CFG, scan_layers=scan), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    plen, slen, grp = [5, 7], [6, 4, 5, 3, 6, 2], [0, 0, 0, 1, 1, 1]
    p_width, s_width = 8, 6
    pid = rng.integers(1, V, (2, p_width))
    sid = rng.integers(1, V, (6, s_width))
    pmask = np.arange(p_width)[None] < np.array(plen)[:, None]
    smask = np.arange(s_width)[None] < np.array(slen)[:, None]
    full = np.zeros((6, p_width + s_width), np.int32)
    fmask = np.zeros_like(full, bool)
    loss = np.zeros(full.shape, np.float32)
    for b, g in enumerate(grp):
        seq = [*pid[g, :plen[g]], *sid[b, :slen[b]]]
        full[b, :len(seq)], fmask[b, :len(seq)] = seq, True
        loss[b, plen[g]:len(seq)] = 1
    fpos = np.maximum(np.cumsum(fmask, 1) - 1, 0)
    spos = np.array(plen)[grp][:, None] + np.arange(s_width)[None]

    def whole(m):
        lp, ent = token_logprobs(m, full, fmask, fpos, 0.7, loss_mask=loss)
        return jnp.sum(lp * loss) + jnp.sum(ent * loss), lp

    def shared(m):
        prefix = m.model.prefix(pid, np.tile(np.arange(p_width), (2, 1)), pmask).take(jnp.array(grp))
        lp, ent = token_logprobs(m, sid, smask, spos, 0.7, loss_mask=smask, prefix=prefix)
        return jnp.sum(lp * smask) + jnp.sum(ent * smask), lp

    # Jitted: one program each (op by op, the backward pass dispatched hundreds of small ones).
    (a, lp_a), g_a = nnx.jit(nnx.value_and_grad(whole, has_aux=True))(model)
    (b, lp_b), g_b = nnx.jit(nnx.value_and_grad(shared, has_aux=True))(model)
    for row, g in enumerate(grp):
        np.testing.assert_allclose(np.asarray(lp_b)[row, :slen[row]],
                                   np.asarray(lp_a)[row, plen[g]:plen[g] + slen[row]], atol=1e-5)
    assert float(a) == pytest.approx(float(b), abs=1e-4)
    for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5)


def test_group_prefix_lengths_stop_at_the_first_difference_or_sampled_token():
    ids = np.array([[1, 2, 3, 4, 5, 6],
                    [1, 2, 3, 4, 9, 9],   # group 0: differs at slot 4, first sampled at 5
                    [1, 2, 7, 7, 7, 7],
                    [1, 2, 7, 7, 7, 7]])  # group 1: identical; first sampled at 3
    loss = np.array([[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1],
                     [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    lengths = group_prefix_lengths(ids, loss, np.array([0, 0, 1, 1]))
    np.testing.assert_array_equal(lengths, [4, 3])
    shifted = after_prefix({"input_ids": ids, "attention_mask": ids > 0}, lengths[[0, 0, 1, 1]], 4)
    np.testing.assert_array_equal(shifted["input_ids"], [[5, 6, 0, 0], [9, 9, 0, 0],
                                                         [7, 7, 7, 0], [7, 7, 7, 0]])


def rollout_like(seed: int, groups: int = 2, size: int = 4, width: int = 32):
    """A rollout batch's arrays: each group's rows share a prompt, then sampled answers and
    inserted chunks alternate."""
    rng = np.random.default_rng(seed)
    n = groups * size
    ids, attn = np.zeros((n, width), np.int32), np.zeros((n, width), bool)
    loss, rewards = np.zeros((n, width), np.float32), np.zeros((n, width), np.float32)
    turns = np.zeros((n, width), np.int16)
    for g in range(groups):
        prompt = rng.integers(1, V, int(rng.integers(6, 12)))
        for r in range(g * size, (g + 1) * size):
            length = int(rng.integers(len(prompt) + 6, width + 1))
            ids[r, :length] = np.concatenate([prompt, rng.integers(1, V, length - len(prompt))])
            attn[r, :length] = True
            sampled = np.arange(width) >= len(prompt)
            sampled &= (np.arange(width) - len(prompt)) % 7 < 4  # answers of 4, chunks of 3
            loss[r] = sampled & attn[r]
            turns[r] = np.where(attn[r], 1 + (np.arange(width) - len(prompt)).clip(0) // 7, 0)
            rewards[r, np.nonzero(loss[r])[0][-1]] = rng.normal()
    scores = rewards.sum(1)
    return types.SimpleNamespace(
        input_ids=ids, attention_mask=attn, position_ids=np.maximum(np.cumsum(attn, 1) - 1, 0),
        loss_mask=loss, model_logprobs=-rng.random((n, width)).astype(np.float32) * loss,
        token_rewards=rewards, turn_ids=turns, scores=scores.astype(np.float32),
        group_ids=np.repeat(np.arange(groups), size))


def assert_same_update(a, b):
    """Two ``update`` results ``(state, metrics)`` agree: every metric and every array."""
    (new_a, m_a), (new_b, m_b) = a, b
    for k in m_a:
        assert float(m_b[k]) == pytest.approx(float(m_a[k]), rel=1e-4, abs=1e-5), k
    for x, y in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_update_with_shared_prefixes_equals_the_update_without():
    """GAE with its critic: the actor's pass (GRPO's, with other advantages) and the critic's
    both run on the shared prefixes."""
    s = settings("gae", critic=True, recompute=True)
    _, networks, state = build(s)
    batch = rollout_like(0)
    mesh = make_mesh((1, 1, 1))
    kw = dict(group_buckets=np.array([0, 1]), mesh=mesh, rng=np.random.default_rng(0))
    keep, weights = np.ones(2, bool), np.ones(8, np.float32)
    plain = build_step_batch(batch, keep, weights, RowSettings(8, 8, share_prefixes=False), **kw)
    shared = build_step_batch(batch, keep, weights, RowSettings(8, 8, share_prefixes=True), **kw)
    assert shared.prefixes is not None and plain.prefixes is None
    assert shared.input_ids.shape[1] < plain.input_ids.shape[1]
    update = make_update(s, networks)
    new_a, m_a = update(copy(state), plain, analyse_gradients=True)
    new_b, m_b = update(copy(state), shared, analyse_gradients=True)
    assert_same_update((new_a, m_a), (new_b, m_b))


def test_update_is_the_same_at_a_tighter_row_width():
    """``actor.row_pad_multiple`` only trims padding: rows cut at a multiple of 8 train exactly as
    rows padded to a multiple of 64 (and their shared prefixes likewise)."""
    s = settings("grpo", critic=False, recompute=True)
    _, networks, state = build(s)
    batch = rollout_like(1)
    kw = dict(group_buckets=np.array([0, 1]), mesh=make_mesh((1, 1, 1)))
    keep, weights = np.ones(2, bool), np.ones(8, np.float32)
    tight = build_step_batch(batch, keep, weights, RowSettings(8, pad_multiple=8),
                             rng=np.random.default_rng(0), **kw)
    wide = build_step_batch(batch, keep, weights, RowSettings(8, pad_multiple=64),
                            rng=np.random.default_rng(0), **kw)
    assert tight.input_ids.shape[1] % 8 == 0 and wide.input_ids.shape[1] == 64
    assert tight.input_ids.shape[1] < wide.input_ids.shape[1]
    assert tight.prefixes.input_ids.shape[1] < wide.prefixes.input_ids.shape[1]
    update = make_update(s, networks)
    new_a, m_a = update(copy(state), wide)
    new_b, m_b = update(copy(state), tight)
    assert_same_update((new_a, m_a), (new_b, m_b))


def test_short_width_by_hand():
    # 2 mini-batches of 8 (rows i, i + 2, ...), 4 micro-batches: 6 rows each must fit.
    lengths = np.array([3, 30, 5, 9, 7, 4, 6, 40, 2, 5, 33, 6, 8, 7, 1, 3])
    # mini-batch 0: 3 5 7 6 2 33 8 1 -> 6th shortest 7; mini-batch 1: 30 9 4 40 5 6 7 3 -> 9;
    # rounded up to a quarter of the width (itself rounded up to pad_multiple)
    assert short_width(lengths, 8, 4, 8, 40) == 16  # quarter 10 -> 16
    assert short_width(lengths, 8, 4, 4, 40) == 12  # quarter 10 -> 12
    assert short_width(lengths, 8, 4, 16, 48) == 16
    assert short_width(lengths, 8, 4, 16, 16) == 16  # no narrower than the rows: their width
    assert short_width(lengths, 8, 1, 8, 40) is None  # one micro-batch: nothing to set apart
    assert short_width(lengths, 16, 2, 8, 40) == 16  # 8 rows must fit: the 8th shortest is 6
    assert short_width(lengths, 16, 8, 8, 40) == 32  # 14 rows must fit: the 14th shortest is 30


def test_update_with_long_rows_apart_equals_the_update_without():
    """The trainer's path: ``RowSettings(long_rows_apart=True)`` marks the narrower width
    (a few long rows), and the update (2 micro-batches, shared prefixes) equals the one
    without it."""
    s = settings("grpo", critic=False, recompute=True)
    _, networks, state = build(s)
    batch = rollout_like(2)
    lengths = batch.attention_mask.sum(1)
    batch.attention_mask[lengths.argsort()[:4]] &= np.arange(32)[None] < 20  # four short rows
    batch.loss_mask *= batch.attention_mask
    kw = dict(group_buckets=np.array([0, 1]), mesh=make_mesh((1, 1, 1)))
    keep, weights = np.ones(2, bool), np.ones(8, np.float32)
    rows = RowSettings(8, 8, share_prefixes=True, micro_batches=2)
    whole = build_step_batch(batch, keep, weights, rows, rng=np.random.default_rng(0), **kw)
    apart = build_step_batch(batch, keep, weights, dataclasses.replace(rows, long_rows_apart=True),
                             rng=np.random.default_rng(0), **kw)
    assert whole.short_width is None
    assert apart.short_width is not None and apart.short_width < apart.input_ids.shape[1]
    update = make_update(s, networks)
    assert_same_update(update(copy(state), whole), update(copy(state), apart))
