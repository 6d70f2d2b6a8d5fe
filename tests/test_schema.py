"""The run config's schema: one source of defaults, typed reading, derived values."""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from ml_collections import ConfigDict

from ragen_jax.config.fields import ConfigError
from ragen_jax.config.loading import config_for_print, from_config_dict, to_config_dict
from ragen_jax.config.resolve import describe, micro_batch_warning, resolve, update_settings
from ragen_jax.config.schema import TINY_ONLY_FIELDS, ModelConfig, RunConfig, compute_dtype
from ragen_jax.starpo.optimizer_step import UpdateConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def test_config_dict_round_trip_and_json():
    run = RunConfig()
    assert from_config_dict(to_config_dict(run)) == run
    # What a run folder saves (config.json) reads back to the same config.
    saved = json.loads(to_config_dict(run).to_json_best_effort())
    assert from_config_dict(ConfigDict(saved)) == run


def test_presets_build_from_the_schema():
    from configs import bandit, base, frozenlake, sokoban

    for module in (base, bandit, frozenlake, sokoban):
        run = from_config_dict(module.get_config())
        assert run.preset == "tiny" and run.model.hidden_size == 128
    c = base.get_config()
    assert set(c.keys()) == {f.name for f in dataclasses.fields(RunConfig)}
    assert set(c.rollout.keys()) == {f.name for f in dataclasses.fields(RunConfig().rollout)}


def test_qwen_presets_split_the_update_into_micro_batches(tmp_path):
    """Each real-model preset runs a mini-batch in the passes its memory on one device needs
    (``configs/base.py``'s MICRO_BATCHES), actor and critic alike, and the counts divide the
    mini-batch (else a one-line error at start)."""
    from configs import base, sokoban

    for preset, count in base.MICRO_BATCHES.items():
        c = sokoban.get_config(preset)
        c.model.path = str(tmp_path)
        run = from_config_dict(c)
        assert run.actor.micro_batches == run.critic.micro_batches == count > 1, preset
        step = resolve(run).step
        assert step.actor.micro_batches == count
        rows = step.mini_batch_size // count
        assert rows * count == step.mini_batch_size, preset
        if preset in base.CPU_PRESETS:  # a quarter of RAGEN's batch on a CPU's memory
            assert rows == {"smollm2-135m": 8, "qwen2.5-0.5b-cpu": 8}[preset], preset
        else:  # 32 rows of up to ~2.6k tokens on one accelerator
            assert rows == {8: 4, 16: 2, 32: 1}[count], preset


def test_bandit_cpu_preset_trains_the_whole_batch_in_one_step(tmp_path):
    """The 0.5B Bandit CPU preset (configs/bandit.py: bandit_cpu) is a valid run whose 128
    episodes are one optimizer step in passes of 32 rows, with a batch baseline (no critic,
    no group statistics) and answer-only turns."""
    from configs import bandit

    c = bandit.get_config("qwen2.5-0.5b-cpu")
    c.model.path = str(tmp_path)
    run = from_config_dict(c)
    resolved = resolve(run)
    rows = run.rollout.env_groups * run.rollout.group_size
    assert resolved.step.mini_batch_size == rows == 128
    assert rows // resolved.step.actor.micro_batches == 32
    assert not run.rollout.prompt.enable_think and run.algorithm.adv_estimator == "reinforce_plus_plus"
    assert run.model.lora_rank > 0 and run.actor.warmup_steps < run.trainer.total_steps


def test_micro_batches_that_leave_devices_without_a_row_are_named(tmp_path):
    from configs import sokoban

    c = sokoban.get_config("qwen2.5-1.5b")  # 16 passes of 2 rows: meant for one device
    c.model.path = str(tmp_path)
    step = resolve(from_config_dict(c)).step
    assert micro_batch_warning(step, 1) is None and micro_batch_warning(step, 2) is None
    assert micro_batch_warning(step, 8).startswith(
        "warning: actor.micro_batches=16 leaves 2 rows a pass for 8 data-parallel devices")
    assert "4 would do" in micro_batch_warning(step, 8)
    c.actor.micro_batches, c.algorithm.adv_estimator = 4, "gae"  # the critic's own count
    assert micro_batch_warning(resolve(from_config_dict(c)).step, 8).startswith(
        "warning: critic.micro_batches=16 leaves 2 rows")


