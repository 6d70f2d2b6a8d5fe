"""The StarPO training loop: ``run(config)`` (what ``launch.py`` calls).

A training step: play the step's env groups with the current policy (rollout), keep the
groups whose rewards carry signal (StarPO-S / SNR filtering), build the update's rows, and
run the jitted update (old log-probs, reference, values, advantages, critic and actor
epochs: ``starpo.update``). Every ``test_freq`` steps validation on the fixed seeds, every
``save_freq`` steps an orbax checkpoint.

Reproducibility: everything random is a function of ``(seed, step)`` (env seeds, sampling,
the duplicated rows that pad a filtered batch), and a checkpoint holds the ``TrainState``
plus the host-side counters, so a run resumed from the checkpoint of step k computes exactly
what the uninterrupted run computed after step k. SIGINT/SIGTERM finish the current step,
save, and exit (before the first step, during a warm start or step 0's validation, they exit at
once); a restart with the same ``output_dir`` resumes from the last checkpoint, dropping the
``metrics.jsonl`` rows of the steps it plays again. One process trains in a run folder at a
time: the trainer locks it (``run_lock``) before writing or deleting anything there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from ragen_jax import distributed as dist
from ragen_jax.budget import check_run
from ragen_jax.checkpoint import (
    CheckpointRestoreError,
    CheckpointStore,
    abstract,
    check_writable,
    nbytes,
)
from ragen_jax.collapse_monitor import KINDS, CollapseMonitor
from ragen_jax.compilation import CompileWatch, enable_persistent_cache, progress_note
from ragen_jax.config.fields import ConfigError
from ragen_jax.config.loading import from_config_dict, to_config_dict, use_run_snapshot
from ragen_jax.config.resolve import micro_batch_warning, resolve
from ragen_jax.config.schema import RunConfig
from ragen_jax.config.summary import SETTINGS_FILE, full_settings, start_summary
from ragen_jax.early_stopping import Streaks, early_stop_reason
from ragen_jax.envs import make
from ragen_jax.host_memory import return_large_frees_to_os
from ragen_jax.metrics import MetricsLogger, device_memory, make_sinks
from ragen_jax.models import compute_copy, hf_folder
from ragen_jax.policy import build_actor, build_state, load_tokenizer, stop_ids
from ragen_jax.progress import Phase
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.batch import RolloutBatch, padding_fraction
from ragen_jax.rollout.mix import (
    EnvSlot,
    collect_train,
    collect_val,
    tag_metrics,
    validation_levels,
)
from ragen_jax.rollout.sampler import Sampler
from ragen_jax.run_lock import lock_run_folder, release_run_folder
from ragen_jax.shapes import HighWater, update_multiple
from ragen_jax.sharding import make_mesh
from ragen_jax.starpo import gradient_analysis
from ragen_jax.starpo.anchors import anchored_turns, turn_table
from ragen_jax.starpo.estimators import NEEDS_TURNS
from ragen_jax.starpo.filtering import ENTROPY_METRICS, filter_groups, trajectory_entropies
from ragen_jax.starpo.normalization import normalize_batch
from ragen_jax.starpo.rows import (
    RowSettings,
    build_step_batch,
    calibrate_widths,
    gather_episodes,
    most_rows,
)
from ragen_jax.starpo.update import make_update
from ragen_jax.viewer import render_html
from ragen_jax.warmstart import WarmStart

# Rollout metrics that count (summed over processes); the others are per-episode means.
ROLLOUT_COUNTS = tuple(f"rollout/{k}" for k in (
    "num_trajectories", "num_groups", "tokens", "sampled_tokens", "length_truncated",
    "truncated", "unplaced_scores", "env_errors", "redrawn_levels", "prompt_tokens", "prefill_tokens"))


class Trainer:
    """Holds a run; ``train()`` runs (or resumes) it to ``trainer.total_steps``."""

    def __init__(self, config: ConfigDict | RunConfig, *,
                 on_step: Callable[[int, dict], None] | None = None):
        self.created = time.perf_counter()  # `timing_s/elapsed`: wall seconds of this process's run
        self.compiles = CompileWatch()  # XLA compiles per step (compile/count, compile/seconds)
        self.run = run = config if isinstance(config, RunConfig) else from_config_dict(config)
        self.plan = resolve(run)
        self.on_step = on_step
        self.is_main = jax.process_index() == 0
        self.out = self.plan.output_dir
        self.mesh = make_mesh(run.mesh.shape)
        warning = micro_batch_warning(self.plan.step, self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        if warning and self.is_main:
            print(warning, flush=True)
        # What a bad config can refuse comes before the run folder is touched: a bad env
        # name or parameter must not leave a folder (or a lock) behind.
        envs = build_envs(run)
        self.tokenizer = load_tokenizer(run.model)
        eos = stop_ids(run.model)
        check_writable(self.out)  # now, not at the first write after a warm start
        # Before anything in the folder is written or deleted: the store's writer deletes
        # unfinished saves, which may be another live run's save in progress.
        self.lock = lock_run_folder(self.out, jax.process_index())
        self.store = CheckpointStore(self.out / "checkpoints", keep=run.trainer.keep_checkpoints,
                                     writer=True)
        # Resuming: the checkpoint holds every trained weight, so the folder's are not read.
        self.actor = build_actor(run.model, run.seed, self.mesh,
                                 weights=self.store.latest_step() is None)
        # The run's envs in order (several with env.mix), each with its share of the groups.
        # Every run records its turns' anchor states: GiGPO trains on them, and the
        # rollout/anchored_* metrics say how often states repeat under any estimator.
        self.slots = [EnvSlot(AgentRollout(env, params, self.tokenizer, self.plan.rollout_for(spec),
                                           tag=tag, eos_ids=eos, record_anchors=True),
                              spec.groups, spec.val_groups)
                      for spec, (tag, (env, params)) in zip(
                          self.plan.envs, envs.items(), strict=True)]
        self.rollouts = {slot.tag: slot.rollout for slot in self.slots}
        # Validation is held out by level, not by seed: training and the prior's data skip
        # every level a validation env plays (small generators repeat levels across seeds),
        # and Sokoban every validation room (envs.levels.holdout_hash).
        self.held_out = (validation_levels(self.slots, self.plan.rollout)
                         if run.rollout.val.held_out else np.zeros(0, np.uint64))
        for slot in self.slots:
            slot.rollout.hold_out(self.held_out)
        self.tag = self.slots[0].tag  # the first env's (with one env, the run's)
        # Rollouts are process-local: each process samples its share with a local replica,
        # stored in the compute dtype (the actor holds the float32 master weights).
        self.local_mesh = dist.local_mesh(self.mesh)
        self.policy = dist.local_replica(compute_copy(self.actor), self.mesh, self.local_mesh)
        self.sampler = Sampler.for_rollout(self.policy, run.rollout,
                                           pad_id=self.tokenizer.pad_token_id or 0)
        # Shape buckets that never shrink (ragen_jax.shapes); a checkpoint holds them, so a
        # resumed run picks the shapes the run it continues would have.
        self.marks = HighWater()
        self.sampler.marks = self.marks
        self.update_multiple = update_multiple(run.actor.row_pad_multiple, run.rollout.max_model_len)
        self.row_settings = RowSettings(
            mini_batch_size=run.actor.ppo_mini_batch_size, pad_multiple=self.update_multiple,
            share_prefixes=run.actor.share_prompt_forward, sample_unit=run.algorithm.sample_unit,
            micro_batches=run.actor.micro_batches,
            # Sorting rows by length inside the update would move them between devices.
            long_rows_apart=run.actor.long_rows_apart and self.mesh.size == 1)
        # GiGPO's turn table is as wide as the run's most turns: one shape for every step.
        self.max_turns = max(self.plan.rollout_for(spec).max_turn for spec in self.plan.envs)
        # The update is compiled for the most rows a step can have (every episode, or every
        # turn of episodes that play the most turns): a filter, include_zero=False or an env
        # error leaves padding rows that the update skips, never a program of its own.
        episodes = run.rollout.env_groups * run.rollout.group_size // jax.process_count()
        turns = self.max_turns if run.algorithm.sample_unit == "turn" else 1
        self.marks.fit("update/rows", most_rows(episodes * turns, self.row_settings, self.mesh))
        self._init_state()
        # RAGEN computes the collapse diagnostics in the full context window only; a windowed
        # run's first turn saw its transcript's first prompt, so its first-turn pairs are kept.
        kinds = KINDS if run.rollout.window.mode == "full" else ("first_turn_sample",)
        self.monitor = CollapseMonitor(run.diagnostics, seed=run.seed,
                                       enable_think=run.rollout.prompt.enable_think, kinds=kinds,
                                       groups=run.rollout.env_groups,
                                       max_input_len=run.rollout.max_model_len,
                                       max_answer_len=run.rollout.response_length)
        self.monitor.marks = self.marks
        self.streaks = Streaks()
        self.warm_start = WarmStart(run, self.plan.rollout, self.slots, self.tokenizer,
                                    self.held_out, phase=self._phase, log=self.log,
                                    is_main=self.is_main)
        self.warmstart_loaded_from: Path | None = None  # the cache folder, when it was read
        self.step = 0
        self._compiled: set[str] = set()  # phases that ran once in this process
        self.compiled_steps: list[int] = []  # steps after the first that compiled anything
        self.logger: MetricsLogger | None = None
        self._stop_signal: int | None = None
        self._stepping = False  # in the step loop: a signal finishes the step and saves

    # -- one training step ---------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """Rollout, filter, build the update's rows, update; returns the step's metrics."""
        timings: dict[str, float] = {}
        groups = self.run.rollout.env_groups
        with _timed(timings, "gen"):  # every env's groups, one batch (rollout.mix)
            batch = collect_train(self.slots, self.sampler, self.plan.rollout, self.step,
                                  self._key(0, self.step), share=dist.share)
        metrics = tag_metrics(batch.metrics, self.rollouts, "train/")
        diagnose = self.monitor.due(self.step)
        if diagnose:
            with _timed(timings, "diagnostics"):
                metrics |= self.monitor.measure(batch, self.policy, self.step)
        # Every step's anchor statistics (whatever the estimator; GiGPO trains on them):
        # groups never span processes, so each process's turns are its groups' whole.
        turns = turn_table(batch.episodes, batch.group_ids, self.max_turns,
                           self.run.algorithm.gigpo_similarity)
        metrics |= anchored_turns(turns, batch.group_ids, ~batch.env_failed)
        metrics = dist.mean_metrics(metrics, summed=ROLLOUT_COUNTS)
        metrics |= self._distinct_levels(batch, "train/")
        entropies = None
        if self.run.filter.metric in ENTROPY_METRICS:  # one forward pass of the policy
            with _timed(timings, "filter_entropy"):
                entropies = trajectory_entropies(
                    self.policy, batch.input_ids, batch.attention_mask, batch.position_ids,
                    batch.loss_mask, self.plan.rollout.sampling.temperature,
                    self.run.actor.ppo_mini_batch_size // self.run.actor.micro_batches)
        every = gather_episodes(batch, groups, entropies)  # every process's groups
        # The padding of the whole batch (every process's rows) at the update's width: what
        # mixing envs of different lengths costs.
        metrics["rollout/pad_fraction"] = padding_fraction(every.lengths, self.update_multiple)
        keep, weights, filter_metrics = filter_groups(
            every.scores, self.run.filter, every.sampled, every.entropies, every.valid)
        metrics |= {k: float(v) for k, v in filter_metrics.items()}
        # The filter saw the raw scores; the estimators see the normalised ones (RAGEN), the
        # inductive grouping by each row's env (its slot index).
        batch = normalize_batch(batch, every.scores, every.tag_ids, every.here,
                                *self.plan.reward_norm, valid=every.valid)
        analyse = diagnose and self.run.diagnostics.gradient_analysis
        buckets, bucket_std = np.zeros(groups, np.int32), None
        if analyse:
            buckets, bucket_std = gradient_analysis.reward_std_buckets(
                every.scores, self.run.diagnostics.gradient_buckets)
        rows = build_step_batch(
            batch, keep, weights, self.row_settings, group_buckets=buckets, mesh=self.mesh,
            rng=np.random.default_rng([self.run.seed, self.step, jax.process_index()]),
            valid=every.valid, marks=self.marks,
            turns=turns if self.run.algorithm.adv_estimator in NEEDS_TURNS else None)
        if rows is None:
            return metrics | {"train/update_skipped_empty": 1.0} | timings

        with _timed(timings, "update"):
            self.state, device_metrics = self.update(
                self.state, rows, train_actor=self.step >= self.run.critic.warmup,
                analyse_gradients=analyse)
            fetched = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        if fetched.get("actor/update_skipped", 0.0) > 0:
            self.log(f"step {self.step + 1}: non-finite loss or gradient, update skipped")
        metrics |= gradient_analysis.report(fetched, bucket_std) if analyse else {}
        metrics |= {k: v for k, v in fetched.items() if not k.startswith("grad_analysis/")}
        self._refresh_policy()
        live = int(rows.live_mini_batches.addressable_data(0)) * self.run.actor.ppo_mini_batch_size
        return metrics | {"train/batch_size": float(live)} | timings

    def _refresh_policy(self) -> None:
        """The sampler's copy of the actor follows the trained variables."""
        nnx.update(self.actor, self.state.actor)
        self.policy = dist.local_replica(compute_copy(self.actor), self.mesh, self.local_mesh)
        self.sampler.update(self.policy)

    def _key(self, *path: int) -> jax.Array:
        key = jax.random.key(self.run.seed)
        for p in path:
            key = jax.random.fold_in(key, p)
        return key

    # -- validation, warm start, checkpoints ---------------------------------------------------

    def validate(self) -> tuple[dict[str, float], RolloutBatch]:
        """Validation on the fixed seeds, every env's ``val_groups`` (``val-env/<tag>/...``);
        returns the batch of all of them too (this process's episodes)."""
        batch = collect_val(self.slots, self.sampler, self.plan.rollout,
                            lambda i: self._key(1, self.step, i), share=dist.share)
        metrics = {f"val-env/{k}": v for k, v in batch.metrics.items()
                   if k.split("/", 1)[0] in self.rollouts}
        return dist.mean_metrics(metrics) | self._distinct_levels(batch, "val-env/"), batch

    def _distinct_levels(self, batch: RolloutBatch, prefix: str) -> dict[str, float]:
        """``{prefix}{tag}/distinct_levels`` over every process's episodes (a process plays a
        share of the groups: a mean of the processes' counts would not be the count)."""
        mine: dict[str, set[int]] = {}
        for ep, slot in zip(batch.episodes, batch.tag_ids, strict=True):
            if ep.level:
                mine.setdefault(self.slots[int(slot)].tag, set()).add(int(ep.level))
        seen: dict[str, set[int]] = {}
        for part in dist.allgather_json({tag: sorted(ids) for tag, ids in mine.items()}):
            for tag, ids in part.items():
                seen.setdefault(tag, set()).update(ids)
        return {f"{prefix}{tag}/distinct_levels": float(len(ids)) for tag, ids in seen.items()}

    def warmstart(self) -> dict[str, float]:
        """The supervised stages before RL (``warmstart.WarmStart``), in place on the actor;
        the step-0 state (optimizers, critic, reference) is rebuilt from the result."""
        self.actor, metrics, self.warmstart_loaded_from = self.warm_start(self.actor, self.mesh)
        self.restart_from_actor()
        return metrics

    def restart_from_actor(self) -> None:
        """Rebuilds the step-0 state (optimizers, critic, reference) from the actor as it is
        now, after training it outside the RL loop, and points the sampler at it."""
        self._init_state()
        self._refresh_policy()

    def _phase(self, what: str, total: int | None, start_note: str = "", *,
               lines: bool = True) -> Phase:
        """A long phase's progress on the run's display (silent before ``train`` made it);
        ``lines=False``: a bar on a terminal only, no plain lines."""
        if self.logger is None:
            return Phase(what, total, print_fn=lambda _text: None, start_note=start_note)
        return self.logger.phase(what, total, start_note, lines=lines)

    def _init_state(self) -> None:
        """The step-0 ``TrainState`` of the actor as it is now, and the update for it."""
        self.networks, self.state = build_state(self.plan.step, self.actor, self.run.model,
                                                self.run.seed)
        self.update = make_update(self.plan.step, self.networks, self.mesh)

    def save(self) -> None:
        """Checkpoints the current step (once: a step already saved is left as it is)."""
        if self.store.latest_step() == self.step:
            return
        meta = {"step": self.step, "streaks": dataclasses.asdict(self.streaks),
                "collapse_ema": self.monitor.ema, "shape_marks": self.marks.marks}
        self.store.save(self.step, self._checkpoint_items(), meta)

    def _checkpoint_items(self) -> dict[str, Any]:
        return {"actor": self.state.actor, "state": self.state.replace(actor=None)}

    def maybe_resume(self) -> bool:
        """Restores the newest checkpoint that reads; True if one did. A step that does not
        read (``CheckpointRestoreError``: a file cut short, missing metadata) is named in one
        line and moved aside (``CheckpointStore.set_aside``, never deleted), and the step
        before it is tried; with none left the run starts fresh, and says so."""
        steps = sorted(self.store.all_steps(), reverse=True)
        if not steps:
            return False
        like = abstract(self._checkpoint_items())
        # The step-0 state is freed before the checkpoint's arrays arrive: holding both, then
        # freeing one, left a 1.5B run's GPU memory too fragmented for its update's buffer.
        self.state = None
        for i, step in enumerate(steps):
            items, error = None, None
            try:
                items, meta = self.store.restore(step, like)
                host = _host_state(step, meta)
            except CheckpointRestoreError as e:
                error = e
            # Every process takes the same step: one that failed on any is set aside.
            if not dist.any_process(error is not None):
                self.state = items["state"].replace(actor=items["actor"])
                self.step, self.streaks, self.monitor.ema, marks = host
                self.marks.marks.update(marks)
                self._refresh_policy()
                return True
            items = None
            moved = self.store.set_aside(step) if self.is_main else None
            dist.any_process(False)  # the rename is done before the others reread the folder
            self.store.reload()
            then = (f"resuming from step {steps[i + 1]}" if i + 1 < len(steps) else
                    "no complete checkpoint is left: starting fresh from step 0")
            reason = error.reason if error is not None else "it failed on another process"
            self.log(f"checkpoint step {step} could not be restored ({reason}); moved aside to "
                     f"{moved}; {then}")
        # Every step was damaged. The actor was built without its pretrained weights (a
        # checkpoint was to replace them), so it is built again, from the model folder.
        self.actor = build_actor(self.run.model, self.run.seed, self.mesh)
        self._init_state()
        self._refresh_policy()
        return False

    # -- the loop ------------------------------------------------------------------------------

    def log(self, text: str) -> None:
        if self.logger is not None:
            self.logger.print(text)

    def _validate_and_record(self, metrics: dict[str, float]) -> None:
        episodes = sum(s.val_groups for s in self.slots) * self.run.rollout.val.group_size
        first = "val" not in self._compiled  # its sampler shapes compile: say so in a log too
        self._compiled.add("val")
        with _timed(metrics, "val"), self._phase(
                f"validation at step {self.step}", None,
                f"{episodes} episodes" + (" (compiling the sampler first)" if first else ""),
                lines=first):
            val_metrics, batch = self.validate()
        if self.run.algorithm.sample_unit == "trajectory":  # (turn rows have widths of their own)
            trained = [i for i, slot in enumerate(self.slots) if slot.groups]
            calibrate_widths(self.marks, batch, np.isin(batch.tag_ids, trained), self.row_settings)
        metrics |= val_metrics
        self.log(_val_line(self.step, val_metrics))
        if self.is_main and self.run.trainer.save_trajectories:
            folder, name = self.out / "trajectories", f"val_step{self.step:05d}"
            write_trajectories(folder / f"{name}.jsonl", folder / f"{name}.html", batch,
                               {"model": f"step {self.step}", "env": ", ".join(self.rollouts),
                                "metrics": val_metrics})

    def _handle_signal(self, signum, _frame):
        if not self._stepping:
            # The warm start, a resume and step 0's validation hold nothing a rerun would not
            # rebuild (a warm-started step 0 is saved before the loop): stop now, not after a
            # prior build that may take many minutes. (A multi-host job's scheduler signals every
            # process; one stopped here alone leaves the others to fail at their next collective,
            # which ``run`` reports as such.)
            _say(f"\nstopped by signal {signum} before the first training step; nothing to save: "
                 f"rerun the same command to start (or resume) again\n")
            raise SystemExit(128 + signum)
        if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once (no save)
        if self._stop_signal is None:
            _say(f"\nsignal {signum}: finishing step {self.step + 1}, then saving a checkpoint "
                 f"(Ctrl-C again stops at once, unsaved)\n")
        self._stop_signal = signum

    def _start(self) -> dict[str, Any]:
        """Checks the checkpoints' disk, then resumes from the last checkpoint, or warm-starts,
        validates and (after a warm-start) saves step 0."""
        note = self.store.space_note(nbytes(self._checkpoint_items()))
        if note:
            self.log(note)
        resumed = self.maybe_resume()
        # A resumed run plays every step after its checkpoint again (an earlier process may
        # have logged some of them before it stopped), and a fresh start every step: their old
        # rows go, so metrics.jsonl holds each step once, as this run computes it.
        self.logger.rewind(self.step if resumed else -1)
        if resumed:
            self.log(f"resumed from {self.store.path}/{self.step}")
            return {"resumed_from": self.step}
        w = self.run.warmstart
        warmed = bool(w.steps or w.turns.steps or self.run.sft.steps)
        metrics = self.warmstart() if warmed else {}
        if self.run.trainer.val_before_train:
            self._validate_and_record(metrics)
        metrics["timing_s/elapsed"] = time.perf_counter() - self.created
        metrics |= self.compiles.take()
        self.logger.log(0, metrics)
        if warmed:  # an untrained start is rebuilt from the config: its checkpoint only fills the disk
            self.save()
        return {"resumed_from": None}

    def _after_step(self, metrics: dict[str, float], started: float) -> str | None:
        """Validation, early stopping, logging and checkpointing after a step; returns the
        early-stopping reason, if any."""
        tr = self.run.trainer
        if self.step % tr.test_freq == 0 or self.step == tr.total_steps:
            self._validate_and_record(metrics)
        trained_tags = [s.tag for s in self.slots if s.groups]
        stop = early_stop_reason(tr, self.streaks, metrics, trained_tags)
        if stop:
            metrics[f"early_stopped/{stop}"] = 1.0
            self.log(f"early stop at step {self.step}: {stop}")
        metrics |= device_memory()
        metrics |= self.compiles.take()
        if metrics["compile/count"] and self.step > 1:
            self.compiled_steps.append(self.step)
        metrics["timing_s/step"] = time.perf_counter() - started
        metrics["timing_s/elapsed"] = time.perf_counter() - self.created
        self.logger.log(self.step, metrics)
        self.logger.advance(self.step, _progress_info(metrics, trained_tags))
        if self.step % tr.save_freq == 0 or self.step == tr.total_steps or stop:
            self.save()
        return stop

    def train(self) -> dict[str, Any]:
        """Runs (or resumes) to ``total_steps``; returns a summary."""
        tr = self.run.trainer
        sinks = make_sinks(tr.logger, self.out, project=tr.project_name,
                           name=tr.experiment_name or self.out.name,
                           config=to_config_dict(self.run).to_dict()) if self.is_main else []
        self.logger = MetricsLogger(self.out, sinks=sinks, total_steps=tr.total_steps,
                                    enabled=self.is_main, progress=tr.progress)
        old = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        summary: dict[str, Any] = {"output_dir": str(self.out)}
        try:
            summary |= self._start()
            self.logger.advance(self.step, "rollout, update (the first step compiles)")
            stop = None
            self._stepping = True
            while self.step < tr.total_steps and self._stop_signal is None and stop is None:
                started = time.perf_counter()
                metrics = self.train_step()
                self.step += 1
                stop = self._after_step(metrics, started)
                if self.on_step is not None:
                    self.on_step(self.step, metrics)
                if dist.any_process(self._stop_signal is not None):  # one stops, all stop
                    self._stop_signal = self._stop_signal or signal.SIGTERM
            if self._stop_signal is not None:
                self.save()
                self.log(f"stopped by signal {self._stop_signal} after step {self.step}; "
                         f"checkpoint saved, rerun the same command to resume")
                summary["interrupted"] = True
        finally:
            self._stepping = False
            for s, h in old.items():
                signal.signal(s, h)
            self.logger.close()
            self.store.close()
            release_run_folder(self.out, jax.process_index())
        totals = self.compiles.totals()
        return summary | {"step": self.step, "compile_count": totals["compile/count"],
                          "compile_seconds": totals["compile/seconds"],
                          "compiled_after_step_1": self.compiled_steps}


