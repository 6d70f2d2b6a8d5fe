"""The training loop end to end on a micro model: config loading and errors, resume after an
interruption (signal) and after a crash, export to transformers with the same greedy actions,
evaluation of a checkpoint, and the small pure pieces of the step."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from ragen_jax.config.loading import load_config
from ragen_jax.metrics import read_jsonl
from ragen_jax.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parent.parent


def micro_config(out: Path, *, steps: int = 4, estimator: str = "grpo", extra: tuple = (),
                 env: str = "bandit"):
    """Bandit (or ``env``) on a 1-layer width-64 model: seconds per step on a CPU. One layer:
    what a run does with its model (sampling, updates, checkpoints, export) is the same for
    any depth, and each run compiles less (depth is tests/models/'s)."""
    args = ["--config", str(ROOT / f"configs/{env}.py"),
            f"--config.trainer.output_dir={out}",
            f"--config.trainer.total_steps={steps}",
            "--config.trainer.save_freq=2", "--config.trainer.test_freq=2",
            "--config.trainer.progress=False",
            "--config.model.hidden_size=64", "--config.model.intermediate_size=128",
            "--config.model.num_hidden_layers=1",
            "--config.rollout.env_groups=2", "--config.rollout.group_size=4",
            "--config.rollout.val.env_groups=4", "--config.actor.ppo_mini_batch_size=4",
            # Mini-batches of 4 rows in one pass (the preset's 4 passes bound a real batch's
            # memory; accumulation is tests/starpo/test_optimizer_step.py's).
            "--config.actor.micro_batches=1", "--config.critic.micro_batches=1",
            "--config.warmstart.steps=3", "--config.warmstart.episodes=8",
            "--config.warmstart.batch_size=4", "--config.rollout.response_length=8",
            "--config.diagnostics.compute_freq=2", "--config.diagnostics.num_samples=8",
            f"--config.algorithm.adv_estimator={estimator}", *extra]
    return load_config(args)


def _without_timing(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    # (and the process's compiles: a resumed process compiles at its first step)
    return {s: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "compile/"))}
            for s, m in metrics.items()}


# -- config ------------------------------------------------------------------------------------


def test_config_overrides_and_errors():
    c = load_config(["--config", str(ROOT / "configs/sokoban.py"), "--config.actor.lr=2e-5",
                     "--config.env.params.dim_room=(8, 8)", "--config.rollout.prompt.enable_think=True"])
    assert c.actor.lr == 2e-5 and tuple(c.env.params.dim_room) == (8, 8) and c.rollout.prompt.enable_think
    bad = [(["--config.actor.lrr=1"], "actor.lrr"), (["--config.actor.lr=abc"], "actor.lr"),
           (["--config.trainer.total_steps=2.5"], "trainer.total_steps"),
           (["--config.nope.x=1"], "nope")]
    for extra, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            load_config(["--config", str(ROOT / "configs/sokoban.py"), *extra])
    with pytest.raises(ValueError, match="unknown preset"):
        load_config(["--config", str(ROOT / "configs/sokoban.py:huge")])


