"""Reward normalisation (RAGEN's ``agent_proxy.reward_normalization``) on hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from ragen_jax.starpo.normalization import PRESETS, normalize_scores, place_scores

S = np.array([1.0, 3.0, 0.0, 0.0, 2.0, 6.0])
GROUPS = np.array([0, 0, 1, 1, 2, 2])
TAGS = np.zeros(6, np.int32)
R2 = np.sqrt(2.0)


def norm(grouping, method, scores=S, groups=GROUPS, tags=TAGS):
    return normalize_scores(scores, groups, tags, grouping, method)


def test_identity_keeps_the_scores():
    np.testing.assert_array_equal(norm("state", "identity"), S)
    np.testing.assert_array_equal(norm("batch", "identity"), S)


def test_state_grouping():
    np.testing.assert_allclose(norm("state", "mean"), [-1, 1, 0, 0, -2, 2], atol=1e-6)
    # Group stds (unbiased): sqrt(2), 0 (-> the group is all 0), 2 sqrt(2).
    expected = [-1 / (R2 + 1e-6), 1 / (R2 + 1e-6), 0, 0, -2 / (2 * R2 + 1e-6), 2 / (2 * R2 + 1e-6)]
    np.testing.assert_allclose(norm("state", "mean_std"), expected, atol=1e-6)
    np.testing.assert_allclose(norm("state", "asym_clip"), expected, atol=1e-6)  # inside [-1, 3]


def test_batch_grouping():
    # Batch mean 2; deviations -1, 1, -2, -2, 0, 4; unbiased variance 26 / 5.
    dev = np.array([-1, 1, -2, -2, 0, 4.0])
    np.testing.assert_allclose(norm("batch", "mean"), dev, atol=1e-6)
    np.testing.assert_allclose(norm("batch", "mean_std"), dev / (np.sqrt(5.2) + 1e-6), atol=1e-6)


def test_inductive_grouping_by_tag_and_the_asymmetric_clip():
    # Tag 0: eleven 0s and one 1 -> mean 1/12, unbiased variance 1/12, z = -sqrt(1/12) for
    # the 0s and 11/12 / sqrt(1/12) = 3.175 for the 1, clipped to 3. Tag 1 mirrors it: the
    # lone 0 has z = -3.175, clipped to -1. Tags interleave to check rows are grouped by id.
    scores = np.array([0.0] * 11 + [1.0] + [1.0] * 11 + [0.0])
    tags = np.array([0] * 12 + [1] * 12)
    order = np.random.default_rng(0).permutation(24)
    scores, tags = scores[order], tags[order]
    out = normalize_scores(scores, np.arange(24), tags, "inductive", "asym_clip")
    small = np.sqrt(1 / 12) / (np.sqrt(1 / 12) + 1e-6) * np.sqrt(1 / 12)
    expected = np.where(tags == 0, np.where(scores == 0, -small, 3.0),
                        np.where(scores == 1, small, -1.0))
    np.testing.assert_allclose(out, expected, atol=1e-6)
    unclipped = normalize_scores(scores, np.arange(24), tags, "inductive", "mean_std")
    assert unclipped.max() == pytest.approx(11 / 12 / (np.sqrt(1 / 12) + 1e-6), abs=1e-5)


def test_a_group_of_one_gets_zero():
    """Its own mean is its score and its std is undefined (RAGEN: torch.std -> nan -> 0)."""
    groups = np.array([0, 0, 1])
    scores = np.array([1.0, 3.0, 5.0])
    np.testing.assert_allclose(normalize_scores(scores, groups, groups, "state", "mean"), [-1, 1, 0])
    np.testing.assert_allclose(normalize_scores(scores, groups, groups, "state", "mean_std"),
                               [-1 / (R2 + 1e-6), 1 / (R2 + 1e-6), 0], atol=1e-6)


def test_presets_are_the_v1_names():
    assert PRESETS == {"GRPO": ("state", "mean_std"), "BRPO": ("batch", "mean_std"),
                       "ARPO": ("state", "identity")}


def test_bad_names_raise():
    with pytest.raises(ValueError, match="grouping"):
        norm("group", "mean")
    with pytest.raises(ValueError, match="method"):
        norm("state", "z")


def test_place_scores_on_the_last_sampled_token():
    rewards = np.array([[0, 0, 0.5, 0], [0, 0, 0, 0]], np.float32)
    mask = np.array([[0, 1, 1, 0], [0, 0, 0, 0]], bool)
    out = place_scores(rewards, mask, np.array([2.0, 7.0], np.float32))
    np.testing.assert_array_equal(out, [[0, 0, 2, 0], [0, 0, 0, 0]])