def _host_state(step: int, meta: dict[str, Any]
                ) -> tuple[int, Streaks, dict[str, Any], dict[str, Any]]:
    """``(step, streaks, collapse EMA, shape marks)`` of a checkpoint's meta JSON (no marks
    in older checkpoints); a JSON that lacks or garbles the others is a damaged step
    (``CheckpointRestoreError``), as an unreadable one is."""
    try:
        return (int(meta["step"]), Streaks(**meta["streaks"]), dict(meta["collapse_ema"]),
                dict(meta.get("shape_marks", {})))
    except (KeyError, TypeError, ValueError) as e:
        reason = f"meta: {type(e).__name__}: {e}"
        raise CheckpointRestoreError(f"checkpoint step {step}: {reason}", step, reason) from None


def build_envs(run: RunConfig) -> dict[str, tuple[Any, Any]]:
    """``{tag: (env, env_params)}`` of every env of the run in order (``schema.env_specs``:
    the training env first, then ``env.val_extra``'s; or the ``env.mix`` entries)."""
    envs: dict[str, tuple[Any, Any]] = {}
    for i, spec in enumerate(resolve(run).envs):
        where = f"env.mix[{i}]" if run.env.mix else "env"
        try:
            env, params = make(spec.name, **spec.params)
        except (ValueError, TypeError, ImportError) as e:  # e.g. a data file, its reader missing
            raise ConfigError(f"{where}: {e}") from None
        tag = spec.tag or env.name
        if tag in envs:
            raise ConfigError(f"{where}.tag: {tag!r} names two envs of the run (give each its "
                              f"own tag)")
        envs[tag] = (env, params)
    return envs