def test_update_settings_take_their_defaults_from_the_schema():
    """UpdateConfig has no defaults of its own for run settings: direct use starts from the
    default run's resolved settings."""
    actor = resolve(RunConfig()).step.actor
    assert update_settings() == actor
    assert update_settings(lr=1e-3) == dataclasses.replace(actor, lr=1e-3)
    assert update_settings("critic").lr == RunConfig().critic.lr
    with pytest.raises(TypeError, match="required keyword-only"):
        UpdateConfig()


@pytest.mark.parametrize("section, field, value, message", [
    ("rollout", "group_size", 0, "rollout.group_size must be >= 1, got 0"),
    ("algorithm", "adv_estimator", "ppo", "algorithm.adv_estimator must be one of"),
    ("model", "dtype", "float16", "model.dtype must be one of ('auto', 'float32', 'bfloat16'), got 'float16'"),
    ("model", "param_dtype", "auto", "model.param_dtype must be one of ('float32', 'bfloat16')"),
    ("rollout", "sampling.stop_strings", ("</answer>", ""), "rollout.sampling.stop_strings must be a tuple of non-empty strings"),
    ("actor", "micro_batches", 3, "actor.micro_batches=3 must divide actor.ppo_mini_batch_size=32"),
    ("actor", "row_pad_multiple", -1, "actor.row_pad_multiple must be >= 0, got -1"),
    ("filter", "strategy", "best", "filter.strategy must be one of"),
    ("trainer", "total_steps", 0, "trainer.total_steps must be >= 1"),
    ("rollout", "sampling.temperature", "hot", "rollout.sampling.temperature: expected float, got 'hot'"),
    ("rollout", "val.env_groups", 0, "rollout.val.env_groups must be >= 1, got 0"),
    ("rollout", "window.turns", 2, "rollout.window.turns must be 0 with rollout.window.mode=full"),
    ("mesh", "data", -1, "mesh.data must be >= 1, or None"),
    ("trainer", "logger", 3, "trainer.logger: expected tuple"),
    ("warmstart", "solver_share", 1.5, "warmstart.solver_share must be in [0, 1], got 1.5"),
    ("warmstart", "episodes", 0, "warmstart.episodes must be >= 1"),
    ("warmstart", "turns.solver_share", 2.0, "warmstart.turns.solver_share must be None or in [0, 1], got 2.0"),
    ("algorithm", "gigpo_gamma", 1.5, "algorithm.gigpo_gamma must be in [0, 1], got 1.5"),
    ("algorithm", "gigpo_similarity", 0.0, "algorithm.gigpo_similarity must be in (0, 1], got 0.0"),
    ("algorithm", "gigpo_episode_stats", "step", "algorithm.gigpo_episode_stats must be one of ('episode', 'turn'), got 'step'"),
    ("algorithm", "gigpo_penalty", "verl", "algorithm.gigpo_penalty must be one of ('discounted', 'own_turn'), got 'verl'"),
])
def test_bad_values_name_the_field(section, field, value, message):
    c = to_config_dict().to_dict()  # a config file or config.json can hold any type
    *sections, name = field.split(".")
    node = c[section]
    for part in sections:
        node = node[part]
    node[name] = value
    with pytest.raises(ConfigError) as e:
        from_config_dict(c)
    assert str(e.value).startswith(f"{section}.")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_fields_are_errors():
    c = to_config_dict().to_dict()
    c["rollout"]["group_sise"] = 4
    with pytest.raises(ConfigError, match=r"rollout\.group_sise: unknown config field"):
        from_config_dict(c)


def test_resolve_computes_and_reports_derived_values():
    c = to_config_dict()
    c.algorithm.adv_estimator = "drgrpo"
    plan = resolve(from_config_dict(c))
    assert plan.step.actor.loss_agg_mode == "seq-mean-token-sum" and plan.step.critic is None
    assert plan.step.reference is None
    text = describe(plan)
    assert "loss_agg_mode = seq-mean-token-sum" in text and "critic: none" in text
    c = to_config_dict()
    c.algorithm.bi_level_gae = True
    c.algorithm.kl_coef = 0.01
    c.model.lora_rank = 4
    c.critic.weight_decay = 0.0
    plan = resolve(from_config_dict(c))
    assert plan.rollout.use_turn_scores and plan.step.critic is not None
    assert plan.step.critic.weight_decay == 0.0 and plan.step.actor.weight_decay == 0.01
    assert plan.step.reference == "adapters_off"
    c.model.lora_rank = 0
    assert resolve(from_config_dict(c)).step.reference == "frozen_copy"


