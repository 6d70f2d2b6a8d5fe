"""``python -m ragen_jax.eval`` on the tiny random model: files, metrics, escaping."""

import json
from pathlib import Path

from ragen_jax import eval as ev

ROOT = Path(__file__).resolve().parent.parent


def test_eval_writes_metrics_trajectories_and_viewer(tmp_path, capsys):
    out = tmp_path / "eval"
    summary = ev.main(["--config.rollout.val.env_groups=2", "--config.rollout.val.group_size=2",
                       "--config.rollout.max_turn=2", "--config.rollout.response_length=16",
                       "--config.rollout.prompt.enable_think=True", "--config.model.hidden_size=32",
                       "--config.model.intermediate_size=64", "--config.model.num_hidden_layers=1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "Sokoban/success" in printed and "tiny random model" in printed
    assert printed.startswith("compute dtype: float32 (model.dtype=float32, on XLA:CPU)\n")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["episodes"] == 4 and metrics["config"]["rollout"]["val"]["temperature"] == 0.5
    for key in ("success", "num_actions", "action_is_effective", "action_is_valid",
                "turns_without_format_error", "effective_action_rate", "format_error_rate",
                "pass@2", "response_length", "episodic_return"):
        assert f"Sokoban/{key}" in metrics["metrics"], key
    assert metrics["metrics"] == summary["metrics"]
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 4
    trajs = [json.loads(x) for x in lines]
    assert [t["seed"] for t in trajs] == [123, 123, 124, 124]
    # A group's episodes share a level; the report counts the distinct ones.
    assert trajs[0]["level"] == trajs[1]["level"] and trajs[2]["level"] == trajs[3]["level"]
    distinct = len({t["level"] for t in trajs})
    assert metrics["metrics"]["Sokoban/distinct_levels"] == distinct and "Sokoban/distinct_levels" in printed
    for t in trajs:
        roles = [m["role"] for m in t["messages"]]
        assert roles[:3] == ["system", "user", "assistant"] and len(t["turns"]) <= 2
        assert {"success", "score", "turns", "final_state"} <= set(t)
        assert all({"actions", "reward", "penalty", "state"} <= set(turn) for turn in t["turns"])
    page = (out / "viewer.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<details><summary class=") == 4  # one per episode
    # The random model's text appears escaped: no raw tag from model text survives.
    assert "<think>" not in page and "<answer>" not in page


def test_viewer_escapes_model_text():
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    traj = {"env_id": 0, "group_id": 0, "seed": 1, "success": False, "score": -0.1,
            "num_actions": 0, "final_state": "#P#",
            "turns": [{"turn": 1, "state": "#P#", "think": evil, "response": evil,
                       "actions": [evil], "executed": [], "reward": 0.0, "penalty": -0.1,
                       "format_error": "tags"}]}
    from ragen_jax.viewer import render_html

    page = render_html([traj], {"model": evil, "env": "x", "metrics": {evil: 1.0}})
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_bad_model_folder_is_one_line_error(tmp_path):
    import pytest

    from ragen_jax import eval as ragen_eval

    with pytest.raises(SystemExit) as exc:
        ragen_eval.main([f"--config.model.path={tmp_path / 'missing'}", "--out", str(tmp_path / "out")])
    assert "model.path: no such folder" in str(exc.value) and "\n" not in str(exc.value)


def test_unknown_override_is_one_line_error(tmp_path):
    import pytest

    with pytest.raises(SystemExit) as exc:
        ev.main(["--config.rollout.val_grups=2", "--out", str(tmp_path / "out")])
    assert "--config.rollout.val_grups: unknown field" in str(exc.value) and "\n" not in str(exc.value)


def test_eval_plays_the_runs_context_window(tmp_path, capsys):
    """The window mode is part of the rollout config a run validates with: eval plays it."""
    out = tmp_path / "eval"
    ev.main(["--config.rollout.val.env_groups=2", "--config.rollout.val.group_size=1",
             "--config.rollout.max_turn=3", "--config.rollout.response_length=8",
             "--config.rollout.window.mode=limited", "--config.rollout.window.turns=1",
             "--config.algorithm.sample_unit=turn", "--config.model.hidden_size=32",
             "--config.model.intermediate_size=64", "--config.model.num_hidden_layers=1", "--out", str(out)])
    capsys.readouterr()
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    turns = [t for traj in trajs for t in traj["turns"]]
    assert len(turns) == 6  # random answers: no valid action, every episode plays 3 turns
    for t in turns:  # k = 1: each prompt shows its own turn only, prefilled whole
        assert t["window_start"] == t["turn"] and t["prefill_tokens"] == t["prompt_tokens"]


def test_eval_of_a_mixed_config_plays_what_the_run_validates(tmp_path, capsys):
    """configs/mixed.py: each env's share of the validation groups, per-tag metrics, and the
    very episodes (tags, seeds, prompts) a training run's validation plays."""
    from ragen_jax.config.loading import load_config
    from ragen_jax.train import Trainer

    args = ["--config", str(ROOT / "configs/mixed.py"), "--config.rollout.val.env_groups=3",
            "--config.rollout.max_turn=1", "--config.rollout.response_length=8",
            "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
            "--config.model.num_hidden_layers=1", f"--config.trainer.output_dir={tmp_path / 'run'}"]
    summary = ev.main([*args, "--out", str(tmp_path / "eval")])
    printed = capsys.readouterr().out
    assert "SimpleSokoban + FrozenLake" in printed and "FrozenLake/success" in printed
    assert summary["episodes"] == 3  # 3 groups for 4 : 4 -> 2 : 1 (the tie to the first)
    for tag in ("SimpleSokoban", "FrozenLake"):
        for key in ("success", "pass@1", "num_turns", "score"):
            assert f"{tag}/{key}" in summary["metrics"], (tag, key)
    ours = [json.loads(x) for x in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert [(t["tag"], t["seed"]) for t in ours] == [
        ("SimpleSokoban", 123), ("SimpleSokoban", 124), ("FrozenLake", 123)]
    _, batch = Trainer(load_config(args)).validate()
    assert [(t["tag"], t["seed"], t["messages"][:2]) for t in batch.trajectories] == [
        (t["tag"], t["seed"], t["messages"][:2]) for t in ours]
