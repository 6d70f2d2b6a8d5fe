"""Evaluate a policy on the fixed validation seeds: ``python -m ragen_jax.eval``.

    python -m ragen_jax.eval --config configs/sokoban.py[:preset] [--config.<field>=value ...]
    python -m ragen_jax.eval --checkpoint RUN_DIR [--step N] [--config.<field>=value ...]

The run config is the one training uses (same file, presets and ``--config.*`` overrides;
with ``--checkpoint`` the run's saved ``config.json``): the policy is ``model`` (a Hugging
Face folder, or the tiny random model, whose answers are noise) or the checkpoint's actor,
the envs are the run's, and the episodes are exactly validation's (``rollout.mix.collect_val``):
per env of the run (the env, its ``env.val_extra`` envs, or each ``env.mix`` entry with its
``val_groups``), ``val_groups x rollout.val.group_size`` envs on the seeds
``rollout.val.seed + i`` (the same every run), sampled at ``rollout.val.temperature``
(RAGEN's 0.5; 0 is greedy). It writes, under ``--out``:

* ``metrics.json``: the RAGEN-named metrics per env tag (``{tag}/success``, ``pass@k``, ...),
  the config and the timings;
* ``trajectories.jsonl``: one line per episode: chat messages, per-turn state, thinking,
  actions, rewards and penalties, success;
* ``viewer.html``: a static page, per episode and turn the state grid, the thinking, the
  actions and the reward, every string HTML-escaped (``ragen_jax.viewer``);

and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from ml_collections import ConfigDict

from ragen_jax.compilation import enable_persistent_cache
from ragen_jax.config.loading import from_config_dict, load_config, load_run_config, to_config_dict
from ragen_jax.config.resolve import resolve
from ragen_jax.config.schema import compute_dtype
from ragen_jax.host_memory import return_large_frees_to_os
from ragen_jax.models import CheckpointError, compute_copy
from ragen_jax.policy import build_actor, load_policy, load_tokenizer, stop_ids
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.batch import RolloutBatch
from ragen_jax.rollout.mix import EnvSlot, collect_val
from ragen_jax.rollout.sampler import Sampler
from ragen_jax.train import build_envs, write_trajectories

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sokoban.py"


def evaluate(config: ConfigDict, out: str | Path, *, checkpoint: str | None = None,
             step: int | None = None) -> tuple[RolloutBatch, dict[str, Any]]:
    """Runs the evaluation rollout and writes the three files; returns (batch, summary).
    Prints the compute dtype it takes first (``schema.compute_dtype``: ``auto`` resolved)."""
    enable_persistent_cache()  # a repeated evaluation's compiles are file reads
    run = from_config_dict(config)
    dtype, dtype_line = compute_dtype(run.model)
    print(dtype_line, flush=True)
    if checkpoint:
        model, tok, _, step = load_policy(checkpoint, step, config)
        model_name = f"{checkpoint} (step {step})"
    else:
        model, tok = build_actor(run.model, run.seed), load_tokenizer(run.model)
        model_name = run.model.path or "tiny random model"
    plan = resolve(run)
    cfg = plan.rollout
    slots = [EnvSlot(AgentRollout(env, env_params, tok, plan.rollout_for(spec), tag=tag,
                                  eos_ids=stop_ids(run.model)),
                     spec.groups, spec.val_groups)
             for spec, (tag, (env, env_params)) in zip(plan.envs, build_envs(run).items(), strict=True)]
    sampler = Sampler.for_rollout(compute_copy(model), cfg, pad_id=tok.pad_token_id or 0)
    key = jax.random.key(run.seed)
    t0 = time.perf_counter()
    batch = collect_val(slots, sampler, cfg, lambda i: key if i == 0 else jax.random.fold_in(key, i))
    wall = time.perf_counter() - t0
    out = Path(out)
    env_name = " + ".join(s.tag for s in slots) if run.env.mix else run.env.name
    summary = {"model": model_name, "env": env_name, "episodes": len(batch.trajectories),
               "dtype": {"compute": dtype, "weights": run.model.param_dtype},
               "metrics": batch.metrics, "timing": {**batch.timing, "wall_s": wall},
               "config": to_config_dict(run).to_dict()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, default=str))
    write_trajectories(out / "trajectories.jsonl", out / "viewer.html", batch, summary, limit=None)
    return batch, summary


def format_table(summary: dict[str, Any]) -> str:
    """A short plain-text table of the main metrics."""
    m = summary["metrics"]
    keys = [k for k in m if not k.startswith("rollout/")]
    keys += ["rollout/length_truncated", "rollout/truncated"]
    width = max(len(k) for k in keys)
    lines = [f"{summary['model']} | {summary['env']} | {summary['episodes']} episodes | "
             f"{summary['timing']['wall_s']:.1f} s"]
    lines += [f"  {k:<{width}}  {m[k]:.4f}" for k in keys]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m ragen_jax.eval", description=__doc__.split("\n")[0],
                                epilog="Other arguments: --config FILE[:preset] and "
                                       "--config.<field>=value, as for launch.py.")
    p.add_argument("--checkpoint", default=None, help="training run folder (default: none)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: last)")
    p.add_argument("--out", default="results/eval", help="output folder")
    args, rest = p.parse_known_args(argv)
    return_large_frees_to_os()  # before the weights arrive: see host_memory.py
    try:
        base = load_run_config(args.checkpoint) if args.checkpoint else None
        config = load_config(rest, prog="ragen_jax.eval", default=str(DEFAULT_CONFIG), base=base)
        _, summary = evaluate(config, args.out, checkpoint=args.checkpoint, step=args.step)
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # bad folder, config or flag
        raise SystemExit(f"ragen_jax.eval: {e}") from None
    print(format_table(summary))
    print(f"wrote {Path(args.out) / 'metrics.json'}, trajectories.jsonl, viewer.html")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