def test_logger_accepts_ragen_style_lists():
    c = to_config_dict().to_dict()
    c["trainer"]["logger"] = ["console", "wandb"]
    assert from_config_dict(c).trainer.logger == ("console", "wandb")
    c["trainer"]["logger"] = "tensorboard,wandb"
    assert from_config_dict(c).trainer.logger == ("tensorboard", "wandb")


def test_cosine_schedule_longer_than_the_run_names_the_user_fields():
    c = to_config_dict()
    c.actor.lr_schedule, c.actor.warmup_steps = "cosine", 500
    with pytest.raises(ConfigError, match=r"^trainer\.total_steps must exceed actor\.warmup_steps"):
        resolve(from_config_dict(c))


def test_length_hint_follows_response_length_through_the_schema():
    c = to_config_dict()
    c.rollout.response_length = 37
    assert resolve(from_config_dict(c)).rollout.context.max_tokens_hint == 37
    c.rollout.prompt.max_tokens_hint = 50
    assert resolve(from_config_dict(c)).rollout.context.max_tokens_hint == 50


def test_printed_config_of_a_folder_run_names_its_config_json(tmp_path):
    tiny = RunConfig()
    assert config_for_print(tiny) == str(to_config_dict(tiny))  # what launch.py printed
    assert "  hidden_size: 128\n" in config_for_print(tiny)
    arch = {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(arch))
    c = to_config_dict()
    c.model.path, c.model.lora_rank = str(tmp_path), 4
    run = from_config_dict(c)
    text = config_for_print(run)
    lines = text.splitlines()
    assert not any(line.strip().startswith(f"{f}:") for f in TINY_ONLY_FIELDS for line in lines)
    assert lines[lines.index("model:") + 1] == (
        f"  architecture: from {tmp_path / 'config.json'} (hidden_size=896, "
        "num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14, "
        "num_key_value_heads=2)")
    assert "  lora_rank: 4" in lines and f"  path: {tmp_path}" in lines
    full = str(to_config_dict(run)).splitlines()
    assert len(lines) == len(full) - len(TINY_ONLY_FIELDS) + 1
    assert set(lines) - set(full) == {lines[lines.index("model:") + 1]}
    (tmp_path / "config.json").unlink()  # unreadable: the file is still named
    assert f"  architecture: from {tmp_path / 'config.json'}\n" in config_for_print(run)


@pytest.mark.parametrize("section, field, value, message", [
    ("algorithm", "reward_norm_grouping", "env", "algorithm.reward_norm_grouping must be one of"),
    ("algorithm", "reward_norm_method", "zscore", "algorithm.reward_norm_method must be one of"),
    ("algorithm", "adv_estimator", "brpo", "algorithm.adv_estimator must be one of"),
    ("filter", "metric", "perplexity", "filter.metric must be one of"),
])
def test_bad_normalisation_and_filter_values_name_the_field(section, field, value, message):
    test_bad_values_name_the_field(section, field, value, message)


def test_reward_norm_resolves_from_its_two_fields():
    c = to_config_dict()
    assert resolve(from_config_dict(c)).reward_norm == ("state", "identity")  # RAGEN's default
    c = to_config_dict()
    c.algorithm.reward_norm_grouping, c.algorithm.reward_norm_method = "inductive", "asym_clip"
    assert resolve(from_config_dict(c)).reward_norm == ("inductive", "asym_clip")
    c.algorithm.bi_level_gae = True  # turn scores: the trajectory score is not one number
    with pytest.raises(ConfigError, match=r"^algorithm\.reward_norm_method=asym_clip .* "
                                          r"rollout\.use_turn_scores=False"):
        resolve(from_config_dict(c))


# -- env.mix -----------------------------------------------------------------------------------


def _mixed(*overrides: str):
    from ragen_jax.config.loading import load_config

    return load_config(["--config", str(ROOT / "configs/mixed.py"), *overrides])


