"""The tiny presets learning on this CPU: ``python -m experiments.studies.learning_curves``.

For each preset (``configs/bandit.py``, ``frozenlake.py``, ``sokoban.py``, tiny) and seed:

1. **The starting policy** is built once (``Trainer.warmstart``, in a child process): the
   cached warm-start (on FrozenLake and Sokoban the solver-mixture prior, shared by every
   seed through ``warmstart.seed``); its build time is reported apart, as a download would be.
2. **RL**: ``launch.py`` under a wall-clock budget (10 / 20 / 20 minutes, counted from the
   process start; at the budget a SIGTERM finishes the step, checkpoints and exits), into
   ``experiments/results/runs/<env>-s<seed>/``.
3. **The imitation control** (``--imitation``, one per seed): the same budget spent
   continuing supervised training of the starting policy on its own data (the solver
   mixture), validated on the same 256 seeds at T=0.5 as RL (validation time not counted:
   the control gets more training than RL for its wall time). RL must end above it;
   otherwise the gain is the prior's, not StarPO's.

``--jobs N`` runs N of these processes at once (their wall times then include the sharing of
the CPU, which the table says). It draws mean and spread (min-max over seeds) of validation
success against process wall time and against steps, and first-turn I(X;Z) (RAGEN V2's input
dependence: ~0 means answers ignore the observation), with the imitation control, to
``learning_curves_<env>.png``, and writes the table into
``experiments/results/learning_curves.md`` between its table markers (prose around them is
kept).

A study (``--tag``) is the same runs with overrides, in ``results/runs_<tag>``; ``--compare``
reads several tags (``base`` = ``results/runs``) at one wall budget: each run's last
validation within the budget (process wall time), mean over seeds.

    python -m experiments.studies.learning_curves                        # all presets, seeds 0 1 2
    python -m experiments.studies.learning_curves --only frozenlake --imitation --jobs 2
    python -m experiments.studies.learning_curves --plot-only            # redraw from existing runs
    python -m experiments.studies.learning_curves --only frozenlake --tag scratch --override=--config.warmstart.solver_share=0 ...
    python -m experiments.studies.learning_curves --only frozenlake --tag starpo_s --budget 600 \
        --override=--config.filter.strategy=top_k --override=--config.filter.value=0.25
    python -m experiments.studies.learning_curves --only frozenlake --compare base starpo_s --budget 600
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common import RESULTS, ROOT
from ragen_jax.metrics import read_jsonl
from ragen_jax.plots import find_tag, series

RUNS = {"bandit": 600, "frozenlake": 1200, "sokoban": 1200}  # wall-clock budgets, seconds
MI = "collapse_first_turn_sample/mi_estimate"


def launch(name: str, out: Path, extra: list[str], budget: float | None, log: Path) -> float:
    """Runs ``launch.py`` (killed politely at ``budget`` seconds); returns its wall time."""
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", f"configs/{name}.py",
           f"--config.trainer.output_dir={out}", "--config.trainer.progress=False", *extra]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # finishes the step, checkpoints, exits
            proc.wait()
    if proc.returncode not in (0, -signal.SIGTERM):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0


def build_prior(name: str, extra: list[str], runs: Path) -> float:
    """Builds (or finds) the cached starting policy in a child process; returns its seconds."""
    code = ("import sys; from ragen_jax.config.loading import load_config; from ragen_jax.train import Trainer; "
            "print(Trainer(load_config(sys.argv[1:])).warmstart())")
    cmd = [sys.executable, "-c", code, "--config", f"configs/{name}.py",
           f"--config.trainer.output_dir={runs / f'{name}-prior'}", *extra]
    t0 = time.perf_counter()
    with open(runs / f"{name}-prior.log", "w") as f:
        subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def imitate(name: str, budget: float, seed: int, extra: list[str], out: Path, points: int = 8) -> None:
    """The imitation control (see the module docstring): ``curve.json`` of (SFT steps, SFT
    wall seconds, validation success) from the starting policy on."""
    from ragen_jax.config.loading import load_config
    from ragen_jax.policy import trained
    from ragen_jax.sft import train_sft
    from ragen_jax.train import Trainer
    from ragen_jax.warmstart import warmstart_data

    c = load_config(["--config", str(ROOT / f"configs/{name}.py"), f"--config.trainer.output_dir={out}",
                     f"--config.seed={seed}", *extra])
    t = Trainer(c)
    t.warmstart()  # the cached starting policy
    w, tag = t.run.warmstart, t.tag
    rollout = t.rollouts[tag]
    data = warmstart_data(rollout.env, rollout.env_params, t.tokenizer, t.plan.rollout,
                          episodes=w.episodes, seed=w.seed_for(t.run.seed), legal_only=w.legal_actions,
                          solver_share=w.solver_share)
    curve, steps, spent = [], 0, 0.0

    def record() -> None:
        vm, _ = t.validate()
        curve.append({"sft_steps": steps, "wall_s": spent, "success": vm[f"val-env/{tag}/success"]})
        print(f"imitation {name} seed {seed}: {curve[-1]}", flush=True)

    record()
    chunk = max(1, w.steps // 4)
    while spent < budget:
        t0 = time.perf_counter()
        train_sft(t.actor, data, steps=chunk, batch_size=w.batch_size, lr=w.lr,
                  seed=seed * 1000 + steps, trainable=trained(t.run.model))
        spent += time.perf_counter() - t0
        steps += chunk
        if spent >= budget * len(curve) / points or spent >= budget:
            t.restart_from_actor()
            record()
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(curve, indent=1))


def run_jobs(jobs: list[tuple[str, str, int]], budget_of: dict[str, float], extra: list[str],
             runs: Path, workers: int) -> None:
    """RL runs and imitation controls, ``workers`` processes at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[str, str, int]) -> None:
        kind, name, seed = job
        if kind == "rl":
            out = runs / f"{name}-s{seed}"
            shutil.rmtree(out, ignore_errors=True)
            launch(name, out, [*extra, f"--config.seed={seed}"], budget_of[name], runs / f"{name}-s{seed}.log")
            return
        out = runs / f"{name}-imitation-s{seed}"
        cmd = [sys.executable, "-m", "experiments.studies.learning_curves", "--imitate-one", name, str(seed), "--budget", str(budget_of[name]),
               f"--runs-dir={runs}", *[f"--override={o}" for o in extra]]
        with open(runs / f"{name}-imitation-s{seed}.log", "w") as f:
            subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
        print(f"imitation control done: {out}", flush=True)

    with ThreadPoolExecutor(workers) as pool:
        for result in [pool.submit(one, job) for job in jobs]:
            result.result()


