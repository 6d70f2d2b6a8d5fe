"""Advantage estimators against hand-computed values and plain-Python loops, and every
estimator's exact 0 for a group (or batch) that scored all the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import levels
from ragen_jax.starpo import advantages as A
from ragen_jax.starpo.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    AdvantageSettings,
    TurnTable,
    compute_advantages,
)


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


# -- equal scores centre to exactly 0 -----------------------------------------------------------

# Estimators that centre each group's scores, and those that whiten over the whole batch (for
# them a batch that scored all the same is the all-equal case). A new estimator must be put in
# one of the two.
GROUP_CENTRED = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "gigpo")
BATCH_CENTRED = ("gae", "reinforce_plus_plus")
EQUAL_SIZES = (2, 3, 3)  # groups of at least two (GRPO's group of one keeps its raw score)
LENGTH, TURNS = 7, 3
# Values whose float32 group mean is not themselves (3.3: 3.3000002 in a group of three),
# large ones, and any float32.
EQUAL_VALUES = st.sampled_from([3.3, 1e4, 0.1, -7.7, 1 / 3, 12345.678]) | st.floats(
    -1e4, 1e4, width=32)
_advantages = jax.jit(compute_advantages, static_argnums=0)


def equal_inputs(group_values) -> AdvantageInputs:
    """``EQUAL_SIZES`` groups whose rows all scored ``group_values[g]``: every row a prompt
    token, then ``TURNS`` turns of two sampled tokens from the same states as its group's
    other rows, the score on its last turn (and last token)."""
    groups = np.repeat(np.arange(len(EQUAL_SIZES)), EQUAL_SIZES).astype(np.int32)
    scores = np.asarray(group_values, np.float32)[groups]
    b = groups.size
    token_turns = np.array([0, 1, 1, 2, 2, 3, 3], np.int32)
    mask = np.broadcast_to(token_turns > 0, (b, LENGTH))
    ends = np.broadcast_to(np.array([0, 0, 1, 0, 1, 0, 1], np.float32), (b, LENGTH))
    token_rewards = np.zeros((b, LENGTH), np.float32)
    token_rewards[:, -1] = scores
    turn_rewards = np.zeros((b, TURNS), np.float32)
    turn_rewards[:, -1] = scores
    ids = np.broadcast_to(np.arange(1, TURNS + 1, dtype=np.uint64), (b, TURNS))
    anchors = levels.as_lanes(ids.reshape(-1)).reshape(b, TURNS, 2)
    turns = TurnTable(jnp.asarray(turn_rewards), jnp.zeros((b, TURNS)), jnp.asarray(anchors),
                      jnp.ones((b, TURNS), bool))
    return AdvantageInputs(jnp.asarray(token_rewards), jnp.asarray(mask), jnp.asarray(ends),
                           jnp.asarray(scores), jnp.asarray(groups), turns,
                           jnp.broadcast_to(jnp.asarray(token_turns), (b, LENGTH)))


def equal_settings(estimator: str, norm_by_std: bool, episode_stats: str = "episode",
                   penalty: str = "discounted") -> AdvantageSettings:
    return AdvantageSettings(estimator=estimator, gamma=1.0, lam=1.0, norm_adv_by_std=norm_by_std,
                             bi_level_gae=False, high_level_gamma=0.95,
                             num_groups=len(EQUAL_SIZES), step_gamma=0.95, step_weight=1.0,
                             episode_stats=episode_stats, penalty=penalty)


EQUAL_CASES = [(e, n, "episode", "discounted") for e in GROUP_CENTRED if e != "gigpo"
               for n in (True, False)] + [("gigpo", n, stats, penalty) for n in (True, False)
                                          for stats in A.GIGPO_EPISODE_STATS
                                          for penalty in ("discounted", "own_turn")]


def test_every_estimator_is_classified():
    assert sorted(GROUP_CENTRED + BATCH_CENTRED) == sorted(ESTIMATORS)


@pytest.mark.parametrize("estimator,norm_by_std,stats,penalty", EQUAL_CASES)
@settings(max_examples=15, deadline=None)
@given(values=st.lists(EQUAL_VALUES, min_size=len(EQUAL_SIZES), max_size=len(EQUAL_SIZES)))
def test_a_group_of_equal_scores_gets_exactly_zero(estimator, norm_by_std, stats, penalty,
                                                   values):
    """Whatever each group's value, a group whose rows all scored it centres to exactly 0
    (GiGPO: its episode part, and its step part, the rows' returns being equal too), not
    the float32 rounding of ``mean / (std + eps)``."""
    adv, _ = _advantages(equal_settings(estimator, norm_by_std, stats, penalty),
                         equal_inputs(values))
    assert not np.asarray(adv).any(), np.abs(np.asarray(adv)).max()


@pytest.mark.parametrize("estimator", BATCH_CENTRED)
@settings(max_examples=15, deadline=None)
@given(value=EQUAL_VALUES)
def test_a_batch_of_equal_scores_gets_exactly_zero(estimator, value):
    """The batch-whitened estimators (GAE here with values 0 and gamma = lam = 1: each
    token's advantage is its row's score) on a batch that scored all the same."""
    x = equal_inputs([value] * len(EQUAL_SIZES))
    values = jnp.zeros_like(x.token_rewards) if estimator == "gae" else None
    adv, _ = _advantages(equal_settings(estimator, True), x, values)
    assert not np.asarray(adv).any(), np.abs(np.asarray(adv)).max()