def test_mix_preset_round_trips_and_splits_validation_in_proportion():
    run = from_config_dict(_mixed())
    assert [(e.name, e.tag, e.groups) for e in run.env.mix] == [
        ("sokoban", "SimpleSokoban", 4), ("frozenlake", "FrozenLake", 4)]
    assert from_config_dict(to_config_dict(run)) == run
    saved = json.loads(to_config_dict(run).to_json_best_effort())  # config.json: lists, not tuples
    assert from_config_dict(ConfigDict(saved)) == run
    envs = resolve(run).envs
    assert [e.val_groups for e in envs] == [128, 128]  # rollout.val.env_groups 256, half each
    # 10 validation groups for groups 1 : 2 -> 3.33 : 6.67 -> 3 : 7 (largest remainder).
    run = from_config_dict(_mixed("--config.rollout.env_groups=3", "--config.rollout.val.env_groups=10",
                                  "--config.env.mix.SimpleSokoban.groups=1",
                                  "--config.env.mix.1.groups=2"))
    assert [(e.groups, e.val_groups) for e in resolve(run).envs] == [(1, 3), (2, 7)]
    assert "SimpleSokoban 1 group(s) (validation 3)" in describe(resolve(run))


def test_mix_overrides_reach_one_entry():
    c = _mixed("--config.env.mix.FrozenLake.params.size=5", "--config.env.mix.0.val_groups=6",
               "--config.env.mix.1.val_groups=250")
    run = from_config_dict(c)
    assert run.env.mix[1].params["size"] == 5 and run.env.mix[1].params["p"] == 0.9
    assert [e.val_groups for e in resolve(run).envs] == [6, 250]
    with pytest.raises(ValueError, match=r"env\.mix has no entry 'Nope'"):
        _mixed("--config.env.mix.Nope.groups=1")
    whole = _mixed("--config.env.mix=({'name': 'frozenlake', 'groups': 8},)")
    assert [(e.name, e.tag, e.groups) for e in from_config_dict(whole).env.mix] == [("frozenlake", "", 8)]


@pytest.mark.parametrize("overrides, message", [
    (("--config.env.mix.0.groups=3",), r"env\.mix: the entries' groups sum to 7, but rollout\.env_groups=8"),
    (("--config.env.mix.0.val_groups=3",), r"give val_groups to every entry or to none"),
    (("--config.env.mix.0.val_groups=3", "--config.env.mix.1.val_groups=3"),
     r"val_groups sum to 6, but rollout\.val\.env_groups=256"),
    (("--config.env.mix.1.groups=-1",), r"env\.mix\[1\]\.groups must be >= 0"),
    (("--config.env.mix.1.grups=1",), r"env\.mix\[1\]\.grups: unknown config field"),
    (("--config.env.mix.1.tag=SimpleSokoban",), r"two entries have the same tag"),
    (("--config.env.mix.1.tag=a/b",), r"env\.mix\[1\]\.tag: no '/'"),
    (("--config.env.mix.1.name=",), r"env\.mix\[1\]\.name: required"),
    (("--config.env.val_extra={'X': {'size': 5}}",), r"env\.val_extra: not used with env\.mix"),
])
def test_bad_mix_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message) as exc:
        from_config_dict(_mixed(*overrides))
    assert "\n" not in str(exc.value)


def test_without_a_mix_the_envs_are_the_env_and_its_validation_extras():
    from configs import bandit

    run = from_config_dict(bandit.get_config())
    assert [(e.tag, e.groups, e.val_groups, e.params) for e in resolve(run).envs] == [
        ("", 8, 256, {"split": "train"}), ("BanditTest", 0, 256, {"split": "test"})]


