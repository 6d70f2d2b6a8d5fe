"""The collapse detectors of ``experiments/collapse_studies.py`` on synthetic series, and
its table and plot on synthetic run folders (no training)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "experiments" / "collapse_studies.py"
_spec = importlib.util.spec_from_file_location("collapse_studies", _PATH)
cs = importlib.util.module_from_spec(_spec)
sys.modules["collapse_studies"] = cs  # dataclasses look their module up
_spec.loader.exec_module(cs)


def test_first_drop_fires_at_the_first_point_below_the_fraction_of_the_early_mean():
    steps = list(range(1, 11))
    values = [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.2, 0.09, 0.5, 0.01]
    assert cs.first_drop(steps, values, frac=0.1, warmup=5) == 8
    assert cs.reward_std_collapse(steps, values) == 8
    assert cs.entropy_collapse(steps, values) == 7  # below 0.5, strictly


def test_first_drop_ignores_the_warmup_points_and_needs_a_positive_early_mean():
    assert cs.first_drop([1, 2, 3, 4], [1.0, 0.0, 1.0, 1.0], frac=0.5, warmup=2) is None
    assert cs.first_drop([1, 2, 3], [0.0, 0.0, -1.0], frac=0.5, warmup=2) is None
    assert cs.first_drop([1, 2], [1.0, 0.0], frac=0.5, warmup=2) is None  # nothing after warmup
    assert cs.first_drop([], [], frac=0.5, warmup=2) is None


def test_mi_collapse_uses_three_early_points_and_the_given_steps():
    steps = [0, 5, 10, 15, 20, 25]
    assert cs.mi_collapse(steps, [0.4, 0.6, 0.5, 0.3, 0.24, 0.1]) == 20
    assert cs.mi_collapse(steps, [0.4, 0.6, 0.5, 0.3, 0.26, 0.3]) is None
    assert cs.mi_collapse(steps, [-0.1, 0.0, 0.1, -0.5, -1.0, -2.0]) is None  # early mean 0


def test_grad_spike_compares_with_the_median_of_the_earlier_steps():
    steps = list(range(10))
    assert cs.grad_spike(steps, [1.0, 1.2, 0.8, 1.0, 1.1, 2.9, 3.2, 1.0, 9.0, 1.0]) == 6  # 3.2 > 3 x 1.05
    assert cs.grad_spike(steps, [1.0] * 10) is None
    # a spike before 5 earlier points exist is not judged
    assert cs.grad_spike(steps[:6], [1.0, 100.0, 1.0, 1.0, 1.0, 1.0]) is None
    assert cs.first_spike([1, 2, 3], [1.0, 1.0, 5.0], factor=3.0, min_history=2) == 3


def test_detect_skips_non_finite_values_and_reports_every_detector():
    metrics = {s: {"rollout/in_group_reward_std": 0.5 if s < 8 else 0.01,
                   "actor/entropy": 1.0, "actor/grad_norm": float("nan") if s == 9 else 1.0}
               for s in range(1, 13)}
    found = cs.detect(metrics)
    assert set(found) == {c for c, _, _ in cs.DETECTORS}
    assert found["reward std < 0.1x early"] == 8
    assert found["entropy < 0.5x early"] is None
    assert found["grad norm > 3x median"] is None
    assert found["MI < 0.5x early"] is None  # never logged


def _fake_run(run: cs.Run, collapse_at: int) -> None:
    run.out.mkdir(parents=True)
    with open(run.out / "metrics.jsonl", "w") as f:
        for s in range(0, 21):
            m = {"step": s, "train/Bandit/success": s / 20, "actor/entropy": 1.0,
                 "rollout/in_group_reward_std": 0.4 if s < collapse_at else 0.0,
                 "actor/grad_norm": 1.0}
            if s % 5 == 0:
                m["val-env/Bandit/success"] = s / 20 + run.seed / 100
                m["collapse_first_turn_sample/mi_estimate"] = 0.5
            f.write(json.dumps(m) + "\n")
    (run.out / "wall_s.txt").write_text("90.0\n")


def test_table_and_grid_from_synthetic_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(cs, "RESULTS", tmp_path)
    monkeypatch.setattr(cs, "RUNS", tmp_path / "runs")
    for seed, at in ((0, 10), (1, 15)):
        _fake_run(cs.Run("algorithms", "bandit", "ppo", seed), at)
    args = cs.parse(["algorithms", "--budget-min", "3"])
    cs.save_meta("algorithms", args)
    md = cs.write_table("algorithms", ["bandit"], ["ppo", "grpo"], [0, 1],
                        cs.load_meta("algorithms", args))
    text = md.read_text()
    assert "Budget 3 min for 4 runs" in text
    row = next(line for line in text.splitlines() if line.startswith("| bandit | ppo"))
    assert "20 (1.5), 20 (1.5)" in row
    assert "0.005 +- 0.007" in row  # first validation success over the two seeds
    assert "| 10, 15 |" in row  # the reward-std detector, per seed
    assert "grpo" not in text.split("|---|")[-1]  # no runs, no row
    png = cs.plot_grid("algorithms", ["bandit"], ["ppo", "grpo"], [0, 1])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mean_curve_uses_the_steps_every_seed_reached():
    x, y = cs._mean_curve([([0, 1, 2], [0.0, 1.0, 2.0]), ([0, 1], [2.0, 3.0])])
    assert x == [0, 1]
    assert y == pytest.approx([1.0, 2.0])


def test_seed_step0_copies_the_step0_checkpoint_and_metrics_only(tmp_path, monkeypatch):
    monkeypatch.setattr(cs, "RUNS", tmp_path / "runs")
    donor = cs.Run("filtering", "bandit", "no-filter", 0)
    (donor.out / "checkpoints" / "0" / "arrays").mkdir(parents=True)
    (donor.out / "checkpoints" / "0" / "arrays" / "x").write_text("w")
    (donor.out / "checkpoints" / "30").mkdir()
    (donor.out / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "val-env/Bandit/success": 0.4}) + "\n"
        + json.dumps({"step": 1, "train/Bandit/success": 0.5}) + "\n")
    run = cs.Run("filtering", "bandit", "snr-top-p-0.9", 0)
    run.out.mkdir(parents=True)
    cs.seed_step0(run, donor.out)
    assert (run.out / "checkpoints" / "0" / "arrays" / "x").read_text() == "w"
    assert not (run.out / "checkpoints" / "30").exists()
    assert cs.load(run) == {0: {"val-env/Bandit/success": 0.4}}
    assert (run.out / "step0_from.txt").read_text().strip() == donor.name
