"""Run folders written before the config's fields were renamed and regrouped still load and
resume: their ``config.json`` is read through ``config.legacy``'s table.

``tests/data/old_schema/*.config.json`` are the ``config.json`` files the trainer wrote for
the tiny Sokoban and mixed Countdown presets before the change (commit e67e94e); the latter
has every ``-1`` sentinel (``env.mix[i].val_groups``, ``warmstart.turn_solver_share``,
``warmstart.seed``, ``mesh.data``) and per-env rollout fields.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from ragen_jax.config import legacy
from ragen_jax.config.loading import from_config_dict, load_config, load_file, load_run_config
from ragen_jax.config.resolve import resolve

ROOT = Path(__file__).resolve().parent.parent
OLD = ROOT / "tests/data/old_schema"
sys.path.insert(0, str(ROOT))


def _run_folder(tmp_path: Path, preset: str) -> Path:
    folder = tmp_path / preset
    folder.mkdir()
    shutil.copy(OLD / f"{preset}-tiny.config.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("preset", ["sokoban", "mixed_countdown"])
def test_an_old_config_json_reads_as_the_same_run(tmp_path, preset):
    old = json.loads((OLD / f"{preset}-tiny.config.json").read_text())
    current = from_config_dict(load_file(str(ROOT / f"configs/{preset}.py:tiny")))
    assert from_config_dict(legacy.upgrade(old)) == current
    folder = _run_folder(tmp_path, preset)
    loaded = load_run_config(folder)  # what eval and export start from
    assert loaded.trainer.output_dir == str(folder)
    loaded.trainer.output_dir = ""
    plan, expected = resolve(from_config_dict(loaded)), resolve(current)
    assert plan == expected
    assert [plan.rollout_for(e) for e in plan.envs] == [expected.rollout_for(e) for e in expected.envs]


def test_launch_resumes_an_old_run_folder(tmp_path):
    """``launch.py --config <run folder>/config.json`` (its config loading, as launch.py runs
    it) accepts an old folder, trains into it, and takes overrides by their new names."""
    folder = _run_folder(tmp_path, "mixed_countdown")
    config = load_config(["--config", str(folder / "config.json"),
                          "--config.rollout.val.env_groups=16"], prog="launch.py")
    run = from_config_dict(config)
    assert resolve(run).output_dir == folder
    assert run.rollout.val.env_groups == 16 and run.mesh.data is None
    assert run.warmstart.seed is None and run.warmstart.turns.solver_share is None
    assert [e.rollout for e in run.env.mix][1]["max_turn"] == 1


def test_upgrade_keeps_a_current_config():
    current = load_file(str(ROOT / "configs/mixed_countdown.py:tiny")).to_dict()
    assert legacy.upgrade(current) == current


@pytest.mark.parametrize("flag, message", [
    ("--config.rollout.val_groups=4", "--config.rollout.val_groups: renamed: --config.rollout.val.env_groups"),
    ("--config.actor.pad_multiple=16", "renamed: --config.actor.row_pad_multiple"),
    ("--config.rollout.group_prefix=False", "renamed: --config.rollout.sampler.share_prompt_cache"),
    ("--config.warmstart.turn_steps=0", "renamed: --config.warmstart.turns.steps"),
    ("--config.algorithm.reward_norm_preset=GRPO",
     "removed: set --config.algorithm.reward_norm_grouping and --config.algorithm.reward_norm_method "
     "(GRPO = grouping state, method mean_std"),
])
def test_an_old_field_on_the_command_line_names_the_new_one(flag, message):
    with pytest.raises(ValueError) as e:
        load_config(["--config", str(ROOT / "configs/bandit.py"), flag])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_none_fields_take_values_and_none_on_the_command_line():
    config = load_config(["--config", str(ROOT / "configs/bandit.py"), "--config.mesh.data=2",
                          "--config.warmstart.seed=None"])
    run = from_config_dict(config)
    assert run.mesh.data == 2 and run.mesh.shape == (2, 1, 1) and run.warmstart.seed is None


@pytest.mark.parametrize("text, message", [
    ('{"seed": 0, "trainer": null}', "'trainer' must be a JSON object of its fields, got null"),
    ('{"seed": 0, "trainer": [1, 2]}', "'trainer' must be a JSON object of its fields, got [1, 2]"),
    ('{"seed": 0,\n "trainer": {,}}', "not valid JSON at line 2 column 14 (Expecting property "
                                      "name enclosed in double quotes)"),
    ('[1]', "expected a JSON object of config sections, got list"),
    ("[" * 100_000 + "]" * 100_000, "not a readable config (nested too deeply: "),
])
def test_a_config_json_that_is_no_run_config_names_the_file(tmp_path, text, message):
    """A section of null or a list was an AttributeError traceback; invalid JSON a decoder
    message that named no file."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        load_run_config(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: {message}")
    assert "\n" not in str(e.value)
