"""Advantage estimators against hand-computed values and plain-Python loops."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import advantages as A


def reference_gae(r, v, m, gamma, lam):
    """veRL's loop: values and TD errors carry across masked tokens."""
    b, t = r.shape
    adv = np.zeros((b, t))
    for i in range(b):
        nxt, last = 0.0, 0.0
        for j in reversed(range(t)):
            a = r[i, j] + gamma * nxt - v[i, j] + gamma * lam * last
            adv[i, j] = a
            if m[i, j]:
                nxt, last = v[i, j], a
    return adv * m


def test_gae_hand_values():
    r = jnp.array([[0.0, 0.0, 1.0]])
    v = jnp.array([[0.5, 0.6, 0.7]])
    adv, ret = A.gae(r, v, jnp.ones((1, 3)), whiten=False)
    np.testing.assert_allclose(np.asarray(adv), [[0.5, 0.4, 0.3]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), [[1.0, 1.0, 1.0]], atol=1e-6)
    # An observation token between the two generated ones is skipped: its value is ignored.
    adv, ret = A.gae(r, jnp.array([[0.5, 9.0, 0.7]]), jnp.array([[1, 0, 1]]), whiten=False)
    np.testing.assert_allclose(np.asarray(adv), [[0.5, 0.0, 0.3]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), [[1.0, 0.0, 1.0]], atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_loop_with_holes(gamma, lam):
    rng = np.random.default_rng(0)
    r = rng.normal(size=(4, 12)) * (rng.random((4, 12)) < 0.3)
    v = rng.normal(size=(4, 12))
    m = (rng.random((4, 12)) < 0.6).astype(np.float32)
    m[2] = 0  # a wholly masked-out sequence
    adv, ret = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma, lam, whiten=False)
    ref = reference_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), (ref + v) * m, atol=1e-5)
    white, _ = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma, lam)
    sel = ref[m > 0]
    np.testing.assert_allclose(np.asarray(white)[m > 0], (sel - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8), atol=1e-4)
    assert np.all(np.asarray(white)[m == 0] == 0)


def test_bi_level_gae_hand_values():
    r = jnp.array([[0, 0, 0, 0, 1, 0, 0, 0, 0, 1]], jnp.float32)
    v = jnp.arange(1, 11, dtype=jnp.float32)[None] / 10
    ends = jnp.zeros((1, 10)).at[0, 4].set(1).at[0, 9].set(1)
    adv, ret = A.bi_level_gae(r, v, jnp.ones((1, 10)), ends, 1.0, 1.0, 0.95, whiten=False)
    expected = [1.85, 1.75, 1.65, 1.55, 1.45, 0.4, 0.3, 0.2, 0.1, 0.0]
    np.testing.assert_allclose(np.asarray(adv)[0], expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret)[0], np.array(expected) + np.asarray(v)[0], atol=1e-5)
    # A zero-reward first turn is still a turn (RAGEN would merge it into the next one).
    adv0, _ = A.bi_level_gae(r.at[0, 4].set(0.0), v, jnp.ones((1, 10)), ends, 1.0, 1.0, 0.95, whiten=False)
    assert float(adv0[0, 4]) == pytest.approx(0.0 + 0.95 * 1.0 - 0.5, abs=1e-5)


def test_group_estimators():
    s = jnp.array([1.0, 2.0, 3.0, 5.0, 4.0, 4.0])
    g = jnp.array([0, 0, 0, 1, 2, 2])
    np.testing.assert_allclose(np.asarray(A.grpo(s, g, 3)), [-1, 0, 1, 5, 0, 0], atol=1e-5)
    np.testing.assert_allclose(np.asarray(A.grpo(s, g, 3, norm_by_std=False)), [-1, 0, 1, 5, 0, 0], atol=1e-6)
    s2 = jnp.array([1.0, 3.0, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(A.grpo(s2, jnp.array([0, 0, 1, 1]), 2)),
                               [-1 / (np.sqrt(2) + 1e-6), 1 / (np.sqrt(2) + 1e-6), 0, 0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(A.rloo(s, g, 3)), [-1.5, 0, 1.5, 5, 0, 0], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(A.broadcast(s[:2], jnp.array([[1, 0], [1, 1]]))), [[1, 0], [2, 2]])


def whiten_by_hand(values):
    v = np.asarray(values, np.float64)
    return (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)


def test_reinforce_plus_plus_hand_values():
    # Row 0: two turns, an observation token between them; the score on the last token.
    # Row 1: a reward of 2 on its second token, padding after.
    r = jnp.array([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = jnp.array([[1, 0, 1], [1, 1, 0]])
    adv, ret = A.reinforce_plus_plus(r, m, gamma=0.5)
    # The observation slot is skipped: the first turn's token sees 0.5 * 1, not 0 (veRL's
    # reset at masked slots would give it 0).
    np.testing.assert_allclose(np.asarray(ret), [[0.5, 0, 1], [1, 2, 0]], atol=1e-6)
    expected = whiten_by_hand([0.5, 1, 1, 2])  # the masked slots, row-major
    np.testing.assert_allclose(np.asarray(adv)[np.asarray(m) > 0], expected, atol=1e-5)
    assert np.all(np.asarray(adv)[np.asarray(m) == 0] == 0)


def verl_reinforce_plus_plus_returns(r, m, gamma):
    """veRL's loop: the running return resets after every masked slot."""
    out, running = np.zeros_like(r), np.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out[:, t] = running
        running = running * m[:, t]
    return out


def test_reinforce_plus_plus_matches_verl_on_single_turn_rows():
    """One response per row (prompt, response, padding): veRL's reset and our skip agree."""
    rng = np.random.default_rng(1)
    m = np.zeros((4, 10), np.float32)
    for i, (a, b) in enumerate([(2, 7), (1, 10), (4, 5), (3, 8)]):
        m[i, a:b] = 1
    r = rng.normal(size=(4, 10)) * m
    adv, ret = A.reinforce_plus_plus(jnp.asarray(r), jnp.asarray(m), gamma=0.9)
    ref = verl_reinforce_plus_plus_returns(r, m, 0.9) * m
    np.testing.assert_allclose(np.asarray(ret), ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(adv)[m > 0], whiten_by_hand(ref[m > 0]), atol=1e-4)


def test_reinforce_plus_plus_baseline_hand_values():
    s = jnp.array([1.0, 3.0, 4.0])
    g = jnp.array([0, 0, 1])  # group 1 is a single row: it keeps its raw score
    m = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = np.asarray(A.reinforce_plus_plus_baseline(s, g, 2, m))
    expected = whiten_by_hand([-1, -1, 1, 4, 4, 4])  # s - group mean on each token
    np.testing.assert_allclose(adv[np.asarray(m) > 0], expected, atol=1e-5)
    assert np.all(adv[np.asarray(m) == 0] == 0)
