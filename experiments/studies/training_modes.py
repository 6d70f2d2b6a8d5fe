"""RAGEN V2's training modes on the tiny presets: ``python -m experiments.studies.training_modes``.

Runs (or, with ``--summarize-only``, reads) two 20-step tiny runs and reports their curves:

* ``limited``: FrozenLake with ``rollout.window.mode=limited``, ``window_turns=1`` and
  ``algorithm.sample_unit=turn`` (each prompt: the system message and the current turn; one
  training row per turn);
* ``mixed``: ``configs/mixed.py`` (SimpleSokoban + FrozenLake in one batch, per-tag metrics
  and validation).

These show that the modes run end to end with finite losses and per-tag metrics; 20 steps on
two CPU cores are not a learning result (no threshold is claimed). Writes
``experiments/results/training_modes.md`` and ``training_modes.png``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common import RESULTS, ROOT
from ragen_jax.metrics import read_jsonl
from ragen_jax.plots import series

RUNS = {
    "limited": ["--config", "configs/frozenlake.py", "--config.rollout.window.mode=limited",
                "--config.rollout.window.turns=1", "--config.algorithm.sample_unit=turn"],
    "mixed": ["--config", "configs/mixed.py"],
}
COMMON = ["--config.trainer.total_steps=20", "--config.trainer.test_freq=5",
          "--config.trainer.progress=False"]


def run(name: str, out: Path) -> float:
    cmd = [sys.executable, str(ROOT / "launch.py"), *RUNS[name], *COMMON,
           f"--config.trainer.output_dir={out}"]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as f:
        subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def tags(metrics: dict[int, dict[str, float]]) -> list[str]:
    found = {k.split("/")[1] for m in metrics.values() for k in m
             if k.startswith("val-env/") and k.endswith("/success")}
    return sorted(found)


def summarize(name: str, folder: Path) -> list[str]:
    metrics = read_jsonl(folder / "metrics.jsonl")
    lines = []
    for tag in tags(metrics):
        steps, val = series(metrics, f"val-env/{tag}/success")
        _, train = series(metrics, f"train/{tag}/success")
        _, loss = series(metrics, "actor/pg_loss")
        _, wall = series(metrics, "timing_s/step")
        finite = bool(np.all(np.isfinite(loss)))
        curve = ", ".join(f"{v:.3f} (step {s})" for s, v in zip(steps, val, strict=True))
        lines.append(f"| {name} | {tag} | {max(steps)} | {sum(wall) / 60:.1f} | {curve} "
                     f"| {np.mean(train):.3f} | {'yes' if finite else 'NO'} |")
    return lines


def plot(folders: dict[str, Path]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(folders), figsize=(6 * len(folders), 3.6), squeeze=False)
    for ax, (name, folder) in zip(axes[0], folders.items(), strict=True):
        metrics = read_jsonl(folder / "metrics.jsonl")
        for i, tag in enumerate(tags(metrics)):
            ax.plot(*series(metrics, f"val-env/{tag}/success"), marker="o", color=f"C{i}",
                    label=f"{tag} validation")
            ax.plot(*series(metrics, f"train/{tag}/success"), color=f"C{i}", alpha=0.4, lw=0.8,
                    label=f"{tag} training batch")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("success")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "training_modes.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=RESULTS / "runs", help="folder of the run folders")
    p.add_argument("--summarize-only", action="store_true", help="read existing runs")
    p.add_argument("--only", choices=tuple(RUNS), nargs="*", default=list(RUNS))
    args = p.parse_args()
    folders = {name: args.runs / f"modes-{name}" for name in args.only}
    if not args.summarize_only:
        args.runs.mkdir(parents=True, exist_ok=True)
        for name, folder in folders.items():
            print(f"{name}: {run(name, folder) / 60:.1f} min", flush=True)
    table = ["| run | tag | steps | step wall min (validation excluded) | validation success "
             "(T=0.5; 256 episodes, split between the tags of a mix) | mean training-batch success | losses finite |",
             "|---|---|---|---|---|---|---|"]
    for name, folder in folders.items():
        table += summarize(name, folder)
    commands = "\n".join(f"    python launch.py {' '.join(RUNS[n] + COMMON)}" for n in folders)
    text = (f"# Training modes on the tiny presets (2 CPU cores)\n\n`python experiments/"
            f"training_modes.py` runs:\n\n{commands}\n\n" + "\n".join(table) + "\n\n"
            f"![curves]({plot(folders).name})\n")
    (RESULTS / "training_modes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
