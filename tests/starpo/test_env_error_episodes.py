"""Episodes that an env error ended leave the update: the filter's group statistics and
weights, the reward normalisation, the update's rows (no copy pads with them) and, with turn
rows, the estimators' groups never see them. Each check compares against the same batch with
the failed episodes removed."""

import jax.numpy as jnp
import numpy as np

from ragen_jax.starpo import advantages
from ragen_jax.starpo.filtering import FilterConfig, filter_groups, group_scores
from ragen_jax.starpo.normalization import normalize_scores
from ragen_jax.starpo.rows import select_rows

SCORES = np.array([[1.0, 0.0, -5.0, 0.0], [2.0, 2.0, 2.0, 12.0], [0.5, 0.5, 0.5, 0.5]], np.float32)
VALID = np.array([[True, True, False, True], [True, True, True, False], [False] * 4])


def test_group_statistics_skip_failed_episodes():
    std = np.asarray(group_scores(jnp.asarray(SCORES), None, "reward_variance", valid=jnp.asarray(VALID)))
    assert np.allclose(std[:2], [np.std([1.0, 0.0, 0.0], ddof=1), 0.0]) and std[2] == 0.0
    mean = np.asarray(group_scores(jnp.asarray(SCORES), None, "reward", valid=jnp.asarray(VALID)))
    assert np.allclose(mean[:2], [1 / 3, 2.0])
    # Without the mask the failed episodes' scores would make group 1 look informative.
    assert float(group_scores(jnp.asarray(SCORES), None, "reward_variance")[1]) > 4.0


def test_filter_gives_failed_episodes_no_weight_and_drops_groups_with_none_left():
    cfg = FilterConfig(strategy="top_k", value=1.0)
    keep, weights, metrics = filter_groups(jnp.asarray(SCORES), cfg, valid=jnp.asarray(VALID))
    assert np.asarray(keep).tolist() == [True, True, False]
    assert np.asarray(weights).tolist() == [1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    # The reported in-group std is the one of the episodes that count.
    expected = (np.std([1.0, 0.0, 0.0], ddof=1) + 0.0 + 0.0) / 3
    assert np.isclose(float(metrics["rollout/in_group_reward_std"]), expected, atol=1e-6)
    # Top-k by std with the mask keeps group 0 (the only spread); unmasked it keeps group 1.
    one = FilterConfig(strategy="top_k_abs", value=1)
    assert np.asarray(filter_groups(jnp.asarray(SCORES), one, valid=jnp.asarray(VALID))[0]).tolist() == [True, False, False]
    assert np.asarray(filter_groups(jnp.asarray(SCORES), one)[0]).tolist() == [False, True, False]


def test_normalisation_is_computed_without_failed_episodes():
    flat, valid = SCORES.reshape(-1), VALID.reshape(-1)
    groups = np.repeat(np.arange(3), 4)
    out = normalize_scores(flat, groups, np.zeros(12, np.int32), "state", "mean_std", valid)
    kept = normalize_scores(flat[valid], groups[valid], np.zeros(valid.sum(), np.int32), "state", "mean_std")
    assert np.allclose(out[valid], kept) and (out[~valid] == 0).all()
    batch = normalize_scores(flat, groups, np.zeros(12, np.int32), "batch", "mean", valid)
    assert np.allclose(batch[valid], flat[valid] - flat[valid].mean())


def test_failed_episodes_give_no_row_and_no_padding_copy():
    keep = np.array([True, True, False])
    groups = np.repeat(np.arange(3), 4)
    for seed in range(20):
        rows = select_rows(keep, groups, 8, np.random.default_rng(seed), VALID.reshape(-1))
        assert rows.size == 8 and set(rows.tolist()) <= {0, 1, 3, 4, 5, 6}
    assert 2 in select_rows(keep, groups, 8, np.random.default_rng(0))  # unmasked it trains


def test_an_episode_in_no_group_changes_no_group_advantage():
    """With turn rows a failed episode's group id is -1 (``rows.build_step_batch``): GRPO's
    segment sums drop it, so the others' advantages equal those of the batch without it."""
    scores = jnp.asarray([1.0, 0.0, -5.0, 0.0, 2.0, 3.0])
    groups = jnp.asarray([0, 0, -1, 0, 1, 1])
    adv = np.asarray(advantages.grpo(scores, groups, 2))
    ref = np.asarray(advantages.grpo(scores[jnp.asarray([0, 1, 3, 4, 5])], jnp.asarray([0, 0, 0, 1, 1]), 2))
    assert np.allclose(adv[[0, 1, 3, 4, 5]], ref)
