"""Gradient analysis: each reported norm equals the norm of ``jax.grad`` of that loss
component alone, on the whole batch or on one bucket's rows alone, and nothing is updated."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ragen_jax.config.resolve import update_settings
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.starpo import losses
from ragen_jax.starpo.gradient_analysis import make_gradient_analysis, reward_std_buckets
from ragen_jax.starpo.optimizer_step import TrainBatch
from ragen_jax.starpo.token_scores import token_logprobs


def _model_and_batch(rows: int = 6, length: int = 12):
    cfg = QwenConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 64, (rows, length)), jnp.int32)
    attn = jnp.asarray(np.arange(length)[None] < rng.integers(8, length + 1, (rows, 1)))
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
    mask = jnp.asarray((np.arange(length)[None] >= 4) * np.asarray(attn), jnp.float32)
    logp, _ = token_logprobs(model, ids, attn, pos)
    old = logp + jnp.asarray(rng.normal(0, 0.3, logp.shape), jnp.float32)  # some ratios clip
    adv = jnp.asarray(np.repeat(rng.normal(size=(rows, 1)), length, 1), jnp.float32)
    ref = logp + jnp.asarray(rng.normal(0, 0.2, logp.shape), jnp.float32)
    return model, TrainBatch(ids, attn, pos, mask, old, adv, ref)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _direct_norms(graphdef, params, rest, batch, cfg):
    """Each component's gradient norm on ``batch``, its loss written out in full and
    differentiated alone (compiled, the three in one program: op by op it takes several
    times as long)."""

    def loss(p, component):
        model = nnx.merge(graphdef, p, rest)
        logp, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.positions)
        term = {"pg": lambda: losses.policy_loss(logp, batch.old_logp, batch.advantages, batch.loss_mask,
                                                 cfg.clip_low, cfg.clip_high, cfg.clip_c)[0],
                "entropy": lambda: -cfg.entropy_coeff * entropy,
                "kl": lambda: cfg.kl_coef * losses.kl_penalty(logp, batch.ref_logp, cfg.kl_estimator)}[component]()
        return losses.ratio_of(losses.aggregate(term, batch.loss_mask, cfg.loss_agg_mode))

    return {c: optax.global_norm(jax.grad(loss)(params, c)) for c in ("pg", "entropy", "kl")}


def _rows(batch: TrainBatch, rows) -> TrainBatch:
    return jax.tree.map(lambda x: x[np.asarray(rows)], batch)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_component_and_bucket_norms_equal_direct_gradients(mode):
    model, batch = _model_and_batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    before = jax.tree.map(np.asarray, params)
    cfg = update_settings(entropy_coeff=0.05, kl_coef=0.1, kl_estimator="k3", loss_agg_mode=mode)
    bucket_ids = jnp.asarray([0, 2, 0, 2, 2, 0])  # bucket 1 has no rows
    norms = make_gradient_analysis(graphdef, cfg, num_buckets=3)(params, rest, batch, bucket_ids)
    split = make_gradient_analysis(graphdef, cfg, num_buckets=3, micro_batches=3)(
        params, rest, batch, bucket_ids)
    assert set(norms) == {"pg", "entropy", "kl"} | {f"bucket{k}/{c}" for k in range(3)
                                                    for c in ("pg", "entropy", "kl", "rows")}
    whole = _direct_norms(graphdef, params, rest, batch, cfg)
    buckets = {k: _direct_norms(graphdef, params, rest, _rows(batch, rows), cfg)
               for k, rows in ((0, [0, 2, 5]), (2, [1, 3, 4]))}
    for c in ("pg", "entropy", "kl"):
        assert float(whole[c]) > 0
        assert float(norms[c]) == pytest.approx(float(whole[c]), rel=1e-4), c
        for k, expected in buckets.items():
            assert float(norms[f"bucket{k}/{c}"]) == pytest.approx(float(expected[c]), rel=1e-4), (k, c)
        assert float(norms[f"bucket1/{c}"]) == 0.0
        for k in ("", "bucket0/", "bucket2/"):  # micro-batched accumulation is exact
            assert float(split[k + c]) == pytest.approx(float(norms[k + c]), rel=1e-4)
    assert [float(norms[f"bucket{k}/rows"]) for k in range(3)] == [3.0, 0.0, 3.0]
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # analysis only: params untouched


def test_components_follow_the_coefficients():
    model, batch = _model_and_batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    norms = make_gradient_analysis(graphdef, update_settings(entropy_coeff=0.0), 2)(
        params, rest, batch, jnp.zeros(6, jnp.int32))
    assert {k for k in norms if "/" not in k} == {"pg"}  # no entropy bonus, no KL: pg only
    assert float(norms["bucket0/pg"]) == pytest.approx(float(norms["pg"]), rel=1e-5)


def test_reward_std_buckets_rank_groups_into_equal_counts():
    stds = np.array([0.5, 0.0, 2.0, 1.0, 0.2, 3.0, 0.1])  # 7 groups, 3 buckets: 2, 2, 3
    scores = np.stack([np.array([-s, s]) / np.sqrt(2) for s in stds])  # unbiased std = s
    bucket, means = reward_std_buckets(scores, 3)
    assert bucket.tolist() == [1, 0, 2, 2, 1, 2, 0]
    np.testing.assert_allclose(means, [0.05, 0.35, 2.0])
    bucket, means = reward_std_buckets(scores[:2], 3)  # fewer groups than buckets
    assert bucket.tolist() == [2, 1] and np.isnan(means[0])