# -- reading runs ------------------------------------------------------------------------------


def run_curves(out: Path) -> dict[str, np.ndarray]:
    """Validation success against step and wall time (the process's elapsed seconds where the
    run logged them, else cumulative step time), and first-turn I(X;Z)."""
    metrics = read_jsonl(out / "metrics.jsonl")
    tag = find_tag(metrics)
    steps, val = series(metrics, f"val-env/{tag}/success")
    wall = np.cumsum([metrics[s].get("timing_s/step", 0.0) for s in sorted(metrics)])
    at = {s: metrics[s].get("timing_s/elapsed", w) for s, w in zip(sorted(metrics), wall, strict=True)}
    mi_steps, mi = series(metrics, MI)
    return {"steps": np.array(steps), "val": np.array(val), "wall": np.array([at[s] for s in steps]),
            "mi_steps": np.array(mi_steps), "mi": np.array(mi), "last_step": max(metrics)}


def seed_curves(name: str, seeds: list[int], runs: Path) -> dict[int, dict[str, np.ndarray]]:
    """``run_curves`` of each seed's run of ``name`` in ``runs`` that has metrics."""
    return {s: run_curves(runs / f"{name}-s{s}") for s in seeds
            if (runs / f"{name}-s{s}" / "metrics.jsonl").is_file()}


def imitation_curves(name: str, seeds: list[int], runs: Path) -> dict[int, list[dict]]:
    files = {s: runs / f"{name}-imitation-s{s}" / "curve.json" for s in seeds}
    return {s: json.loads(f.read_text()) for s, f in files.items() if f.is_file()}


