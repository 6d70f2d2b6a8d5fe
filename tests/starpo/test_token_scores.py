"""Chunked token scoring equals full-vocabulary log-softmax, and never holds [B, L, V]."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.starpo.token_scores import target_logprobs, token_logprobs

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def reference(model, ids, attn, pos, temperature=1.0):
    """Full logits and log_softmax: slot j scores token j from slot j - 1, slot 0 is 0."""
    logits, _ = model(ids, pos, attn)  # [B, L, V]
    logp_all = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, ids[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros((ids.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, entropy], 1)


@functools.cache
def make_case(tie: bool = True, length: int = 23):
    """A tiny model and a batch of 3 with left padding, right padding and a hole."""
    model = Qwen2ForCausalLM(QwenConfig.tiny(**CFG, tie_word_embeddings=tie), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (3, length)), jnp.int32)
    attn = np.ones((3, length), bool)
    attn[0, :5] = False
    attn[1, -7:] = False
    attn[2, 9:12] = False
    pos = jnp.asarray(np.maximum(np.cumsum(attn, 1) - 1, 0), jnp.int32)
    return model, ids, jnp.asarray(attn), pos


@pytest.mark.parametrize("tie", [True, False])
def test_values_equal_full_log_softmax(tie):
    model, ids, attn, pos = make_case(tie)
    chunks = (1, 11, 22, 256)  # of the 22 scored slots: dividing, all, more than all

    @jax.jit
    def scores():
        hidden = model.model(ids, pos, attn)
        return (reference(model, ids, attn, pos, temperature=0.7),
                token_logprobs(model, ids, attn, pos, 0.7, chunk=5),
                [target_logprobs(model, hidden[:, :-1], ids[:, 1:], 0.7, chunk=c) for c in chunks])

    (want_logp, want_ent), (logp, ent), by_chunk = scores()
    assert logp.shape == ent.shape == ids.shape
    np.testing.assert_allclose(logp, want_logp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)
    for chunk, (logp, ent) in zip(chunks, by_chunk, strict=True):
        np.testing.assert_allclose(logp, want_logp[:, 1:], atol=1e-5, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(ent, want_ent[:, 1:], atol=1e-5, err_msg=f"chunk {chunk}")


def masked_loss(score, model, ids, attn, pos, mask, adv):
    """A policy-gradient-like loss over the mask, nonlinear in the log-probs (as PPO's)."""
    logp, ent = score(model, ids, attn, pos)
    return jnp.sum((jnp.exp(logp) * adv + 0.5 * ent) * mask) / jnp.sum(mask)


@pytest.mark.parametrize("tie", [True, False])
def test_gradients_equal_the_reference(tie):
    model, ids, attn, pos = make_case(tie)
    rng = np.random.default_rng(1)
    mask = attn & jnp.asarray(rng.random(ids.shape) < 0.5) & (jnp.arange(ids.shape[1]) > 12)
    adv = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grad(score):
        def f(p):
            return masked_loss(score, nnx.merge(graphdef, p, rest), ids, attn, pos, mask, adv)
        return jax.grad(f)(params)

    want, got = jax.jit(lambda: (
        grad(lambda *a: reference(*a, temperature=1.3)),
        grad(lambda *a: token_logprobs(*a, 1.3, chunk=4, loss_mask=mask))))()  # 3 chunks skipped
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                            strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-4, err_msg=str(path))


def test_loss_mask_keeps_masked_on_values_and_skips_empty_chunks():
    model, ids, attn, pos = make_case(length=41)
    mask = np.zeros(ids.shape, bool)
    mask[0, 33:38] = True  # chunks of 8 slots from slot 1: only the last two hold any
    mask[2, 30:32] = True
    mask = jnp.asarray(mask)

    @jax.jit
    def scores():
        def score(loss_mask):
            return token_logprobs(model, ids, attn, pos, chunk=8, loss_mask=loss_mask)
        return (reference(model, ids, attn, pos), score(None), score(mask),
                score(jnp.zeros_like(mask)))

    (want_logp, want_ent), (logp0, ent0), (logp, ent), empty = scores()
    on = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(logp)[on], np.asarray(logp0)[on])
    np.testing.assert_array_equal(np.asarray(ent)[on], np.asarray(ent0)[on])
    np.testing.assert_allclose(np.asarray(logp)[on], np.asarray(want_logp)[on], atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[on], np.asarray(want_ent)[on], atol=1e-5)
    assert not np.asarray(logp)[~on].any() and not np.asarray(ent)[~on].any()
    assert not np.asarray(empty[0]).any() and not np.asarray(empty[1]).any()


def test_grad_never_materialises_full_vocabulary_logits():
    """XLA's temporaries for the gradient beyond the decoder's own: several [B, L, V] float32
    arrays with full logits, a small fraction of one chunked."""
    batch, length, vocab = 2, 1024, 16384
    cfg = QwenConfig.tiny(**{**CFG, "vocab_size": vocab, "num_hidden_layers": 1})
    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    attn = jax.ShapeDtypeStruct((batch, length), bool)
    mask = jax.ShapeDtypeStruct((batch, length), jnp.float32)

    def decoder_only(model, ids, attn, pos):
        hidden = model.model(ids, pos, attn)
        return jnp.sum(hidden, -1), jnp.zeros(ids.shape)

    def temp_bytes(score):
        def f(p, ids, attn, pos, mask):
            return masked_loss(score, nnx.merge(graphdef, p, rest), ids, attn, pos, mask, mask)
        compiled = jax.jit(jax.grad(f)).lower(params, ids, attn, ids, mask).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    base = temp_bytes(decoder_only)
    full_logits = batch * length * vocab * 4  # 128 MiB
    assert temp_bytes(reference) - base > 2 * full_logits
    chunked = temp_bytes(lambda *a: token_logprobs(*a, chunk=16)) - base
    assert chunked < full_logits / 8, (chunked, full_logits)


def test_wide_batches_take_fewer_positions_a_chunk(monkeypatch):
    """A chunk holds at most ``MAX_CHUNK_LOGITS`` logits: a wide batch (the collapse
    diagnostics' pairs) gets fewer positions a chunk, its values unchanged, and XLA's
    temporaries shrink with the budget."""
    from ragen_jax.starpo import token_scores

    model, ids, attn, pos = make_case()
    hidden = jax.jit(lambda: model.model(ids, pos, attn))()
    want = jax.jit(lambda: target_logprobs(model, hidden[:, :-1], ids[:, 1:], chunk=256))()
    monkeypatch.setattr(token_scores, "MAX_CHUNK_LOGITS", 3 * 2 * 64)  # 2 positions a chunk
    got = jax.jit(lambda: target_logprobs(model, hidden[:, :-1], ids[:, 1:], chunk=256))()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    batch, length, vocab = 8, 128, 16384
    cfg = QwenConfig.tiny(**{**CFG, "vocab_size": vocab, "num_hidden_layers": 1})
    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    h = jax.ShapeDtypeStruct((batch, length, CFG["hidden_size"]), jnp.float32)
    t = jax.ShapeDtypeStruct((batch, length), jnp.int32)

    graphdef, state = nnx.split(abstract)

    def temp_bytes(budget):
        monkeypatch.setattr(token_scores, "MAX_CHUNK_LOGITS", budget)
        f = jax.jit(lambda s, h, t: target_logprobs(nnx.merge(graphdef, s), h, t, chunk=length))
        return f.lower(state, h, t).compile().memory_analysis().temp_size_in_bytes

    full = batch * length * vocab  # 64 MiB of float32 logits in one chunk
    assert temp_bytes(full // 16) < temp_bytes(full) / 8
