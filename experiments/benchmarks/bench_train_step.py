"""Episodes per second of a tiny preset's training steps: ``python -m experiments.benchmarks.bench_train_step``.

Builds the preset's trainer (``configs/<env>.py`` relative to the working directory, so
``experiments/benchmarks/compare_commits.py`` can run this file against an earlier commit's tree),
runs its warm-start, then ``--steps`` training steps, and prints per step the wall time,
generation and update seconds and the batch's mean tokens per episode; the summary line is
episodes per second over the steps after ``--skip`` (compiles excluded) and over all.

    python -m experiments.benchmarks.bench_train_step --env frozenlake --steps 8
    python -m experiments.benchmarks.compare_commits --before c6cad35 --out bench_train_step.md -- \\
        experiments/benchmarks/bench_train_step.py --env frozenlake --steps 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="frozenlake")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the steady rate")
    ap.add_argument("--override", action="append", default=[], help="extra --config.x=y")
    args = ap.parse_args()
    os.environ.setdefault("RAGEN_JAX_CACHE", tempfile.mkdtemp(prefix="bench_cache_"))

    from ragen_jax.config.loading import load_config
    from ragen_jax.train import Trainer

    out = tempfile.mkdtemp(prefix="bench_train_step_")
    c = load_config(["--config", f"configs/{args.env}.py", f"--config.trainer.output_dir={out}",
                     "--config.diagnostics.compute_freq=1000", *args.override])
    t = Trainer(c)
    t.warmstart()
    episodes = t.run.rollout.env_groups * t.run.rollout.group_size
    walls = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        m = t.train_step()
        t.step += 1
        walls.append(time.perf_counter() - t0)
        tag = next(k.split("/")[1] for k in m if k.startswith("train/") and k.endswith("/success"))
        print(f"step {step + 1}: {walls[-1]:.2f} s (gen {m.get('timing_s/gen', 0):.2f}, update "
              f"{m.get('timing_s/update', 0):.2f}); {m.get('rollout/tokens', 0) / episodes:.0f} tokens/"
              f"episode; success {m['train/' + tag + '/success']:.2f}", flush=True)
    steady = np.asarray(walls[args.skip:])
    print(f"{args.env}: {episodes} episodes/step; steady {episodes / steady.mean():.2f} episodes/s "
          f"({steady.mean():.2f} s/step over steps {args.skip + 1}-{args.steps}); all steps "
          f"{episodes * len(walls) / sum(walls):.2f} episodes/s")


if __name__ == "__main__":
    main()