def test_presets_need_a_model_path(tmp_path):
    from ragen_jax.config.fields import ConfigError
    from ragen_jax.config.loading import from_config_dict

    c = load_config(["--config", str(ROOT / "configs/sokoban.py:qwen2.5-0.5b")])
    with pytest.raises(ConfigError, match="model.path is required"):
        from_config_dict(c)
    c = load_config(["--config", str(ROOT / "configs/sokoban.py:qwen2.5-0.5b"),
                     f"--config.model.path={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="model.path: no such folder"):
        from_config_dict(c)


def test_launch_bad_override_is_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--config", "configs/bandit.py",
                        "--config.actor.lrr=1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["launch.py: --config.actor.lrr: unknown field (see ragen_jax/config/schema.py)"]


def test_launch_bad_value_is_one_line_naming_the_field():
    """(In this process: ``launch.main``'s exit is the line; the command's stderr and exit
    status are the test above's.)"""
    import launch

    with pytest.raises(SystemExit) as refused:
        launch.main(["launch.py", "--config", str(ROOT / "configs/bandit.py"),
                     "--config.rollout.group_size=0"])
    assert refused.value.code == "launch.py: rollout.group_size must be >= 1, got 0"


def _launch_with_failing_run(body: str) -> subprocess.CompletedProcess:
    """``launch.py`` (Bandit preset) in a subprocess whose ``train.run`` runs ``body``."""
    indented = "".join(f"    {line}\n" for line in body.splitlines())
    code = ("import runpy, sys\n"
            "from ragen_jax import train\n"
            f"def failing(*args, **kwargs):\n{indented}"
            "train.run = failing\n"
            "sys.argv = ['launch.py', '--config', 'configs/bandit.py']\n"
            "runpy.run_path('launch.py', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_launch_exits_on_a_crash_that_a_thread_would_hold_open():
    """An error out of training prints its traceback and ends the process (exit 1), even when
    something still running would keep the interpreter's shutdown waiting (here a thread that
    never ends; seen on a GPU: the runtime after an out-of-memory error)."""
    r = _launch_with_failing_run("import threading\n"
                                 "threading.Thread(target=threading.Event().wait).start()\n"
                                 "raise RuntimeError('out of memory, say')")
    assert r.returncode == 1
    assert "RuntimeError: out of memory, say" in r.stderr


def test_launch_on_a_full_disk_is_one_line():
    """A write that finds the disk full (trajectories, TensorBoard, the metrics log; seen with
    a run folder on a small disk) ends the run with one line, not an OSError's traceback."""
    r = _launch_with_failing_run(
        "import errno\nraise OSError(errno.ENOSPC, 'No space left on device', 'runs/x/tb/events')")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "launch.py: no space left on device writing runs/x/tb/events; free space there and rerun "
        "the same command: it resumes from the last complete checkpoint"]


# -- pure pieces -------------------------------------------------------------------------------


def test_select_rows_pads_kept_groups_by_copies():
    from ragen_jax.starpo.rows import select_rows

    group_ids = np.repeat(np.arange(4), 3)  # 4 groups of 3
    keep = np.array([True, False, True, False])
    rows = select_rows(keep, group_ids, 4, np.random.default_rng(0))
    assert rows.size == 8 and set(rows[:6]) == {0, 1, 2, 6, 7, 8}
    assert set(rows[6:]) <= {0, 1, 2, 6, 7, 8}
    assert select_rows(np.zeros(4, bool), group_ids, 4, np.random.default_rng(0)).size == 0


def test_turn_ends_mark_last_sampled_token_of_each_turn():
    from ragen_jax.starpo.rows import turn_ends

    loss = np.array([[0, 1, 1, 0, 0, 1, 0]], bool)
    turns = np.array([[1, 1, 1, 2, 2, 2, 0]], np.int16)
    np.testing.assert_array_equal(turn_ends(loss, turns), [[0, 0, 1, 0, 0, 1, 0]])


def test_early_stop_rules():
    from types import SimpleNamespace

    from ragen_jax.early_stopping import Streaks, early_stop_reason

    rules = SimpleNamespace(stop_empty_after_filter=2, stop_reward_std_collapse=True,
                            stop_val_success_collapse=True)
    streaks = Streaks()
    empty = {"train/update_skipped_empty": 1.0}
    assert early_stop_reason(rules, streaks, empty, "T") is None
    assert early_stop_reason(rules, streaks, {"train/batch_size": 8.0}, "T") is None  # resets
    assert early_stop_reason(rules, streaks, empty, "T") is None
    assert early_stop_reason(rules, streaks, empty, "T") == "empty_after_filter"
    streaks = Streaks()
    for _ in range(10):  # the first ten steps set the reference std
        assert early_stop_reason(rules, streaks, {"rollout/in_group_reward_std": 1.0}, "T") is None
    reasons = [early_stop_reason(rules, streaks, {"rollout/in_group_reward_std": 0.05}, "T")
               for _ in range(10)]
    assert reasons[:9] == [None] * 9 and reasons[9] == "reward_std_collapse"
    streaks = Streaks()
    reasons = [early_stop_reason(rules, streaks, {"val-env/T/success": 0.0}, "T") for _ in range(5)]
    assert reasons == [None] * 4 + ["val_success_collapse"]


# -- the loop ----------------------------------------------------------------------------------


def _run(config, **kw):
    from ragen_jax.train import run

    return run(config, **kw)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    summary = _run(micro_config(out))
    return out, summary


def test_run_writes_metrics_checkpoints_and_trajectories(reference_run):
    out, summary = reference_run
    assert summary["step"] == 4
    metrics = read_jsonl(out / "metrics.jsonl")
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    for key in ("train/Bandit/success", "actor/pg_loss", "actor/entropy", "rollout/in_group_reward_std",
                "timing_s/gen", "train/Bandit/response_length"):
        assert key in metrics[1], key
    assert "val-env/Bandit/success" in metrics[0] and "val-env/BanditTest/success" in metrics[2]
    elapsed = [metrics[s]["timing_s/elapsed"] for s in range(5)]  # the process's wall clock
    assert all(a < b for a, b in zip(elapsed, elapsed[1:], strict=False)) and elapsed[-1] >= sum(
        metrics[s]["timing_s/step"] for s in range(1, 5))
    for kind in ("first_turn_sample", "trajectory_sample"):  # diagnostics every 2 steps
        for name in ("mi_estimate", "retrieval_accuracy", "retrieval_chance_level", "mi_zscore_ema",
                     "conditional_entropy_est", "mi_seq_estimate", "mi_zscore_ema_seq"):
            key = f"collapse_{kind}/{name}"
            assert np.isfinite(metrics[3][key]) and key not in metrics[2], key
    assert metrics[3]["collapse/first_turn_num_total"] == 8  # 2 groups x 4 episodes
    assert 0 <= metrics[3]["collapse/first_turn_num_valid"] <= 8
    assert metrics[3]["collapse/first_turn_valid_rate"] == metrics[3]["collapse/first_turn_num_valid"] / 8
    assert not any(k.startswith("collapse_grad/") for k in metrics[3])  # off by default
    assert "collapse/valid_thinking_rate" not in metrics[3]  # no <think> in the tiny preset
    assert metrics[0]["warmstart/loss_last"] < metrics[0]["warmstart/loss_first"]
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [0, 2, 4]
    assert (out / "trajectories" / "val_step00004.jsonl").is_file()
    assert json.loads((out / "config.json").read_text())["env"]["name"] == "bandit"
    assert list((out / "tb").iterdir())


def _stop_at(step: int, how: str):
    def on_step(done, _metrics):
        if done == step:
            if how == "signal":  # handled: the step finishes, a checkpoint is saved
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise RuntimeError("simulated crash")
    return on_step


@pytest.fixture(scope="module")
def stopped_run(reference_run, tmp_path_factory):
    """The reference config in one folder, stopped every way a run stops early, each rerun
    resuming the last: a SIGTERM at step 2 (also a periodic save: saved once), a crash at step
    3 (lost), a SIGTERM at step 3 (not a save step), a save of step 4 that fails on a full disk
    (in orbax's writer thread), then a rerun that finishes. ``{stage: summary or error}``."""
    import orbax.checkpoint as ocp

    from ragen_jax.checkpoint import CheckpointSaveError

    out = tmp_path_factory.mktemp("stopped")
    stages = {"signal_2": _run(micro_config(out), on_step=_stop_at(2, "signal"))}
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(micro_config(out), on_step=_stop_at(3, "crash"))
    stages["signal_3"] = _run(micro_config(out), on_step=_stop_at(3, "signal"))
    save = ocp.CheckpointManager.save

    def full_disk(manager, step, *args, **kw):
        if step == 4:
            junk = manager.directory / "4.orbax-checkpoint-tmp"
            junk.mkdir()
            (junk / "part").write_bytes(b"x" * 1000)
            raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device\nmore")
        return save(manager, step, *args, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ocp.CheckpointManager, "save", full_disk)
        with pytest.raises(CheckpointSaveError) as failed:
            _run(micro_config(out))
    stages["failed_save"] = failed.value
    stages["finished"] = _run(micro_config(out))
    return out, stages


def test_resume_after_signal_matches_uninterrupted(reference_run, stopped_run):
    ref_out, _ = reference_run
    out, stages = stopped_run
    assert stages["signal_2"]["interrupted"] and stages["signal_2"]["step"] == 2
    assert stages["signal_3"]["interrupted"] and stages["signal_3"]["step"] == 3
    assert stages["finished"]["resumed_from"] == 3 and stages["finished"]["step"] == 4
    assert _without_timing(read_jsonl(out / "metrics.jsonl")) == _without_timing(
        read_jsonl(ref_out / "metrics.jsonl"))
    # The crash at step 3 came after its row was logged; the rerun played step 3 again and
    # dropped that row first: one row a step, as in the uninterrupted run.
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [0, 1, 2, 3, 4]


def test_resume_after_crash_repeats_lost_steps_exactly(stopped_run):
    """The crash at step 3 lost it (its rerun resumed from step 2) and the rerun repeated it
    exactly: the folder's metrics equal the uninterrupted run's (the test above)."""
    _, stages = stopped_run
    assert stages["signal_3"]["resumed_from"] == 2


def test_a_failed_save_names_the_step_and_the_rerun_resumes_from_the_last_complete(stopped_run):
    """A save that fails stops the run with a message naming the step and the checkpoint a
    rerun resumes from; the rerun clears the half-written folder and repeats the lost steps
    exactly (the metrics: the signal test above)."""
    out, stages = stopped_run
    message = str(stages["failed_save"])
    for part in ("checkpoint of step 4 not written", "No space left on device",
                 "a rerun resumes from step 3", "trainer.keep_checkpoints"):
        assert part in message, (part, message)
    assert "\n" not in message
    assert stages["finished"]["resumed_from"] == 3 and stages["finished"]["step"] == 4
    assert not (out / "checkpoints" / "4.orbax-checkpoint-tmp").exists()


def test_signal_during_warm_start_exits_at_once_with_nothing_saved(tmp_path, monkeypatch, capfd):
    """Before the first step there is no step to finish: a SIGTERM in the warm start (a prior
    build may take many minutes) stops the run there, and the rerun starts over."""
    from ragen_jax import warmstart

    steps_run = []
    train_sft = warmstart.train_sft

    def interrupted(*args, progress=None, **kw):
        def on_step(done, loss):
            steps_run.append(done)
            if done == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if progress is not None:
                progress(done, loss)
        return train_sft(*args, progress=on_step, **kw)

    monkeypatch.setattr(warmstart, "train_sft", interrupted)
    monkeypatch.setenv("RAGEN_JAX_CACHE", str(tmp_path / "cache"))  # build it: no cached prior
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        _run(micro_config(tmp_path))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert steps_run == [1]  # the warm start's 3 steps did not run on
    assert "before the first training step" in capfd.readouterr().err
    assert not read_jsonl(tmp_path / "metrics.jsonl")
    assert not [p for p in (tmp_path / "checkpoints").glob("*") if p.name.isdigit()]
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler is gone


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_resume_frees_the_step_zero_state_before_reading_the_checkpoint(reference_run, tmp_path,
                                                                        monkeypatch):
    """A resume that held the freshly built state and the checkpoint's at once needed twice the
    memory; on a GPU, freeing one afterwards left too fragmented a heap for a 1.5B update."""
    from ragen_jax.train import Trainer

    ref_out, _ = reference_run
    shutil.copytree(ref_out / "checkpoints", tmp_path / "checkpoints")
    trainer = Trainer(micro_config(tmp_path))
    optimizer_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state.replace(actor=None)))
    assert optimizer_bytes > 0
    restore, seen = trainer.store.restore, {}

    def spy(step, like):
        seen["live"] = _live_bytes()
        return restore(step, like)

    monkeypatch.setattr(trainer.store, "restore", spy)
    before = _live_bytes()
    assert trainer.maybe_resume() and trainer.step == 4
    assert before - seen["live"] >= optimizer_bytes
    assert _live_bytes() <= before  # the restored state replaces the step-0 one