def write_trajectories(jsonl: Path, viewer: Path, batch: RolloutBatch, summary: dict[str, Any],
                       limit: int | None = 64) -> None:
    """The episodes as JSONL (one per line) and the HTML viewer of the first ``limit``."""
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with open(jsonl, "w", encoding="utf-8") as f:
        for traj in batch.trajectories:
            f.write(json.dumps(traj, ensure_ascii=False) + "\n")
    viewer.write_text(render_html(batch.trajectories[:limit], summary), encoding="utf-8")


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = time.perf_counter() - t0


def _val_line(step: int, vm: dict[str, float]) -> str:
    parts = []
    for k, v in vm.items():
        if k.endswith("/success"):
            errors = vm.get(k.replace("/success", "/env_error_rate"), 0.0)
            played = vm.get(k.replace("/success", "/success_of_played"), v)
            parts.append(f"{k.split('/')[1]} success {v:.3f}" + (
                f" ({errors:.1%} env errors; {played:.3f} of the rest)" if errors else ""))
    return f"validation at step {step}: " + ", ".join(parts)


def _progress_info(m: dict[str, float], tags: list[str]) -> str:
    compiled = progress_note(m)
    compiled = f"  {compiled}" if compiled else ""
    if len(tags) > 1:  # several envs: each one's success
        return ("success " + " ".join(f"{t} {m.get(f'train/{t}/success', float('nan')):.3f}"
                                      for t in tags) + f"  {m.get('timing_s/step', 0):.1f} s/step"
                + compiled)
    tag = tags[0]
    return (f"score {m.get(f'train/{tag}/score', float('nan')):+.3f}  "
            f"success {m.get(f'train/{tag}/success', float('nan')):.3f}  "
            f"{m.get('timing_s/step', 0):.1f} s/step" + compiled)


