"""The tiny presets learning on this CPU: ``python experiments/learning_curves.py``.

Runs ``launch.py`` on ``configs/bandit.py``, ``configs/frozenlake.py`` and
``configs/sokoban.py`` (tiny preset, fresh output folders under
``experiments/results/runs/``), each under a wall-clock budget (10 / 20 / 20 minutes; the
run stops at the first checkpoint after the budget via SIGTERM, which saves and exits), then writes per-run curves (PNG: success, score, entropy,
response length vs step) and ``experiments/results/learning_curves.md``: validation
success of the warm-started policy (step 0), the best and last validation success, the
wall time, and the first-turn I(X;Z) estimate with retrieval@1 against chance at the first
and last diagnostics step: near 0 and chance mean the answers do not depend on the
observation at all (RAGEN V2's template collapse), whatever the success curve does.

    python experiments/learning_curves.py                  # all three
    python experiments/learning_curves.py --only bandit    # one
    python experiments/learning_curves.py --plot-only      # redraw from existing runs
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
sys.path.insert(0, str(ROOT))

from ragen_jax.metrics import read_jsonl  # noqa: E402
from ragen_jax.plots import find_tag, plot_run, series  # noqa: E402

RUNS = {"bandit": 600, "frozenlake": 1200, "sokoban": 1200}  # wall-clock budgets, seconds


def train(name: str, budget: float, extra: list[str]) -> tuple[Path, float]:
    out = RESULTS / "runs" / name
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", f"configs/{name}.py",
           f"--config.trainer.output_dir={out}", "--config.trainer.progress=False", *extra]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(RESULTS / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # finishes the step, checkpoints, exits
        proc.wait()
    return out, time.perf_counter() - t0


def summarize(name: str, out: Path, wall: float | None) -> str:
    metrics = read_jsonl(out / "metrics.jsonl")
    tag = find_tag(metrics)
    steps, val = series(metrics, f"val-env/{tag}/success")
    extra = sorted({k for m in metrics.values() for k in m
                    if k.startswith("val-env/") and k.endswith("/success") and k.split("/")[1] != tag})
    other = "; ".join(f"{k.split('/')[1]} {series(metrics, k)[1][-1]:.3f}" for k in extra)
    best = max(range(len(val)), key=lambda i: val[i])
    wall_txt = f"{wall / 60:.1f}" if wall is not None else "-"
    return (f"| {name} | {max(metrics)} | {wall_txt} | {val[0]:.3f} | {val[best]:.3f} (step {steps[best]}) "
            f"| {val[-1]:.3f} | {val[-1] - val[0]:+.3f} | {other or '-'} | {input_dependence(metrics)} |")


def input_dependence(metrics: dict[int, dict[str, float]]) -> str:
    """First-turn I(X;Z) (nats) and retrieval@1 against chance, first and last diagnostics
    step: whether the answers depend on the observation at all (RAGEN V2's collapse check)."""
    steps, mi = series(metrics, "collapse_first_turn_sample/mi_estimate")
    if not steps:
        return "-"
    _, acc = series(metrics, "collapse_first_turn_sample/retrieval_acc@1")
    _, chance = series(metrics, "collapse_first_turn_sample/retrieval_chance@1")
    return " -> ".join(f"{mi[i]:.2f} ({acc[i]:.2f} vs {chance[i]:.2f}, step {steps[i]})" for i in (0, -1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=sorted(RUNS), action="append")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every run")
    args = p.parse_args()
    names = args.only or list(RUNS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in RUNS:  # the table keeps earlier runs of envs not rerun now
        out = RESULTS / "runs" / name
        if name in names and not args.plot_only:
            out, wall = train(name, RUNS[name], args.override)
            (out / "wall_s.txt").write_text(f"{wall:.1f}\n")
        if not (out / "metrics.jsonl").is_file():
            continue
        wall_file = out / "wall_s.txt"
        wall = float(wall_file.read_text()) if wall_file.is_file() else None
        png = plot_run(out, RESULTS / f"learning_curve_{name}.png", title=f"{name} (tiny preset)")
        print(f"wrote {png}")
        rows.append(summarize(name, out, wall))
    table = ["| env | train steps | wall min | val success at step 0 (warm-started) | best val success "
             "| last val success | last - start | other val splits (last) "
             "| first-turn I(X;Z) nats (retrieval@1 vs chance), first -> last |",
             "|---|---|---|---|---|---|---|---|---|", *rows]
    text = "\n".join(table) + "\n"
    print(text)
    md = RESULTS / "learning_curves.md"
    header = (f"# Learning curves, tiny presets ({os.cpu_count()} CPU cores)\n\n"
              f"`python experiments/learning_curves.py` (validation: 256 fixed seeds, T=0.5).\n\n")
    md.write_text(header + text)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
