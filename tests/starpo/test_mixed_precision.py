"""bfloat16 compute with float32 master weights: updates at RAGEN's learning rate land.

With weights stored in bfloat16 (ulp ~1.2e-4 at magnitude 0.02), an AdamW step of ~1e-6
rounds away for almost every weight; the run's ``model.param_dtype`` (float32 by default)
keeps the master weights and Adam's moments in float32 while ``model.dtype`` (bfloat16 in
the real-model presets) is the compute dtype. These tests compare against an all-float32
update of the same weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.config.resolve import update_settings
from ragen_jax.config.schema import ModelConfig
from ragen_jax.models import compute_copy
from ragen_jax.policy import build_actor
from ragen_jax.starpo.optimizer_step import (
    TrainBatch,
    jit_optimizer_step,
    make_optimizer,
)
from ragen_jax.starpo.token_scores import token_logprobs

SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2)
B, L = 4, 24


def batch_for(model, seed=0) -> TrainBatch:
    """A fixed batch whose old log-probs are ``model``'s (the sampler's), so ratios start at 1."""
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, model.config.vocab_size, (B, L)), jnp.int32)
    attn = jnp.ones((B, L), bool)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    mask = jnp.asarray(np.arange(L)[None] >= L // 2, jnp.float32) * jnp.ones((B, 1))
    old, _ = token_logprobs(compute_copy(model), ids, attn, pos)
    adv = jnp.asarray(rng.normal(size=(B, 1)), jnp.float32) * mask
    return TrainBatch(ids, attn, pos, mask, old, adv)


def train(model_config: ModelConfig, lr: float, steps: int):
    """``steps`` actor updates on one fixed batch; returns (weights before, after, losses)."""
    actor = build_actor(model_config, seed=0)
    batch = batch_for(actor)
    graphdef, params, rest = nnx.split(actor, nnx.Param, ...)
    before = jax.tree.map(np.asarray, params)
    config = update_settings(lr=lr, weight_decay=0.0, entropy_coeff=0.0)
    step = jit_optimizer_step(graphdef, config)
    opt_state = make_optimizer(config).init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, metrics = step(params, rest, opt_state, batch)
        losses.append(float(metrics["actor/pg_loss"]))
    return before, jax.tree.map(np.asarray, params), losses


@functools.cache
def float32_train(lr: float, steps: int):
    """``train`` all in float32: the reference every bf16-compute run is held to, trained once
    for all the tests that compare with it."""
    return train(ModelConfig(**SMALL), lr, steps)


def test_real_model_presets_store_float32_master_weights():
    actor = build_actor(ModelConfig(dtype="bfloat16", **SMALL), seed=0)
    leaves = jax.tree.leaves(nnx.state(actor, nnx.Param))
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}
    sampled = jax.tree.leaves(nnx.state(compute_copy(actor), nnx.Param))
    assert {x.dtype for x in sampled} == {jnp.dtype(jnp.bfloat16)}  # the sampler's copy


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_small_updates_land_as_in_float32(param_dtype):
    """At lr 1e-6, three Adam steps with bf16 compute move the stored weights as the
    all-float32 update does; with bf16 storage (the old behaviour) most updates vanish."""
    ref_before, ref_after, _ = float32_train(1e-6, 3)
    before, after, _ = train(ModelConfig(dtype="bfloat16", param_dtype=param_dtype, **SMALL), 1e-6, 3)
    ref_delta = np.concatenate([(a - b).ravel() for a, b in
                                zip(jax.tree.leaves(ref_after), jax.tree.leaves(ref_before), strict=True)])
    delta = np.concatenate([(a.astype(np.float32) - b.astype(np.float32)).ravel() for a, b in
                            zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)])
    moved = np.mean(ref_delta != 0)
    assert moved > 0.95  # float32: (almost) every weight moves by ~3e-6
    if param_dtype == "bfloat16":
        assert np.mean(delta != 0) < 0.5 * moved  # the bug this guards against
        return
    assert np.mean(delta != 0) > 0.95 * moved
    # Adam's steps are ~lr * sign(gradient): bf16 compute flips few signs.
    assert np.mean(np.sign(delta) == np.sign(ref_delta)) > 0.9
    np.testing.assert_allclose(np.abs(delta).mean(), np.abs(ref_delta).mean(), rtol=0.1)


def test_loss_decreases_with_bf16_compute_as_in_float32():
    _, _, ref = float32_train(1e-4, 4)
    _, _, mixed = train(ModelConfig(dtype="bfloat16", **SMALL), 1e-4, 4)
    assert ref[-1] < ref[0] and mixed[-1] < mixed[0]
    drop, ref_drop = mixed[0] - mixed[-1], ref[0] - ref[-1]
    assert drop == pytest.approx(ref_drop, rel=0.2)
