"""Does a turn's cost follow what the cache holds, or its capacity? ``python -m experiments.benchmarks.bench_context_cost``.

The same tiny FrozenLake run (4 groups x 4 episodes, a format-only warm start, answers stopped
at ``</answer>``), once per KV cache (dense, ``rollout.sampler.paged``) and context window
(``rollout.max_model_len`` 1024 and 8192, all else equal: a larger window only makes the
cache's capacity larger, the episodes are the same). Prints each run's median sampling time
(``timing_s/gen``) and whole step (``timing_s/step``) over steps 2 to ``--steps``, and per
cache the 8192 run's median sampling time over the 1024 run's: the cost of capacity. Each run
is a fresh process (``python -m ragen_jax.train``-equivalent ``train.run``), one after another.

    python -m experiments.benchmarks.bench_context_cost [--steps 5] [--lens 1024,8192]
        [--caches dense,paged] [--out experiments/results/bench_context_cost.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from experiments.common import ROOT
from ragen_jax.metrics import read_jsonl

RUN = """
import json, sys
from ragen_jax.config.loading import load_config
from ragen_jax.train import run
run(load_config(json.loads(sys.argv[1])))
"""


def overrides(out: Path, max_len: int, paged: bool, steps: int) -> list[str]:
    return ["--config", str(ROOT / "configs/frozenlake.py"),
            f"--config.trainer.output_dir={out}", f"--config.trainer.total_steps={steps}",
            "--config.trainer.progress=False", "--config.trainer.test_freq=0",
            "--config.trainer.val_before_train=False", "--config.trainer.save_freq=100",
            "--config.diagnostics.compute_freq=0",
            "--config.warmstart.steps=2", "--config.warmstart.turns.steps=0",
            "--config.warmstart.episodes=16", "--config.warmstart.batch_size=8",
            "--config.warmstart.cache=False", "--config.warmstart.solver_share=0",
            "--config.rollout.sampling.stop_strings=('</answer>',)",
            "--config.rollout.env_groups=4", "--config.rollout.group_size=4",
            f"--config.rollout.max_model_len={max_len}",
            f"--config.rollout.sampler.paged={paged}"]


def measure(max_len: int, paged: bool, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        subprocess.run([sys.executable, "-c", RUN, json.dumps(overrides(out, max_len, paged, steps))],
                       cwd=ROOT, check=True)
        rows = read_jsonl(out / "metrics.jsonl")
    later = [m for s, m in rows.items() if s >= 2 and "timing_s/gen" in m]
    return {"gen": float(np.median([r["timing_s/gen"] for r in later])),
            "step": float(np.median([r["timing_s/step"] for r in later]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lens", default="1024,8192")
    ap.add_argument("--caches", default="dense,paged")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    lines = ["| cache | max_model_len | sampling s (median) | step s (median) |", "|---|---|---|---|"]
    ratios = []
    for cache in args.caches.split(","):
        got = {n: measure(n, cache == "paged", args.steps) for n in lens}
        for n in lens:
            lines.append(f"| {cache} | {n} | {got[n]['gen']:.2f} | {got[n]['step']:.2f} |")
        ratios.append(f"{cache}: sampling at {lens[-1]} / at {lens[0]} = "
                      f"{got[lens[-1]]['gen'] / got[lens[0]]['gen']:.2f}x")
    text = "\n".join(lines + [""] + ratios) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