def summarize(name: str, seeds: list[int], runs: Path, prior_s: float | None) -> str | None:
    curves = seed_curves(name, seeds, runs)
    if not curves:
        return None
    start = np.array([c["val"][0] for c in curves.values()])
    last = np.array([c["val"][-1] for c in curves.values()])
    best = np.array([c["val"].max() for c in curves.values()])
    wall = np.array([c["wall"][-1] / 60 for c in curves.values()])
    gain = last - start
    mi = [f"{c['mi'][0]:.2f}->{c['mi'][-1]:.2f}" for c in curves.values() if len(c["mi"])]
    imitation = "-"
    ic = imitation_curves(name, seeds, runs)
    if ic:
        first = np.mean([c[0]["success"] for c in ic.values()])
        end = np.mean([c[-1]["success"] for c in ic.values()])
        imitation = (f"{first:.3f} -> {end:.3f} ({len(ic)} seed{'s' * (len(ic) > 1)}, "
                     f"~{np.mean([c[-1]['sft_steps'] for c in ic.values()]):.0f} SFT steps)")
    prior = f"{prior_s / 60:.1f}" if prior_s is not None else "-"
    return (f"| {name} | {len(curves)} ({', '.join(map(str, curves))}) | {prior} "
            f"| {np.mean([c['last_step'] for c in curves.values()]):.0f} | {wall.mean():.1f} "
            f"| {start.mean():.3f} | {last.mean():.3f} ± {last.std():.3f} | {best.mean():.3f} "
            f"| {gain.mean():+.3f} [{gain.min():+.3f}, {gain.max():+.3f}] | {imitation} | {'; '.join(mi) or '-'} |")


def at_budget(c: dict[str, np.ndarray], budget: float) -> tuple[float, float, int]:
    """(start, validation success, step) at the run's last validation within ``budget`` s."""
    i = int(np.searchsorted(c["wall"], budget, side="right")) - 1
    return float(c["val"][0]), float(c["val"][max(i, 0)]), int(c["steps"][max(i, 0)])


def compare(name: str, tags: list[str], seeds: list[int], budget: float) -> str:
    """A study table: each tag's runs read at one wall budget, and at one step (the last
    validation step every run reached, budget or not), so that a slower step and a slower
    machine can be told apart."""
    curves = {}
    for tag in tags:
        got = seed_curves(name, seeds, RESULTS / ("runs" if tag == "base" else f"runs_{tag}"))
        if got:
            curves[tag] = got
    common = min(int(c["steps"][-1]) for got in curves.values() for c in got.values())
    b = f"{budget / 60:.0f} min"
    rows = [f"| {name} arm | seeds | last validated step at {b} (mean) | val success: start -> at {b} (mean) "
            f"| gain at {b} (mean [min, max]) | gain at step {common} (mean [min, max]) | per seed, at {b} |",
            "|---|---|---|---|---|---|---|"]
    for tag, got in curves.items():
        start, end, step = (np.array(x) for x in zip(*(at_budget(c, budget) for c in got.values()), strict=True))
        at_step = np.array([c["val"][np.searchsorted(c["steps"], common, side="right") - 1] for c in got.values()])
        gain, gain_step = end - start, at_step - start
        rows.append(f"| {tag} | {len(got)} | {step.mean():.0f} | {start.mean():.3f} -> {end.mean():.3f} "
                    f"| {gain.mean():+.3f} [{gain.min():+.3f}, {gain.max():+.3f}] "
                    f"| {gain_step.mean():+.3f} [{gain_step.min():+.3f}, {gain_step.max():+.3f}] "
                    f"| {', '.join(f's{s}: {a:.3f}->{e:.3f} (step {k})' for s, a, e, k in zip(got, start, end, step, strict=True))} |")
    return "\n".join(rows)