def test_a_mix_entry_sets_its_own_turn_budgets():
    countdown = ("{'name': 'countdown', 'tag': 'Countdown', 'groups': 2, 'rollout': "
                 "{'max_turn': 1, 'max_actions_per_traj': 1, 'max_actions_per_turn': 1}}")
    lake = "{'name': 'frozenlake', 'groups': 6}"
    plan = resolve(from_config_dict(_mixed(f"--config.env.mix=({countdown}, {lake})")))
    first, second = (plan.rollout_for(e) for e in plan.envs)
    assert (first.max_turn, first.max_actions_per_traj, second.max_turn) == (1, 1, 5)
    assert first.env_groups == second.env_groups == 8 and second is plan.rollout
    assert "Countdown 2 group(s) (validation 64; rollout.max_turn=1;" in describe(plan)
    with pytest.raises(ConfigError, match=r"env\.mix\[0\]\.rollout\.max_turn must be >= 1, got 0"):
        from_config_dict(_mixed(f"--config.env.mix=({countdown}, {lake})",
                                "--config.env.mix.Countdown.rollout.max_turn=0"))
    with pytest.raises(ConfigError, match=r"env\.mix\[0\]\.rollout\.val\.seed: not settable per env"):
        from_config_dict(_mixed("--config.env.mix.0.rollout.val.seed=3"))
    # a section's field, nested as in the run's rollout section
    plan = resolve(from_config_dict(_mixed(f"--config.env.mix=({countdown}, {lake})",
                                           "--config.env.mix.Countdown.rollout.prompt.max_answer_chars=9")))
    first, second = (plan.rollout_for(e) for e in plan.envs)
    assert (first.prompt.max_answer_chars, second.prompt.max_answer_chars) == (9, 256)
    assert first.context.max_answer_chars == 9


def test_auto_compute_dtype_is_float32_on_xla_cpu_only():
    """``model.dtype=auto``: bfloat16 where the backend has bf16 matrix units, float32 on
    XLA:CPU (bf16 matmuls ~10x slower there); the printed line says which and why."""
    auto = ModelConfig(dtype="auto")
    assert compute_dtype(auto, "cpu") == (
        "float32", "compute dtype: float32 (model.dtype=auto, on XLA:CPU: its bfloat16 matmuls "
                   "run ~10x slower than float32 at decode batch sizes)")
    for backend in ("gpu", "cuda", "tpu"):
        dtype, line = compute_dtype(auto, backend)
        assert dtype == "bfloat16" and f"model.dtype=auto, on {backend}" in line, backend
    # An explicit value is kept everywhere; bfloat16 on the CPU says how to get the fast one.
    assert compute_dtype(ModelConfig(dtype="float32"), "tpu")[0] == "float32"
    dtype, line = compute_dtype(ModelConfig(dtype="bfloat16"), "cpu")
    assert dtype == "bfloat16" and "model.dtype=auto takes float32 on XLA:CPU" in line
    assert "\n" not in line
    # The backend this test runs on (the CPU) builds an auto model in float32.
    from ragen_jax.policy import tiny_config

    assert tiny_config(ModelConfig(dtype="auto", hidden_size=64)).dtype == jnp.float32


def test_real_model_presets_compute_in_auto_and_stop_after_the_answer(tmp_path):
    """The real-model presets take ``model.dtype=auto`` and end a turn after ``</answer>``; the
    tiny preset keeps float32 and no stop strings (its results were measured so)."""
    from configs import bandit, base, sokoban

    for preset in base.PRESETS[1:]:
        c = sokoban.get_config(preset)
        c.model.path = str(tmp_path)
        run = from_config_dict(c)
        assert run.model.dtype == "auto" and run.rollout.sampling.stop_strings == ("</answer>",), preset
        # RAGEN's budget (docs/design.md: why kept); the CPU presets a third of it (base.cpu_preset)
        assert run.rollout.response_length == (128 if preset in base.CPU_PRESETS else 400), preset
        if preset not in base.CPU_PRESETS:  # the Bandit's: RAGEN's _1_bandit.yaml
            assert bandit.get_config(preset).rollout.response_length == 500, preset
    tiny = from_config_dict(bandit.get_config())
    assert tiny.model.dtype == "float32" and tiny.rollout.sampling.stop_strings == ()
    # The command line sets them as a Python tuple or list; () turns them off.
    from ragen_jax.config.loading import load_config

    c = load_config(["--config", str(ROOT / "configs" / "bandit.py"),
                     '--config.rollout.sampling.stop_strings=["</answer>", "||"]'])
    assert from_config_dict(c).rollout.sampling.stop_strings == ("</answer>", "||")
    c = load_config(["--config", f"{ROOT / 'configs' / 'bandit.py'}:qwen2.5-0.5b",
                     f"--config.model.path={tmp_path}", "--config.rollout.sampling.stop_strings=()"])
    assert from_config_dict(c).rollout.sampling.stop_strings == ()


