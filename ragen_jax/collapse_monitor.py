"""RAGEN V2's reasoning-collapse diagnostics during training (``collapse*/`` metrics).

``CollapseMonitor.measure(batch, policy, step)`` scores the step's rollout batch (before
filtering) with the policy that sampled it: first-turn pairs (``collapse_first_turn_sample/*``),
trajectory-uniform pairs (``collapse_trajectory_sample/*``), the first turns' format validity
(``collapse/first_turn_{num_total,num_valid,valid_rate}``) and, with ``enable_think``, the
share of turns with a non-blank reasoning (``collapse/valid_thinking_rate``). Every process
scores every process's pairs. The EMAs of the marginal's std (RAGEN's ``mi_zscore_ema``
divides by them) are the monitor's state (``ema``), kept in checkpoints by the trainer. ``kinds`` picks the pair kinds: a run whose turns see a window of
the episode scores only first-turn pairs (its first prompt is the transcript's; a later turn
saw less than the transcript holds, so trajectory pairs would score text the policy did not
read).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ragen_jax import distributed as dist
from ragen_jax.config.schema import DiagnosticsConfig
from ragen_jax.rollout.batch import RolloutBatch
from ragen_jax.shapes import HighWater, round_up
from ragen_jax.starpo.diagnostics import (
    collapse_metrics,
    cross_scores,
    first_turn_pairs,
    first_turn_validity,
    prompt_labels,
    trajectory_uniform_pairs,
    valid_thinking_counts,
)

KINDS = ("first_turn_sample", "trajectory_sample")


class CollapseMonitor:
    """See the module docstring."""

    def __init__(self, config: DiagnosticsConfig, *, seed: int, enable_think: bool,
                 kinds: tuple[str, ...] = KINDS, groups: int | None = None,
                 max_input_len: int | None = None, max_answer_len: int | None = None):
        self.config = config
        self.kinds = kinds  # the pair kinds scored (a subset of KINDS)
        # Each kind's program shapes, fixed from the run's config: as many inputs and answers
        # as a measurement can draw (``counts``), answers as long as a turn's, inputs in
        # quarters of the context window (``quarter``) and never narrower than before
        # (``marks``, the run's ``ragen_jax.shapes.HighWater``, set by the trainer). Empty
        # without the config (tests): each measurement's own shapes.
        self.counts: dict[str, tuple[int, int]] = {}
        self.marks: HighWater | None = None
        if max_input_len and max_answer_len:
            self.quarter = round_up(-(-max_input_len // 4), 64)
            self.answer = round_up(max_answer_len, 16)
            first = config.num_samples if groups is None else min(config.num_samples, groups)
            self.counts = {"first_turn_sample": (first, config.num_samples),
                           "trajectory_sample": (config.trajectory_samples,
                                                 config.trajectory_samples)}
        self.seed = seed
        self.enable_think = enable_think
        self.ema: dict[str, float] = {}  # the marginal std's EMAs per pair kind (token, sequence)

    def due(self, step: int) -> bool:
        return bool(self.config.compute_freq) and step % self.config.compute_freq == 0

    def measure(self, batch: RolloutBatch, policy: Any, step: int) -> dict[str, float]:
        d, procs = self.config, jax.process_count()
        pairs = {  # only the kinds scored are drawn and gathered
            "first_turn_sample": lambda: first_turn_pairs(
                batch.input_ids, batch.loss_mask, batch.turn_ids, batch.group_ids,
                d.num_samples // procs, np.random.default_rng([self.seed, step, 1])),
            "trajectory_sample": lambda: trajectory_uniform_pairs(
                batch.input_ids, batch.loss_mask, batch.turn_ids, d.trajectory_samples // procs,
                np.random.default_rng([self.seed, step, 2, jax.process_index()])),
        }
        local = [pairs[kind]()[:3] for kind in self.kinds]
        counts = [*first_turn_validity(batch.trajectories),
                  *valid_thinking_counts(batch.trajectories)]
        parts = dist.allgather_json([[x[0], x[1], x[2].tolist()] for x in local] + [counts])
        out: dict[str, float] = {}
        for i, kind in enumerate(self.kinds):
            inputs, reasonings, cols = [], [], []
            for part in parts:
                xs, zs, cs = part[i]
                cols += [col + len(inputs) for col in cs]
                inputs, reasonings = inputs + xs, reasonings + zs
            out |= self._pairs(kind, policy, inputs, reasonings, np.asarray(cols, np.int32))
        n = len(self.kinds)
        total, valid, turns, thinking = (sum(p[n][k] for p in parts) for k in range(4))
        out |= {"collapse/first_turn_num_total": float(total),
                "collapse/first_turn_num_valid": float(valid),
                "collapse/first_turn_valid_rate": valid / total if total else 0.0}
        if self.enable_think:
            out["collapse/valid_thinking_rate"] = thinking / turns if turns else 0.0
        return out

    def _shape(self, kind: str, inputs: list[list[int]]) -> tuple[int, int, int, int] | None:
        """``cross_scores``' shape for ``kind``'s measurement of ``inputs`` (None without the
        run's config): the input width in quarters of the context window, at least the
        widest used before, and for first-turn inputs (the sampler's first prompts) at least
        the sampler's first-prompt bucket, which the first validation set."""
        if kind not in self.counts:
            return None
        width = max(max(len(x) for x in inputs), 1)
        if self.marks is not None:
            if kind == "first_turn_sample":
                width = max(width, self.marks.marks.get("prompt/first", 0))
            width = self.marks.fit(f"diagnostics/{kind}/inputs", round_up(width, self.quarter))
        return (*self.counts[kind], round_up(width, self.quarter), self.answer)

    def _pairs(self, kind: str, policy: Any, inputs: list[list[int]],
               reasonings: list[list[int]], column: np.ndarray) -> dict[str, float]:
        """``collapse_<kind>/*``: the MI metrics of one set of pairs under RAGEN's names
        (per-token means, and the sequence sums' ``_seq`` variants), the marginal std's EMAs
        updated. Identical prompts share a label. Empty under 2 inputs."""
        if len(inputs) < 2:
            return {}
        prefix = f"collapse_{kind}/"
        labels = prompt_labels(inputs)
        per_token, per_seq = cross_scores(policy, inputs, reasonings, self.config.micro_batch_size,
                                         self.config.micro_batch_tokens, self._shape(kind, inputs))
        keys = (f"{kind}/marginal_std", f"{kind}/marginal_std_seq")
        out = collapse_metrics(per_token, column, labels, seq_scores=per_seq,
                               std_ema=(self.ema.get(keys[0]), self.ema.get(keys[1])),
                               ema_decay=self.config.ema)
        self.ema[keys[0]], self.ema[keys[1]] = out["marginal_std_ema"], out["marginal_std_ema_seq"]
        return {prefix + k: v for k, v in out.items()}