def plot(name: str, seeds: list[int], runs: Path, title: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = list(seed_curves(name, seeds, runs).values())
    if not curves:
        return None
    imitation = imitation_curves(name, seeds, runs)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, x_key, label in ((axes[0], "wall", "wall minutes (process)"), (axes[1], "steps", "step")):
        for c in curves:
            ax.plot(c[x_key] / (60 if x_key == "wall" else 1), c["val"], color="C0", alpha=0.3, lw=0.8)
        n = min(len(c["val"]) for c in curves)  # seeds validate at the same steps
        mean = np.mean([c["val"][:n] for c in curves], 0)
        lo, hi = np.min([c["val"][:n] for c in curves], 0), np.max([c["val"][:n] for c in curves], 0)
        x = np.mean([c[x_key][:n] for c in curves], 0) / (60 if x_key == "wall" else 1)
        ax.plot(x, mean, color="C0", marker="o", ms=3, label=f"StarPO, mean of {len(curves)} seeds")
        ax.fill_between(x, lo, hi, color="C0", alpha=0.15, label="min-max over seeds")
        ax.axhline(mean[0], color="0.4", ls=":", lw=1, label="starting policy")
        if x_key == "wall":
            for i, ic in enumerate(imitation.values()):
                ax.plot([p["wall_s"] / 60 for p in ic], [p["success"] for p in ic], color="C3", ls="--",
                        marker="s", ms=3, alpha=0.8, label="imitation control (SFT minutes)" if i == 0 else None)
        ax.set_xlabel(label)
        ax.set_ylabel("validation success (256 seeds, T=0.5)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for c in curves:
        axes[2].plot(c["mi_steps"], c["mi"], marker="o", ms=3, alpha=0.7)
    axes[2].set_title("first-turn I(X;Z) per seed (nats)")
    axes[2].set_xlabel("step")
    axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out = RESULTS / f"learning_curves_{name}{'' if runs.name == 'runs' else '_' + runs.name}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_table(md: Path, text: str, begin: str = "<!-- table -->", end: str = "<!-- /table -->") -> None:
    """Puts ``text`` between the markers in ``md`` (made if missing), keeping the prose around."""
    block = f"{begin}\n{text}{end}"
    if md.is_file() and begin in (old := md.read_text()) and end in old:
        md.write_text(old[:old.index(begin)] + block + old[old.index(end) + len(end):])
        return
    header = (f"# Learning curves, tiny presets ({os.cpu_count()} CPU cores)\n\n"
              "`python -m experiments.studies.learning_curves` (validation: 256 fixed seeds, T=0.5; "
              "see the script's docstring).\n\n")
    md.write_text(header + block + "\n" + (md.read_text() if md.is_file() else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=sorted(RUNS), action="append")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--imitation", action="store_true", help="also run the imitation control, one per seed")
    p.add_argument("--imitation-seeds", type=int, nargs="+", help="its seeds (default: --seeds)")
    p.add_argument("--budget", type=float, default=None, help="seconds per run (default: 600 bandit, 1200 others)")
    p.add_argument("--jobs", type=int, default=1, help="processes at once")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every run")
    p.add_argument("--tag", default="", help="runs go to results/runs_<tag> (a variant, e.g. scratch)")
    p.add_argument("--compare", nargs="+", metavar="TAG", help="study table of these tags at --budget")
    p.add_argument("--imitate-one", nargs=2, metavar=("ENV", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--runs-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    names = args.only or list(RUNS)
    if args.imitate_one:
        name, seed = args.imitate_one[0], int(args.imitate_one[1])
        imitate(name, args.budget, seed, args.override, Path(args.runs_dir) / f"{name}-imitation-s{seed}")
        return
    if args.compare:
        for name in names:
            print(compare(name, args.compare, args.seeds, args.budget or RUNS[name]))
        return
    runs = RESULTS / (f"runs_{args.tag}" if args.tag else "runs")
    runs.mkdir(parents=True, exist_ok=True)
    timing_file = runs / "prior_build_s.json"
    prior_s = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
    if not args.plot_only:
        for name in names:
            prior_s[name] = build_prior(name, args.override, runs)
            timing_file.write_text(json.dumps(prior_s))
        jobs = [("rl", n, s) for n in names for s in args.seeds]
        imitation_seeds = args.imitation_seeds or args.seeds
        jobs += [("imitation", n, s) for n in names for s in imitation_seeds] if args.imitation else []
        run_jobs(jobs, {n: args.budget or RUNS[n] for n in names}, args.override, runs, args.jobs)
    rows = []
    for name in RUNS:  # the table keeps earlier runs of presets not rerun now
        row = summarize(name, args.seeds, runs, prior_s.get(name))
        if row:
            rows.append(row)
            variant = f", {args.tag}" if args.tag else ""
            print(f"wrote {plot(name, args.seeds, runs, f'{name} (tiny preset{variant})')}")
    table = ["| env | seeds | prior min (build, or load when cached) | RL steps (mean) | RL wall min (process) | val success at "
             "step 0 (starting policy) | last val success (mean ± sd) | best val (mean) | gain last - start "
             "(mean [min, max]) | imitation control start -> end (mean) | first-turn I(X;Z) nats, first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|", *rows]
    text = "\n".join(table) + "\n"
    print(text)
    md = RESULTS / f"learning_curves{'_' + args.tag if args.tag else ''}.md"
    write_table(md, text)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