def test_an_untrained_start_saves_no_step_zero_checkpoint(tmp_path, capsys):
    """Step 0 is checkpointed only after a warm-start: a pretrained start is rebuilt from the
    config, and a 1.5B run's checkpoint (weights, critic, AdamW moments) is ~37 GB of disk.
    The run's start summary says the compute dtype ``auto`` took here, and why."""
    summary = _run(micro_config(tmp_path, steps=2, extra=("--config.warmstart.steps=0",
                                                          "--config.model.dtype=auto",
                                                          "--config.diagnostics.compute_freq=0")))
    assert summary["step"] == 2
    assert "\n  compute      float32 (model.dtype=auto, on XLA:CPU" in capsys.readouterr().out
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2]


def test_a_disk_too_small_for_the_checkpoints_is_named_before_training(tmp_path, monkeypatch):
    """Checked at the start, not hours later at the first save: no room for one checkpoint is
    an error naming ``trainer.output_dir``; room for fewer than ``keep_checkpoints`` + 1 (the
    one being written) is a printed warning naming ``trainer.keep_checkpoints``."""
    import shutil as shutil_module

    from ragen_jax.checkpoint import CheckpointSaveError, nbytes, size_text
    from ragen_jax.train import Trainer

    assert size_text(34 * 2**30 + 2**29) == "34.5 GiB" and size_text(3 * 2**20) == "3.0 MiB"
    trainer = Trainer(micro_config(tmp_path))
    size = nbytes(trainer._checkpoint_items())
    assert size >= 3 * sum(x.nbytes for x in jax.tree.leaves(trainer.state.actor))  # + AdamW's moments
    usage = shutil_module.disk_usage(tmp_path)
    for free, expect in ((size // 2, "error"), (3 * size // 2, "larger disk"),
                         (2 * size, "trainer.keep_checkpoints=1 or"), (10 * size, None)):
        monkeypatch.setattr(shutil_module, "disk_usage",
                            lambda _path, free=free: usage._replace(free=free))
        if expect == "error":
            with pytest.raises(CheckpointSaveError, match="trainer.output_dir: one checkpoint"):
                trainer.store.space_note(size)
        elif expect is not None:
            note = trainer.store.space_note(size)
            assert f"trainer.keep_checkpoints=3 needs {size_text(size * 4)}" in note
            assert expect in note, note
        else:
            assert trainer.store.space_note(size) is None


def test_ppo_with_critic_lora_and_kl_runs(tmp_path):
    """GAE with a critic, LoRA, a KL penalty against the reference policy, logprobs recomputed
    by the trainer and <think> answers in one run. (The gradient analysis in a run is
    tests/test_distributed.py's; its norms, the KL's included, tests/starpo/test_gradient_analysis.py's.)"""
    summary = _run(micro_config(tmp_path, steps=2, estimator="gae", extra=(
        "--config.trainer.val_before_train=False", "--config.model.lora_rank=4",
        "--config.algorithm.kl_coef=0.01", "--config.actor.recompute_logprobs=True",
        "--config.rollout.prompt.enable_think=True", "--config.rollout.response_length=24")))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert summary["step"] == 2
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/kl_loss", "rollout/ref_kl"):
        assert np.isfinite(metrics[2][key]), key
    assert not any(k.startswith("collapse_grad/") for k in metrics[1])  # off by default
    assert metrics[1]["rollout/logprob_gap"] < 1e-3  # trainer and sampler agree
    assert 0.0 <= metrics[1]["collapse/valid_thinking_rate"] <= 1.0  # logged with enable_think


@pytest.mark.parametrize("estimator, extra", [
    ("reinforce_plus_plus_baseline", ("--config.algorithm.reward_norm_grouping=batch",  # BRPO
                                      "--config.algorithm.reward_norm_method=mean_std",
                                      "--config.filter.metric=entropy_variance")),
    ("reinforce_plus_plus", ("--config.algorithm.reward_norm_grouping=state",
                             "--config.algorithm.reward_norm_method=asym_clip",
                             "--config.filter.metric=entropy", "--config.filter.strategy=top_k",
                             "--config.filter.value=0.5")),
])
def test_reward_normalisation_estimators_and_entropy_filter_run(tmp_path, estimator, extra):
    summary = _run(micro_config(tmp_path, steps=2, estimator=estimator, extra=(
        "--config.trainer.val_before_train=False", "--config.diagnostics.compute_freq=0", *extra)))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert summary["step"] == 2
    for step in (1, 2):
        for key in ("actor/pg_loss", "rollout/in_group_entropy_mean", "rollout/in_group_entropy_std"):
            assert np.isfinite(metrics[step][key]), key
        assert metrics[step]["rollout/in_group_entropy_mean"] > 0
        if "batch" in extra[0]:  # the update sees batch z-scores: mean 0 over the unfiltered batch
            assert abs(metrics[step]["critic/score_mean"]) < 1e-5
        else:  # one group of two kept; its scores are z-scores clamped to [-1, 3]
            assert metrics[step]["rollout/filter_kept_count"] == 1
            assert -1.0 <= metrics[step]["critic/score_mean"] <= 3.0


def test_export_loads_in_transformers_with_the_same_greedy_actions(reference_run, tmp_path):
    torch = pytest.importorskip("torch")
    import jax
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_jax.export import export
    from ragen_jax.policy import load_policy
    from ragen_jax.rollout.context import ChatFormat
    from ragen_jax.rollout.sampler import Sampler
    from ragen_jax.rollout.sampling import SamplingParams

    run_dir, _ = reference_run
    hf_dir = export(run_dir, tmp_path / "hf")
    actor, tok, _, step = load_policy(run_dir)
    assert step == 4
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    trajs = [json.loads(x) for x in (run_dir / "trajectories" / "val_step00004.jsonl").read_text().splitlines()]
    chat = ChatFormat(hf_tok, dataclasses.replace(RolloutConfig().context, enable_think=False))
    prompts = [chat.first_chunk(t["messages"][0]["content"], t["messages"][1]["content"]) for t in trajs]
    ids = [hf_tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert ids == [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    sampler = Sampler(actor, pad_id=tok.pad_token_id or 0)
    out = sampler(ids, key=jax.random.key(0), params=SamplingParams(max_new_tokens=8, temperature=0.0),
                  stop_tokens=chat.stop_ids)
    ours = np.asarray(out.tokens)
    lengths = np.asarray(out.lengths)
    for b, prompt in enumerate(ids):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              eos_token_id=[int(x) for x in chat.stop_ids],
                              pad_token_id=tok.pad_token_id or 0)
        theirs = gen[0, len(prompt):].tolist()
        assert theirs == ours[b, : lengths[b]].tolist()


@pytest.mark.parametrize("env", ["bandit", "mixed_countdown"])
def test_export_restores_the_actor_without_envs_or_optimizers(env, request, tmp_path,
                                                             monkeypatch):
    """Bandit's run and the Countdown mix's (a multi-env run's config, a grid env and host
    envs whose worker processes must not start) export without building an env, a sampler or
    an optimizer."""
    import jax

    import ragen_jax.envs.registry
    import ragen_jax.rollout.sampler
    import ragen_jax.starpo.optimizer_step
    import ragen_jax.starpo.update
    import ragen_jax.train
    from ragen_jax.export import main as export_main
    from ragen_jax.models import from_pretrained
    from ragen_jax.policy import load_policy

    run_dir = request.getfixturevalue("reference_run" if env == "bandit" else "countdown_mix_run")[0]

    def forbidden(*_a, **_k):
        raise AssertionError("export built an env, a sampler or an optimizer")

    for module, name in ((ragen_jax.envs.registry, "make"), (ragen_jax.train, "build_envs"),
                         (ragen_jax.starpo.optimizer_step, "make_optimizer"),
                         (ragen_jax.starpo.update, "make_optimizer"),
                         (ragen_jax.rollout.sampler.Sampler, "__init__")):
        monkeypatch.setattr(module, name, forbidden)
    out = export_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")])
    actor, _, run, step = load_policy(run_dir)
    assert run.env.name == ("bandit" if env == "bandit" else "mixed")
    assert step == (4 if env == "bandit" else 2)
    exported = from_pretrained(out)
    for a, b in zip(jax.tree.leaves(nnx.state(actor, nnx.Param)),
                    jax.tree.leaves(nnx.state(exported, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if env == "bandit":  # --dtype: the weights cast, and config.json saying so to any reader
        import json

        import jax.numpy as jnp

        out16 = export_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "hf16"),
                             "--dtype", "bfloat16"])
        hf = json.loads((out16 / "config.json").read_text())
        assert hf["torch_dtype"] == hf["dtype"] == "bfloat16"
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
        exported16 = from_pretrained(out16, dtype=jnp.bfloat16)
        for a, b in zip(jax.tree.leaves(nnx.state(actor, nnx.Param)),
                        jax.tree.leaves(nnx.state(exported16, nnx.Param)), strict=True):
            assert b.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_export_of_a_missing_run_is_one_line(tmp_path):
    from ragen_jax.export import main as export_main

    with pytest.raises(SystemExit) as exc:
        export_main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")])
    assert "is not a run folder" in str(exc.value) and "\n" not in str(exc.value)


def test_eval_from_checkpoint(reference_run, tmp_path):
    from ragen_jax.eval import main

    run_dir, _ = reference_run
    summary = main(["--checkpoint", str(run_dir), "--config.rollout.val.env_groups=4",
                    "--out", str(tmp_path / "ev"), "--config.rollout.val.temperature=0.0"])
    # Validation's envs: 4 Bandit episodes, then 4 of its BanditTest validation env.
    assert summary["env"] == "bandit" and summary["episodes"] == 8
    assert summary["metrics"]["Bandit/success"] >= 0 and "BanditTest/success" in summary["metrics"]
    assert (tmp_path / "ev" / "viewer.html").is_file()
    # The run's prompt wording (the tiny preset's compact turn template) is used, so the
    # evaluation reads exactly what validation read on the same seeds.
    ours = [json.loads(x) for x in (tmp_path / "ev" / "trajectories.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (run_dir / "trajectories" / "val_step00004.jsonl").read_text().splitlines()]
    assert [t["messages"][:2] for t in ours] == [t["messages"][:2] for t in val]
    assert "Always output" not in ours[0]["messages"][1]["content"]


def test_turn_template_reaches_the_prompt(tmp_path):
    from ragen_jax.config.loading import from_config_dict
    from ragen_jax.config.resolve import resolve

    def context(config):
        return resolve(from_config_dict(config)).rollout.context

    default = context(micro_config(tmp_path, extra=("--config.rollout.prompt.turn_template=",)))
    assert "Always output" in default.turn_template  # RAGEN's wording
    custom = micro_config(tmp_path, extra=("--config.rollout.prompt.turn_template=T{turn} {state} {actions_left}\n",))
    assert context(custom).turn_template == "T{turn} {state} {actions_left}\n"


def test_warmstart_is_cached_by_its_inputs(tmp_path, monkeypatch):
    import chex

    from ragen_jax.train import Trainer

    cache = tmp_path / "cache"
    monkeypatch.setenv("RAGEN_JAX_CACHE", str(cache))
    params = lambda t: nnx.state(t.actor, nnx.Param)  # noqa: E731
    first = Trainer(micro_config(tmp_path / "a"))
    built = first.warmstart()
    assert first.warmstart_loaded_from is None and len(list(cache.iterdir())) == 1
    # Another run of the same prior (another run seed, the warm-start's pinned) loads it.
    again = Trainer(micro_config(tmp_path / "b", extra=("--config.seed=3", "--config.warmstart.seed=0")))
    assert again.warmstart() == built  # the build's metrics, so step 0 logs the same
    assert again.warmstart_loaded_from == first.warm_start.folder(0)
    chex.assert_trees_all_equal(params(first), params(again))
    # Changing what makes it builds another; a broken copy is rebuilt, not read.
    other = Trainer(micro_config(tmp_path / "c", extra=("--config.warmstart.lr=5e-3",)))
    other.warmstart()
    assert other.warmstart_loaded_from is None and len(list(cache.iterdir())) == 2
    (first.warm_start.folder(0) / "params.safetensors").write_bytes(b"broken")
    rebuilt = Trainer(micro_config(tmp_path / "d"))
    rebuilt.warmstart()
    assert rebuilt.warmstart_loaded_from is None
    chex.assert_trees_all_equal(params(first), params(rebuilt))  # deterministic
    reread = Trainer(micro_config(tmp_path / "e"))
    reread.warmstart()
    assert reread.warmstart_loaded_from is not None
    worded = Trainer(micro_config(tmp_path / "f", extra=("--config.rollout.prompt.system_template=Push. {actions}",)))
    assert worded.warm_start.folder(0) != first.warm_start.folder(0)  # the prompt made it too
    # RL's context window and score placement change no warm-start data: the same prior.
    windowed = Trainer(micro_config(tmp_path / "g", extra=(
        "--config.rollout.window.mode=limited", "--config.rollout.window.turns=1",
        "--config.algorithm.sample_unit=turn")))
    turn_scores = Trainer(micro_config(tmp_path / "h", extra=("--config.rollout.use_turn_scores=True",)))
    # Nor do RL's batch shape and validation settings.
    batches = Trainer(micro_config(tmp_path / "i", extra=(
        "--config.rollout.group_size=8", "--config.rollout.env_groups=3",
        "--config.rollout.val.env_groups=6", "--config.rollout.val.temperature=0.9")))
    assert (windowed.warm_start.folder(0) == turn_scores.warm_start.folder(0)
            == batches.warm_start.folder(0) == first.warm_start.folder(0))
    longer = Trainer(micro_config(tmp_path / "j", extra=("--config.rollout.max_turn=3",)))
    assert longer.warm_start.folder(0) != first.warm_start.folder(0)  # the episodes' length does


def test_single_turn_rows_can_come_from_their_own_mixture(tmp_path, monkeypatch):
    """``warmstart.turns.solver_share``: the single-turn rows are cut from episodes of that
    share (another data seed), the whole-episode stage keeps ``solver_share``'s; unset, both
    stages read one data set. ``warmstart.turns.episodes``: that many rows' episodes, one per level."""
    import ragen_jax.warmstart as warmstart
    from ragen_jax.train import Trainer

    calls, sizes, real = [], [], warmstart.warmstart_data

    def recording(*args, **kw):
        calls.append((kw["solver_share"], kw["seed"], kw.get("observation_rows") is not None))
        sizes.append((kw["episodes"], kw.get("group_size", 0)))
        return real(*args, **kw)

    monkeypatch.setattr(warmstart, "warmstart_data", recording)
    env = ("--config.warmstart.turns.steps=2", "--config.warmstart.turns.batch_size=4")
    own = Trainer(micro_config(tmp_path / "a", env="frozenlake", extra=(
        *env, "--config.warmstart.solver_share=0.3", "--config.warmstart.turns.solver_share=1.0",
        "--config.warmstart.seed=0", "--config.warmstart.cache=False")))
    metrics = own.warmstart()
    assert calls == [(0.3, 0, False), (1.0, 1, True)]
    assert np.isfinite(metrics["warmstart/turn_loss_last"]) and np.isfinite(metrics["warmstart/loss_last"])
    monkeypatch.setattr(warmstart, "train_sft", lambda *a, **k: [0.0])  # the data is what is checked
    calls.clear()
    Trainer(micro_config(tmp_path / "b", env="frozenlake", extra=(
        *env, "--config.warmstart.solver_share=0.3", "--config.warmstart.seed=0",
        "--config.warmstart.cache=False"))).warmstart()
    assert calls == [(0.3, 0, True)]
    calls.clear()
    sizes.clear()
    rows = Trainer(micro_config(tmp_path / "c", env="frozenlake", extra=(
        *env, "--config.warmstart.solver_share=0.3", "--config.warmstart.turns.solver_share=1.0",
        "--config.warmstart.turns.episodes=12", "--config.warmstart.episodes=8", "--config.warmstart.seed=0",
        "--config.warmstart.cache=False")))
    rows.warmstart()
    assert calls == [(0.3, 0, False), (1.0, 1, True)] and sizes == [(8, 0), (12, 1)]


@pytest.fixture(scope="module")
def countdown_mix_run(tmp_path_factory):
    """configs/mixed_countdown.py on the micro model, one group of SimpleSokoban and one of
    Countdown per step, and a third entry: Countdown whose every reset hangs forever (one
    training group, no validation groups). Two steps, no warm start (the warm start of a mix:
    the presets run below), trained with GiGPO (per-turn advantages from the JAX env's state
    hashes and the host env's texts, the hung episodes in no group; the other estimators run
    in the runs above) on scores normalised by each row's env (the inductive grouping), and
    diagnosed on the mixed batch; ``(folder, summary, what normalize_batch saw each step)``."""
    import ragen_jax.train as train
    from ragen_jax.envs import register
    from tests.rollout.faulty_envs import HangingCountdown

    register("hanging_countdown", HangingCountdown)
    out = tmp_path_factory.mktemp("countdown_mix")
    c = micro_config(out, steps=2, env="mixed_countdown", estimator="gigpo", extra=(
        "--config.env.mix.SimpleSokoban.groups=1", "--config.env.mix.Countdown.groups=1",
        "--config.rollout.max_turn=2", "--config.trainer.val_before_train=False",
        "--config.warmstart.steps=0", "--config.algorithm.reward_norm_grouping=inductive",
        "--config.algorithm.reward_norm_method=mean"))
    sokoban, countdown = c.env.mix
    hanging = dict(countdown, name="hanging_countdown", tag="Hanging", val_groups=0,
                   params=dict(countdown["params"], step_timeout=1.0))
    c.env.mix = (dict(sokoban, val_groups=2), dict(countdown, val_groups=2), hanging)
    c.rollout.env_groups = 3
    seen = []
    real = train.normalize_batch

    def spy(batch, scores, tag_ids, rows, grouping, method, **kw):
        normed = real(batch, scores, tag_ids, rows, grouping, method, **kw)
        seen.append((np.asarray(tag_ids).copy(), np.asarray(batch.scores), normed.scores,
                     np.asarray(kw["valid"]).reshape(-1)))  # valid: [groups, group_size]
        return normed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "normalize_batch", spy)
        summary = _run(c)
    return out, summary, seen


@pytest.mark.timeout(600)  # the first to set up the run with the hanging env
def test_mixed_countdown_and_sokoban_run(countdown_mix_run):
    """The run's one-step host env with its own rollout budget next to a multi-turn JAX env:
    two updates with finite losses, per-tag metrics and validation, the collapse diagnostics
    on the mixed batch, and the inductive normaliser seeing each row's env."""
    tmp_path, summary, seen = countdown_mix_run
    assert summary["step"] == 2
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    tags = ("SimpleSokoban", "Countdown")
    for step in (1, 2):
        m = metrics[step]
        for tag in tags:
            for name in ("success", "score", "num_turns", "pass@4", "response_length"):
                assert f"train/{tag}/{name}" in m, (step, tag, name)
        assert m["train/Countdown/num_turns"] == 1.0  # the entry's own max_turn=1
        assert m["train/batch_size"] == 8  # the hanging env's group left out: the test below
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert np.isfinite(m[key]), key
        assert 0.0 <= m["rollout/pad_fraction"] < 1.0
        # GiGPO's anchor groups: every group's first turns share its reset state (Sokoban's
        # by the state's hash, Countdown's by its text); the hung episodes count in none.
        assert 0.5 <= m["rollout/anchored_turns"] <= 1.0 and m["rollout/anchor_group_size"] >= 1
    assert np.isfinite(metrics[1]["collapse_first_turn_sample/mi_estimate"])  # on the mixed batch
    for tag in tags:
        assert f"val-env/{tag}/success" in metrics[2]
    val = [json.loads(x) for x in (tmp_path / "trajectories" / "val_step00002.jsonl").read_text().splitlines()]
    assert [(t["tag"], t["seed"]) for t in val] == [
        ("SimpleSokoban", 123), ("SimpleSokoban", 124), ("Countdown", 123), ("Countdown", 124)]
    assert len(seen) == 2
    for tag_ids, raw, normed, valid in seen:  # the rows' envs, a group of 4 each, in mix order
        np.testing.assert_array_equal(tag_ids, [0] * 4 + [1] * 4 + [2] * 4)
        np.testing.assert_array_equal(valid, [True] * 8 + [False] * 4)  # the hung episodes
        means = np.repeat([raw[:4].mean(), raw[4:8].mean()], 4)
        np.testing.assert_allclose(normed[:8], raw[:8] - means, atol=1e-6)


def test_windowed_sokoban_preset_trains_turn_rows_and_diagnoses_first_turns(tmp_path):
    """The Sokoban preset's windowed turns (limited, k=1, one row per turn) on the micro model:
    finite updates over turn rows, and the collapse diagnostics keep the first-turn pairs (the
    policy read the transcript's first prompt) but not the trajectory pairs (later turns saw
    only their window)."""
    summary = _run(micro_config(tmp_path, steps=2, env="sokoban", extra=(
        "--config.rollout.max_turn=2", "--config.warmstart.turns.steps=2",
        "--config.warmstart.turns.episodes=8", "--config.warmstart.turns.batch_size=4",
        "--config.trainer.val_before_train=False")))
    assert summary["step"] == 2
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    m = metrics[1]  # diagnosed (every 2 steps, from the first)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm",
                "collapse_first_turn_sample/mi_estimate", "collapse_first_turn_sample/mi_zscore_ema"):
        assert np.isfinite(m[key]), key
    assert not any(k.startswith("collapse_trajectory_sample/") for k in m)
    assert m["train/batch_size"] > m["rollout/num_trajectories"] == 8  # a row per answered turn
    assert "val-env/Sokoban/success" in metrics[2]


def mix_config(out: Path, envs: dict[str, dict], *, steps: int = 2, extra: tuple = ()):
    """``micro_config`` over ``env.mix``: one group and one validation group of each env of
    ``envs`` (``{config name: its own rollout fields}``), each with its own preset's params
    and per-env rollout settings (as configs/mixed_countdown.py builds them), over those."""
    from configs import mixed_countdown

    c = micro_config(out, steps=steps, env="mixed", extra=extra)
    entries = []
    for name, rollout in envs.items():
        own = importlib.import_module(f"configs.{name}").get_config("tiny")
        entries.append(dict(name=own.env.name, tag=own.env.tag or "", groups=1, val_groups=1,
                            params=own.env.params.to_dict(),
                            rollout=mixed_countdown._own_rollout(own, c) | rollout))
    c.env.mix = tuple(entries)
    c.rollout.env_groups = c.rollout.val.env_groups = len(entries)
    return c


def _needs(module: str, extra: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module} (pip install 'ragen_jax[{extra}]')")


# config name, tag, max turns, response length, the module it needs and its extra (None: none)
_DATA_ENVS = (("metamathqa", "MetamathQA", 3, 16, None, None),
              ("deepcoder", "DeepCoder", 1, 32, None, None),
              ("search", "SearchQA", 5, 32, "bm25s", "search"),
              ("textworld", "TextWorld", 3, 16, "textworld", "textworld"),
              ("gem", "GuessTheNumber", 4, 16, "gem", "gem"))
# The run plays at most two turns of each env: multi-turn (an observation after an answer)
# all the same, without the long transcripts (up to max_model_len) that made most of its
# time in sampling and updates. Longer episodes of each env are played in its env test
# (tests/envs/test_metamathqa.py, test_search.py, test_textworld_env.py, test_gem_env.py).
_DATA_TURNS = 2


# The solver envs' own rollout fields in the presets run: two turns, a shorter answer.
_SOLVER_ENVS = {"game2048": ("Game2048", 24), "rubikscube": ("RubiksCube", 24)}


@pytest.fixture(scope="module")
def presets_run(tmp_path_factory):
    """One mixed run on the micro model over the presets' envs that no other run trains:
    configs/game2048.py and configs/rubikscube.py (two turns each), configs/metamathqa.py
    (our 26-question sample; answers retried, RAGEN's retries), configs/deepcoder.py (our
    16-problem sample; one program each, run in the sandbox inside the env's worker processes:
    the format warm-start's and any the model writes), configs/search.py (our 6-question sample
    and 8-passage BM25 corpus; searches and answers), configs/textworld.py (8 coin-collector
    games, compiled into the temp dir's cache on first use) and configs/gem.py (GEM's
    GuessTheNumber), those whose packages are installed, each with its own preset's params and
    answer length and its own turns up to ``_DATA_TURNS``. One run: the update, the warm start
    and validation compile once for all of them. The warm start draws only moves that change
    the board (2048's preset's setting; the free-text envs draw their own answers)."""
    out = tmp_path_factory.mktemp("presets")
    envs = {name: {"response_length": length, "max_turn": min(turns, _DATA_TURNS),
                   "max_actions_per_traj": min(turns, _DATA_TURNS)}
            for name, _, turns, length, module, _ in _DATA_ENVS
            if module is None or importlib.util.find_spec(module) is not None}
    envs |= {name: {"response_length": length, "max_turn": _DATA_TURNS}
             for name, (_, length) in _SOLVER_ENVS.items()}
    summary = _run(mix_config(out, envs, extra=(
        "--config.rollout.response_length=32", "--config.rollout.max_turn=2",
        "--config.warmstart.legal_actions=True", "--config.trainer.val_before_train=False",
        # The collapse diagnostics are the windowed Sokoban test's; here they only compile.
        "--config.diagnostics.compute_freq=0")))
    return summary, read_jsonl(out / "metrics.jsonl")


@pytest.mark.parametrize("tag", [tag for tag, _ in _SOLVER_ENVS.values()])
def test_game2048_and_cube_presets_train_two_steps(tag, presets_run):
    """2048 and the cube in the presets run (the fixture): two updates with finite losses and
    each env's metrics."""
    summary, metrics = presets_run
    assert summary["step"] == 2
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", f"train/{tag}/success"):
        assert np.isfinite(metrics[1][key]), key
    assert 1.0 <= metrics[1][f"train/{tag}/num_turns"] <= _DATA_TURNS
    assert f"val-env/{tag}/success" in metrics[2]
    assert f"warmstart/{tag}/effective_action_rate" in metrics[0]  # the mix's prior, per env


@pytest.mark.parametrize("tag,max_turns", [
    pytest.param(tag, turns, marks=() if module is None else _needs(module, extra))
    for _, tag, turns, _, module, extra in _DATA_ENVS])
def test_data_env_presets_train_two_steps(presets_run, tag, max_turns):
    """Each data env of the presets run (the fixture): two updates with finite losses, its own
    turns, no env errors. (Their validation is held out: tests/test_held_out.py.)"""
    summary, metrics = presets_run
    assert summary["step"] == 2
    for step in (1, 2):
        m = metrics[step]
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", f"train/{tag}/success"):
            assert np.isfinite(m[key]), key
        assert 1.0 <= m[f"train/{tag}/num_turns"] <= min(max_turns, _DATA_TURNS)
        assert m["rollout/env_errors"] == 0
    assert f"val-env/{tag}/success" in metrics[2]


@pytest.mark.timeout(600)
def test_a_run_with_a_hanging_env_in_its_mix_finishes(countdown_mix_run):
    """The Countdown mix's hanging entry (every reset hangs forever): two steps finish, the
    hung episodes are env errors (their workers killed), and the update trains on the rest."""
    tmp_path, summary, _ = countdown_mix_run
    assert summary["step"] == 2
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    for s in (1, 2):
        assert metrics[s]["rollout/env_errors"] == 4  # the hanging group's four episodes
        assert metrics[s]["train/Hanging/env_error_rate"] == 1.0
        assert metrics[s]["train/batch_size"] == 8  # Sokoban's and Countdown's groups only
        assert np.isfinite(metrics[s]["actor/pg_loss"])