# -- values nothing checked: learning rates, nan and inf, lengths, memory ----------------------


def _with(**fields: Any) -> ConfigDict:
    """The default config with ``section.field`` values set (``fields``: "actor__lr"=...,
    "rollout__val__env_groups"=...)."""
    c = to_config_dict()
    for key, value in fields.items():
        *sections, name = key.split("__")
        node = c
        for section in sections:
            node = node[section]
        node[name] = value
    return c


@pytest.mark.parametrize("field", ["actor.lr", "critic.lr", "warmstart.lr", "sft.lr"])
def test_every_learning_rate_is_finite_and_at_most_one(field):
    """-1 and 1e10 trained silently; a rate must be in (0, 1]."""
    key = field.replace(".", "__")
    for bad in (-1.0, 0.0, 1.5, 1e10):
        with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')} must be in \(0, 1\], got {bad!r}$"):
            from_config_dict(_with(**{key: bad}))
    for good in (1e-6, 1.0):
        assert from_config_dict(_with(**{key: good}))


def _float_fields() -> list[str]:
    """Every float field of the schema, as ``section.field`` (``section.sub.field`` in a
    nested section)."""
    def fields(prefix: str, cls: type) -> list[str]:
        out = []
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                out += fields(f"{prefix}{name}.", hint)
            elif hint is float:
                out.append(f"{prefix}{name}")
        return out

    return [f for f in fields("", RunConfig) if "." in f]


def test_nan_and_inf_are_refused_by_name_in_every_float_field():
    """Each float field given nan or +-inf (which pass every bound: nan < 0 is False) is a
    one-line error naming it; on the command line too, where "nan" used to be "nan is of
    original type <class 'str'>". A string field keeps the word."""
    fields = _float_fields()
    assert {"actor.lr", "rollout.sampling.temperature", "filter.value", "algorithm.gamma"} <= set(fields)
    for field in fields:
        for bad in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(ConfigError) as e:
                from_config_dict(_with(**{field.replace(".", "__"): bad}))
            assert str(e.value) == f"{field} must be a finite number, got {bad}", field
    from ragen_jax.config.loading import load_config

    for word, shown in (("nan", "nan"), ("inf", "inf"), ("-Infinity", "-inf"), ("1e400", "inf")):
        c = load_config(["--config", str(ROOT / "configs/bandit.py"), f"--config.actor.lr={word}"])
        with pytest.raises(ConfigError, match=rf"^actor\.lr must be a finite number, got {shown}$"):
            from_config_dict(c)
    c = load_config(["--config", str(ROOT / "configs/bandit.py"), "--config.trainer.experiment_name=nan"])
    assert from_config_dict(c).trainer.experiment_name == "nan"


def test_an_answer_budget_must_leave_room_for_a_prompt():
    """``response_length`` at or past ``max_model_len`` (1e9 was a traceback in the update's
    row builder) is refused naming both, for the run and for an ``env.mix`` entry."""
    with pytest.raises(ConfigError, match=r"^rollout\.response_length=1000000000 must be below "
                                          r"rollout\.max_model_len=3600 "):
        from_config_dict(_with(rollout__response_length=1_000_000_000))
    with pytest.raises(ConfigError, match=r"^rollout\.response_length=3600 must be below"):
        from_config_dict(_with(rollout__response_length=3600))
    assert from_config_dict(_with(rollout__response_length=3599))
    c = to_config_dict()
    c.rollout.env_groups = 2
    c.env.mix = ({"name": "bandit", "groups": 1}, {"name": "sokoban", "groups": 1,
                                                    "rollout": {"response_length": 5000}})
    with pytest.raises(ConfigError, match=r"^env\.mix\[1\]\.rollout\.response_length=5000 must be "
                                          r"below rollout\.max_model_len=3600"):
        from_config_dict(c)


def test_max_model_len_within_the_model_folders_positions(tmp_path):
    """A folder model reads at most ``max_position_embeddings`` positions (its config.json)."""
    from ragen_jax.budget import check_run
    from ragen_jax.models import QwenConfig
    from ragen_jax.models.hf_convert import config_to_hf

    arch = QwenConfig.tiny(max_position_embeddings=2048)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(arch)))
    c = _with(model__path=str(tmp_path), rollout__max_model_len=4096)
    with pytest.raises(ConfigError, match=rf"^rollout\.max_model_len=4096 exceeds the model's "
                                          rf"max_position_embeddings=2048 \({tmp_path}/config\.json\)$"):
        check_run(resolve(from_config_dict(c)))
    c = _with(model__path=str(tmp_path), rollout__max_model_len=2048, rollout__env_groups=1,
              rollout__group_size=2, rollout__val__env_groups=2)
    assert check_run(resolve(from_config_dict(c))) is None


