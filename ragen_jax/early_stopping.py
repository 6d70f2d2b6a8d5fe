"""RAGEN's early-stopping rules, with their streaks kept between steps (and in checkpoints)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Streaks:
    """The counters the rules read; ``asdict`` / ``Streaks(**d)`` round-trip through JSON."""

    empty_streak: int = 0
    std_history: list[float] = dataclasses.field(default_factory=list)
    std_low_streak: int = 0
    val_low_streak: int = 0


def early_stop_reason(rules: Any, streaks: Streaks, metrics: dict[str, float],
                      tags: str | Sequence[str]) -> str | None:
    """The rule that stops the run after this step's ``metrics``, if any. ``rules`` is
    ``config.trainer``: ``stop_empty_after_filter`` consecutive empty batches;
    ``stop_reward_std_collapse``: ten consecutive steps whose in-group reward std is below
    0.1 x the mean of the first ten; ``stop_val_success_collapse``: validation success below
    0.01 five times running (with several envs, ``tags``, every env's). Updates ``streaks``."""
    if metrics.get("train/update_skipped_empty"):
        streaks.empty_streak += 1
    elif "train/batch_size" in metrics:
        streaks.empty_streak = 0
    if rules.stop_empty_after_filter and streaks.empty_streak >= rules.stop_empty_after_filter:
        return "empty_after_filter"
    std = metrics.get("rollout/in_group_reward_std")
    if rules.stop_reward_std_collapse and std is not None:
        if len(streaks.std_history) < 10:
            streaks.std_history.append(float(std))
        else:
            low = std < 0.1 * float(np.mean(streaks.std_history))
            streaks.std_low_streak = streaks.std_low_streak + 1 if low else 0
            if streaks.std_low_streak >= 10:
                return "reward_std_collapse"
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    vals = [metrics[f"val-env/{t}/success"] for t in tags if f"val-env/{t}/success" in metrics]
    val = max(vals) if vals else None
    if rules.stop_val_success_collapse and val is not None:
        streaks.val_low_streak = streaks.val_low_streak + 1 if val < 0.01 else 0
        if streaks.val_low_streak >= 5:
            return "val_success_collapse"
    return None