def run(config: ConfigDict | RunConfig, **kw: Any) -> dict[str, Any]:
    """Builds the run from ``config`` and trains it (what ``launch.py`` calls)."""
    if not isinstance(config, RunConfig):
        config = from_config_dict(use_run_snapshot(config))  # the model folder may have moved
    run_config = config
    enable_persistent_cache()  # a repeated run's compiles are file reads
    return_large_frees_to_os()  # before the weights arrive: see host_memory.py
    dist.initialize(run_config.distributed)  # a no-op if launch.py already did it
    # Before the model is built: a batch that cannot fit is refused, one that may not is said.
    memory = check_run(resolve(run_config))
    if jax.process_index() == 0:  # before the model is built: what runs, where it goes
        print(start_summary(resolve(run_config), jax.devices(), jax.process_count(),
                            memory=memory), flush=True)
    trainer = Trainer(run_config, **kw)
    if trainer.is_main:
        trainer.out.mkdir(parents=True, exist_ok=True)
        if run_config.model.path and not hf_folder.is_snapshot(run_config.model.path):
            hf_folder.snapshot(run_config.model.path, trainer.out / "model")
        (trainer.out / "config.json").write_text(
            to_config_dict(run_config).to_json_best_effort(indent=2) + "\n")
        (trainer.out / SETTINGS_FILE).write_text(full_settings(trainer.plan, jax.default_backend()))
    try:
        return trainer.train()
    except jax.errors.JaxRuntimeError as e:
        if not dist.multiprocess():
            raise
        first = str(e).strip().splitlines()[0][:300]
        dist.abort(f"a collective failed, most likely another process of the job died (see its "
                   f"log): {first}. Rerun every process to resume from the last complete "
                   f"checkpoint")
        raise


def _say(text: str) -> None:
    """Writes ``text`` to stderr from a signal handler: ``os.write`` takes no lock that the
    interrupted code (a print, the progress bar) may hold."""
    os.write(2, text.encode())