def test_parameter_counts_match_the_built_models():
    """The estimate's parameter counts are the models' own (all, and LoRA's adapters)."""
    from flax import nnx

    from ragen_jax.budget import parameters
    from ragen_jax.policy import build_actor, tiny_config

    for model in (ModelConfig(), ModelConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=96),
                  ModelConfig(lora_rank=4)):
        actor = build_actor(model, 0, abstract=not model.lora_rank)
        size = {kind: sum(x.size for x in jax.tree.leaves(nnx.state(actor, kind)))
                for kind in (nnx.Param, nnx.LoRAParam)}
        total, trained = parameters(tiny_config(model), model.lora_rank)
        assert total == size[nnx.Param] - size[nnx.LoRAParam]  # adapters are Params too
        assert trained == (size[nnx.LoRAParam] if model.lora_rank else total)


def test_a_batch_that_cannot_fit_is_refused_with_its_estimate_and_a_large_one_warned():
    """``rollout.group_size=1000000`` grew to ~20 GB before the kernel killed it: refused at
    once, naming the fields, the estimate and the memory there is. A batch whose typical rows
    may not fit is the start summary's warning; the presets pass silently."""
    from ragen_jax.budget import GIB, architecture, verdict
    from ragen_jax.config.summary import start_summary

    def plan(**fields: Any) -> Any:
        from configs import bandit

        c = bandit.get_config()
        for key, value in fields.items():
            section, name = key.split("__")
            c[section][name] = value
        return resolve(from_config_dict(c))

    host = 16 * GIB
    huge = plan(rollout__group_size=1_000_000)
    with pytest.raises(ConfigError) as e:
        verdict(huge, architecture(huge), None, host, backend="cpu")
    message = str(e.value)
    assert message.startswith("rollout.env_groups x rollout.group_size = 8 x 1000000 = 8000000 "
                              "rows: the run needs at least ")
    assert "of host memory (XLA:CPU's devices use it), which has 16.0 GiB (" in message
    assert "rollout KV cache" in message and "\n" not in message
    # On an accelerator the cache is device memory: the devices' pool is the one named.
    with pytest.raises(ConfigError, match="of device memory, which has 80.0 GiB"):
        verdict(huge, architecture(huge), 80 * GIB, host, backend="gpu")
    large = plan(rollout__group_size=10_000)
    warning = verdict(large, architecture(large), None, host, backend="cpu")
    assert warning.startswith("about ") and "it may not fit; lower rollout.env_groups x " \
                                            "rollout.group_size = 8 x 10000 (80000 rows)" in warning
    assert verdict(large, architecture(large), 1024 * GIB, host, backend="gpu") is None
    default = plan()
    assert verdict(default, architecture(default), None, host, backend="cpu") is None
    summary = start_summary(large, [], memory=warning)
    assert f"  warning      memory: {warning}" in summary.splitlines()


def _launch_refusal(tmp_path: Path, *overrides: str) -> str:
    """``launch.py``'s one-line refusal of the Bandit preset with ``overrides``, from its
    ``main`` in this process (imported, its exit raises SystemExit with the line instead of
    ending the process; the command itself: tests/test_train.py's one-line tests)."""
    import launch

    with pytest.raises(SystemExit) as refused:
        launch.main(["launch.py", "--config", str(ROOT / "configs/bandit.py"), *overrides,
                     f"--config.trainer.output_dir={tmp_path / 'run'}"])
    line = str(refused.value.code)
    assert "\n" not in line, line
    assert not (tmp_path / "run").exists()  # refused before the run folder was made
    return line


def test_launch_refuses_a_batch_that_cannot_fit_in_one_line(tmp_path):
    line = _launch_refusal(tmp_path, "--config.rollout.group_size=1000000")
    assert line.startswith("launch.py: rollout.env_groups x rollout.group_size = 8 x 1000000"), line


