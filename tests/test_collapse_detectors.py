"""``ragen_jax.collapse_detectors`` on synthetic series."""

from __future__ import annotations

from ragen_jax import collapse_detectors as detectors


def test_first_drop_fires_at_the_first_point_below_the_fraction_of_the_early_mean():
    steps = list(range(1, 11))
    values = [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.2, 0.09, 0.5, 0.01]
    assert detectors.first_drop(steps, values, frac=0.1, warmup=5) == 8
    assert detectors.reward_std_collapse(steps, values) == 8
    assert detectors.entropy_collapse(steps, values) == 7  # below 0.5, strictly


def test_first_drop_ignores_the_warmup_points_and_needs_a_positive_early_mean():
    assert detectors.first_drop([1, 2, 3, 4], [1.0, 0.0, 1.0, 1.0], frac=0.5, warmup=2) is None
    assert detectors.first_drop([1, 2, 3], [0.0, 0.0, -1.0], frac=0.5, warmup=2) is None
    assert detectors.first_drop([1, 2], [1.0, 0.0], frac=0.5, warmup=2) is None  # nothing after warmup
    assert detectors.first_drop([], [], frac=0.5, warmup=2) is None


def test_mi_collapse_uses_three_early_points_and_the_given_steps():
    steps = [0, 5, 10, 15, 20, 25]
    assert detectors.mi_collapse(steps, [0.4, 0.6, 0.5, 0.3, 0.24, 0.1]) == 20
    assert detectors.mi_collapse(steps, [0.4, 0.6, 0.5, 0.3, 0.26, 0.3]) is None
    assert detectors.mi_collapse(steps, [-0.1, 0.0, 0.1, -0.5, -1.0, -2.0]) is None  # early mean 0


def test_grad_spike_compares_with_the_median_of_the_earlier_steps():
    steps = list(range(10))
    assert detectors.grad_spike(steps, [1.0, 1.2, 0.8, 1.0, 1.1, 2.9, 3.2, 1.0, 9.0, 1.0]) == 6  # 3.2 > 3 x 1.05
    assert detectors.grad_spike(steps, [1.0] * 10) is None
    # a spike before 5 earlier points exist is not judged
    assert detectors.grad_spike(steps[:6], [1.0, 100.0, 1.0, 1.0, 1.0, 1.0]) is None
    assert detectors.first_spike([1, 2, 3], [1.0, 1.0, 5.0], factor=3.0, min_history=2) == 3


def test_detect_skips_non_finite_values_and_reports_every_detector():
    metrics = {s: {"rollout/in_group_reward_std": 0.5 if s < 8 else 0.01,
                   "actor/entropy": 1.0, "actor/grad_norm": float("nan") if s == 9 else 1.0}
               for s in range(1, 13)}
    found = detectors.detect(metrics)
    assert set(found) == {c for c, _, _ in detectors.DETECTORS}
    assert found["reward std < 0.1x early"] == 8
    assert found["entropy < 0.5x early"] is None
    assert found["grad norm > 3x median"] is None
    assert found["MI < 0.5x early"] is None  # never logged
