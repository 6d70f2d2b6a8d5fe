"""When a run's collapse indicators first fired: pure functions of a run's metric series.

Each detector reads one metric over the steps (``metrics.jsonl`` as ``metrics.read_jsonl``
gives it) and returns the first step where it fired, or None:

- in-group reward std below 0.1 x the mean of its first 5 steps (RAGEN's early-stop rule,
  without its 10-step streak);
- policy entropy below 0.5 x the mean of its first 5 steps;
- the first-turn I(X;Z) estimate below 0.5 x the mean of its first 3 diagnostics points (only
  when that mean is positive);
- actor grad norm above 3 x the median of all earlier steps (at least 5 of them).

The entropy and grad-norm detectors also fire in runs that learn: read them beside the success
curves, not as collapse on their own. ``experiments/studies/collapse_studies.py`` tabulates them
per run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ragen_jax.plots import series

Metrics = dict[int, dict[str, float]]


def first_drop(steps: Sequence[int], values: Sequence[float], frac: float, warmup: int) -> int | None:
    """First step after the first ``warmup`` points whose value is below ``frac`` x the
    mean of those points; None if it never is, if there are too few points, or if the early
    mean is not positive (a fraction of it would mean nothing)."""
    if len(values) <= warmup:
        return None
    early = sum(values[:warmup]) / warmup
    if not early > 0:
        return None
    for s, v in zip(steps[warmup:], values[warmup:], strict=True):
        if v < frac * early:
            return s
    return None


def first_spike(steps: Sequence[int], values: Sequence[float], factor: float,
                min_history: int) -> int | None:
    """First step whose value exceeds ``factor`` x the median of all earlier values (once at
    least ``min_history`` earlier values exist); None if none does."""
    for i in range(min_history, len(values)):
        if values[i] > factor * statistics.median(values[:i]):
            return steps[i]
    return None


def reward_std_collapse(steps: Sequence[int], values: Sequence[float]) -> int | None:
    """In-group reward std below 0.1 x its first-5-step mean (RAGEN's collapse threshold)."""
    return first_drop(steps, values, frac=0.1, warmup=5)


def entropy_collapse(steps: Sequence[int], values: Sequence[float]) -> int | None:
    """Policy entropy below half its first-5-step mean."""
    return first_drop(steps, values, frac=0.5, warmup=5)


def mi_collapse(steps: Sequence[int], values: Sequence[float]) -> int | None:
    """MI estimate below half the mean of its first 3 diagnostics points."""
    return first_drop(steps, values, frac=0.5, warmup=3)


def grad_spike(steps: Sequence[int], values: Sequence[float]) -> int | None:
    """Grad norm above 3 x the running median of the earlier steps (at least 5 of them)."""
    return first_spike(steps, values, factor=3.0, min_history=5)


DETECTORS = (  # (column, metric key, detector)
    ("reward std < 0.1x early", "rollout/in_group_reward_std", reward_std_collapse),
    ("entropy < 0.5x early", "actor/entropy", entropy_collapse),
    ("MI < 0.5x early", "collapse_first_turn_sample/mi_estimate", mi_collapse),
    ("grad norm > 3x median", "actor/grad_norm", grad_spike),
)


def detect(metrics: Metrics) -> dict[str, int | None]:
    """Every detector on one run's metrics: ``{column: first step or None}``."""
    out = {}
    for column, key, fn in DETECTORS:
        steps, values = series(metrics, key)
        finite = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
        out[column] = fn([s for s, _ in finite], [v for _, v in finite])
    return out
