"""How much a run compiles, and how much a second run of it does: ``python -m experiments.benchmarks.bench_compiles``.

Runs one config twice in fresh processes that share one empty persistent compilation cache
(``$RAGEN_JAX_CACHE/xla`` under a temporary folder) and prints, per run, every step's
``compile/count`` and ``compile/seconds`` (step 0: the warm-start and the first validation),
the steps after the first that compiled, the total compile time and the first step's wall
time; then the second run's totals as a fraction of the first's. The default config is the
issue's CPU check: tiny FrozenLake, 12 multi-turn steps with a real-model preset's stop
strings, validation and diagnostics every 5 steps, a short format-only warm start.

    python -m experiments.benchmarks.bench_compiles [--steps 12] [--override --config.x=y ...]

On a GPU, the real-model check (a SmolLM2 GGUF file on FrozenLake, RAGEN's 8 x 16 batch):

    python -m experiments.benchmarks.bench_compiles --steps 60 --base "--config
        configs/frozenlake.py:smollm2-135m --config.model.path=SmolLM2-135M-Instruct.Q4_1.gguf
        --config.rollout.env_groups=8 --config.rollout.group_size=16
        --config.rollout.val.env_groups=64 --config.rollout.response_length=64
        --config.trainer.test_freq=5 --config.diagnostics.compute_freq=5
        --config.warmstart.steps=12 --config.trainer.progress=False"

Besides the compiles it prints each run's mean step over steps 4 to the end against its
median step that compiled nothing (the issue's "at most 1.5x").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.common import ROOT

CONFIG = ["--config", "configs/frozenlake.py", "--config.trainer.progress=False",
          "--config.trainer.test_freq=5", "--config.diagnostics.compute_freq=5",
          "--config.trainer.save_freq=100",
          "--config.warmstart.steps=2", "--config.warmstart.turns.steps=0",
          "--config.warmstart.episodes=16", "--config.warmstart.batch_size=8",
          "--config.warmstart.cache=False", "--config.warmstart.solver_share=0",
          "--config.rollout.sampling.stop_strings=('</answer>',)", "--config.rollout.env_groups=4",
          "--config.rollout.group_size=4", "--config.rollout.val.env_groups=8",
          "--config.actor.ppo_mini_batch_size=16"]


def one_run(out: Path, cache: Path, steps: int, base: list[str], extra: list[str]) -> dict:
    """One training run in its own process; its metrics and summary."""
    code = ("import json, sys\nfrom ragen_jax.config.loading import load_config\nfrom ragen_jax.train import run\n"
            "s = run(load_config(sys.argv[1:]))\nprint('SUMMARY', json.dumps(s))")
    args = [*base, f"--config.trainer.output_dir={out}", f"--config.trainer.total_steps={steps}",
            *extra]
    # The persistent cache on even where the caller's environment turns it off: run 2 reads it.
    env = dict(os.environ, RAGEN_JAX_CACHE=str(cache), RAGEN_JAX_XLA_CACHE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    summary = json.loads(done.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "metrics": metrics}


def report(name: str, result: dict) -> str:
    m, s = result["metrics"], result["summary"]
    per_step = ", ".join(f"{x['step']}: {x.get('compile/count', 0):.0f} / {x.get('compile/seconds', 0):.1f}s"
                         for x in m)
    first = next(x for x in m if x["step"] == 1)
    steps = [x for x in m if x["step"] >= 1]
    warm = [x["timing_s/step"] for x in steps if not x.get("compile/count")]
    later = [x["timing_s/step"] for x in steps if x["step"] >= 4]
    ratio = ""
    if warm and later:
        ratio = (f"; mean step over steps 4-{steps[-1]['step']} {statistics.mean(later):.2f} s, "
                 f"median warm step {statistics.median(warm):.2f} s "
                 f"({statistics.mean(later) / statistics.median(warm):.2f}x)")
    return (f"{name}: {s['compile_count']:.0f} programs, {s['compile_seconds']:.1f} s compiling; "
            f"steps after the first that compiled: {s['compiled_after_step_1'] or 'none'}; "
            f"first step {first['timing_s/step']:.1f} s, run {m[-1]['timing_s/elapsed']:.1f} s"
            f"{ratio}\n  per step (count / seconds): {per_step}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--override", action="append", default=[], help="extra --config.x=y")
    ap.add_argument("--base", default=None, help="the config's arguments, replacing the default "
                                                 "FrozenLake check (one string)")
    args = ap.parse_args()
    base = shlex.split(args.base) if args.base else CONFIG
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = [one_run(tmp / f"run{i}", tmp / "cache", args.steps, base, args.override)
                for i in (1, 2)]
    for i, r in enumerate(runs, 1):
        print(report(f"run {i}", r))
    a, b = (r["summary"]["compile_seconds"] for r in runs)
    fa, fb = (next(x for x in r["metrics"] if x["step"] == 1)["timing_s/step"] for r in runs)
    print(f"second run / first: compile time {b / a:.2f}, first step {fb / fa:.2f}")


if __name__ == "__main__":
    main()