# -- values that once reached a traceback, or passed unchecked --------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"seed": 2**70}, f"seed must be in [0, {2**32 - 1}] (it seeds JAX's uint32 random keys"),
    ({"seed": -1}, "seed must be in [0, "),
    ({"trainer__total_steps": 2**70}, f"trainer.total_steps must be <= {2**31 - 1}"),
    ({"trainer__logger": ("nope",)}, "trainer.logger must be one of ('tensorboard', 'jsonl', "
                                     "'wandb', 'console'), got 'nope'"),
    ({"distributed__num_processes": 0}, "distributed.num_processes must be >= 1, got 0"),
    ({"distributed__process_id": 5}, "distributed.process_id must be in [0, "
                                     "distributed.num_processes=1), got 5"),
])
def test_out_of_range_run_values_name_the_field(fields, message):
    """``seed=2**70`` was an OverflowError traceback from JAX; ``trainer.logger=('nope',)`` a
    traceback after config.json was written; the others were accepted."""
    with pytest.raises(ConfigError) as e:
        from_config_dict(_with(**fields))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_mesh_the_devices_cannot_fill_names_the_mesh_fields():
    """``mesh.tensor=1000000`` was the Trainer's ValueError traceback: now a ``ConfigError``
    (one line from ``launch.py``) naming the fields."""
    from ragen_jax.sharding import make_mesh

    n = len(jax.devices())
    with pytest.raises(ConfigError, match=rf"^mesh.data x mesh.fsdp x mesh.tensor = 1 x 1 x "
                                          rf"1000000 needs 1000000 devices, {n} are available$"):
        make_mesh((1, 1, 1_000_000))
    with pytest.raises(ConfigError, match=r"^mesh.data x mesh.fsdp x mesh.tensor = \? x 1 x "
                                          r"1000000: the given axes"):
        make_mesh((-1, 1, 1_000_000))


@pytest.mark.parametrize("field, value, message", [
    ("max_model_len", 2**40, f"rollout.max_model_len={2**40} (an update row is padded to a "
                             f"multiple of {2**37} tokens"),
    ("max_turn", 10**9, "rollout.max_turn=1000000000 (the turn table holds 64 episodes x "
                        "1000000000 turns): the run needs at least "),
])
def test_lengths_past_the_memory_are_refused_by_the_budget(field, value, message):
    """``rollout.max_model_len=2**40`` and ``rollout.max_turn=1e9`` passed the start's memory
    check and ran out of memory 24-50 s later (an update row padded to an eighth of
    max_model_len; a turn table as wide as max_turn): the lower estimate counts both now."""
    from configs import bandit
    from ragen_jax.budget import GIB, architecture, verdict

    c = bandit.get_config()
    c.rollout[field] = value
    plan = resolve(from_config_dict(c))
    with pytest.raises(ConfigError) as e:
        verdict(plan, architecture(plan), None, 16 * GIB, backend="cpu")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("--config.mesh.tensor=1000000", "launch.py: mesh.data x mesh.fsdp x mesh.tensor = "),
    ("--config.env.name=nope", "launch.py: env: unknown env 'nope'; registered: "),
    ("--config.trainer.logger=('nope',)", "launch.py: trainer.logger must be one of "),
])
def test_launch_refuses_before_the_run_folder_is_touched(tmp_path, override, message):
    """Each was a traceback or left ``checkpoints/`` (a bad env name) or ``config.json`` (a
    bad logger) behind; now one line, and no run folder."""
    line = _launch_refusal(tmp_path, override)
    assert line.startswith(message), line


@pytest.mark.parametrize("env, name", [("frozenlake", "FrozenLake"), ("game2048", "2048")])
def test_a_size_that_is_no_board_is_refused_by_name(env, name):
    """``env.params.size=1e6`` (a float from the command line) reached an allocation of a
    million-square board, a 7 TiB numpy error or an out-of-memory at the first reset: the
    registry refuses a float for an int parameter, each env a size past its range."""
    from ragen_jax.envs import make

    with pytest.raises(ValueError, match=rf"^env '{env}': parameter size must be an int, got 1000000.0$"):
        make(env, size=1e6)
    with pytest.raises(ValueError, match=rf"^{name} size must be in \[2, 64\], got 1000000$"):
        make(env, size=10**6)
