"""Losses and aggregation against hand-computed values."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import losses as L


def test_policy_loss_clip_higher_and_dual_clip():
    ratios = jnp.array([[1.5, 1.5, 5.0, 0.5, 0.7]])
    adv = jnp.array([[1.0, -1.0, -1.0, 1.0, -1.0]])
    old = jnp.zeros((1, 5))
    loss, m = L.policy_loss(jnp.log(ratios), old, adv, jnp.ones((1, 5)))
    # +A, r=1.5: clipped at 1.28. -A, r=1.5: max(1.5, 1.28) = 1.5. -A, r=5: dual clip at 3.
    # +A, r=0.5: unclipped -0.5. -A, r=0.7: max(0.7, 0.8) = 0.8 (clipped at 1 - 0.2).
    np.testing.assert_allclose(np.asarray(loss)[0], [-1.28, 1.5, 3.0, -0.5, 0.8], atol=1e-5)
    assert float(m["actor/pg_clipfrac"]) == pytest.approx(2 / 5)
    assert float(m["actor/pg_clipfrac_lower"]) == pytest.approx(1 / 5)
    assert float(m["actor/ppo_kl"]) == pytest.approx(-np.log([1.5, 1.5, 5, 0.5, 0.7]).mean(), abs=1e-6)
    big, _ = L.policy_loss(jnp.array([[100.0]]), jnp.zeros((1, 1)), jnp.array([[-1.0]]), jnp.ones((1, 1)))
    assert float(big[0, 0]) == 3.0  # log-ratio clamp and dual clip keep it finite


def test_aggregation_modes():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [0, 0, 1], [0, 0, 0]])  # a hole and an empty sequence
    got = {mode: float(L.ratio_of(L.aggregate(loss, mask, mode))) for mode in L.AGG_MODES}
    assert got["token-mean"] == pytest.approx((1 + 2 + 6) / 3)
    assert got["seq-mean-token-mean"] == pytest.approx((1.5 + 6) / 2)
    assert got["seq-mean-token-sum"] == pytest.approx((3 + 6) / 2)
    assert got["seq-mean-token-sum-norm"] == pytest.approx((3 + 6) / 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        L.aggregate(loss, mask, "mean")


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_aggregation_exact_under_accumulation(mode):
    rng = np.random.default_rng(1)
    loss = jnp.asarray(rng.normal(size=(8, 6)))
    mask = jnp.asarray(rng.random((8, 6)) < 0.5)
    full = float(L.ratio_of(L.aggregate(loss, mask, mode)))
    parts = [L.aggregate(loss[i:i + 2], mask[i:i + 2], mode) for i in range(0, 8, 2)]
    num = sum(float(p[0]) for p in parts)
    den = parts[0][1] if mode == "seq-mean-token-sum-norm" else sum(float(p[1]) for p in parts)
    assert num / float(den) == pytest.approx(full, rel=1e-5)


def test_kl_estimators_and_entropy():
    logp, ref = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
    np.testing.assert_allclose(np.asarray(L.kl_penalty(logp, ref, "k1")), [0.5, -1.0])
    np.testing.assert_allclose(np.asarray(L.kl_penalty(logp, ref, "k3")),
                               [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(L.kl_penalty(logp, ref, "mse")), [0.125, 0.5])
    assert float(L.entropy_from_logits(jnp.zeros(4))) == pytest.approx(math.log(4))
    assert float(L.entropy_from_logits(jnp.array([0.0, -1e9]))) == pytest.approx(0.0, abs=1e-6)


def test_value_loss_clipping():
    v, old, ret = jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 0.0]]), jnp.array([[2.0, 1.0]])
    loss, m = L.value_loss(v, old, ret, jnp.ones((1, 2)), clip_range=0.5)
    # Token 0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 0.5 * 2.25. Token 1: 0.5 * 1.
    np.testing.assert_allclose(np.asarray(loss), [[1.125, 0.5]])
    assert float(m["critic/vf_clipfrac"]) == 0.5
