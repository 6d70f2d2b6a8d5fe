"""Miniature collapse studies on this CPU: filtering, algorithms, reasoning regimes.

What: three small reproductions of RAGEN's (V1 StarPO-S, V2 SNR-adaptive filtering and
collapse diagnostics) claims with the ``tiny`` presets, each under one wall-clock budget for
the whole study (default 30 minutes, split evenly across its runs):

- ``filtering``: no filter (top-p 1.0) vs SNR-adaptive top-p 0.9 (softmax; RAGEN V2's main
  table) vs StarPO-S top-25% reward std, on Sokoban and FrozenLake, seeds 0 1 2.
- ``algorithms``: PPO (GAE + critic) vs GRPO (std-normalised; the tiny preset's default is
  Dr.GRPO) on Bandit and FrozenLake, seeds 0 1 2: which collapses first.
- ``regimes``: one run (FrozenLake, seed 0) and RAGEN V2's four-regime scatter of
  H(Z|X) vs I(X;Z) over training (``ragen_jax.plots.plot_regimes``).

Why: to see, at a scale this machine affords, whether filtering changes the success curves
and when the collapse indicators (in-group reward std, policy entropy, the first-turn
I(X;Z) estimate, gradient-norm spikes) move. Each run is ``launch.py`` in a subprocess,
stopped by SIGTERM when its share of the budget is spent (the trainer finishes the step,
checkpoints and exits; the overrun comes out of the next runs' shares), in a fresh folder
``experiments/results/runs/studies/<study>/<env>-<setting>-seed<s>``. Runs log the collapse
diagnostics every ``--diag-freq`` steps and (filtering, algorithms) the gradient analysis.
In ``filtering`` the settings differ only after step 0, so each env and seed's warm-start
and step-0 validation run once (``_step0/``, stopped right after step 0) and every setting
resumes from that checkpoint; in ``algorithms`` each run pays its own (PPO has a critic).

FrozenLake and Sokoban runs start from the presets' solver-mixture prior (built once at
first use, ~10 minutes, then loaded from the cache; ``configs/base.py``); the timings below
were measured with the earlier format-only warm-start. For studies from the prior under one
wall budget with a shared baseline, ``experiments/studies/learning_curves.py --tag ... --compare``.

What the budget affords (measured on this 2-core CPU at ``nice 19`` beside another
training job, bandit): start-up + warm-start + step-0 validation ~1.5 min; the first
training step ~1 min (compiling the update, the diagnostics and the gradient analysis);
then ~3.5 s per step (GRPO; PPO's critic ~6 s) plus ~9 s per validation, and ~35 s more
on every diagnostics step (collapse diagnostics + gradient analysis, measured before the
cross scoring reused each input's KV cache, which cut FrozenLake's diagnostics step from
~86 s to ~7 s; ``--diag-freq 10`` buys steps at the cost of MI points). So a run needs ~3 min before its curves
mean anything, and the defaults do NOT fit 30 minutes: ``filtering`` (2 envs x 3 settings
x 3 seeds = 18 runs, ~1.7 min each) and ``algorithms`` (12 runs, 2.5 min each) reach only a
handful of steps; the script warns and the table flags such runs. FrozenLake is slower
still (same conditions): start-up + warm-start + step-0 validation ~3.5 min, the first step
~3 min (2 of them compiling and running the collapse diagnostics), validation ~30 s, a
rollout ~20 s per step; so ``regimes`` (one FrozenLake run, 30 min) should reach a few
tens of steps, i.e. only a handful of diagnostics points (an estimate: not measured to the
end). What fits better: ``filtering --envs sokoban --seeds 0`` (3 runs) or
``algorithms --envs bandit --seeds 0 1`` (4 runs), or a larger ``--budget-min``.

Measured (quiet machine, per-cell grid tokens): ``filtering --envs sokoban --seeds 0
--budget-min 25 --val-freq 10`` reached 26-30 steps per setting in ~8 min each. A Sokoban
step is ~7 s, but a diagnostics step with the gradient analysis takes 35-50 s: the analysis
runs one full backward pass per (bucket or whole batch, loss component), 8 passes here. That
is most of the budget; ``--diag-freq 10`` or no gradient analysis buys steps.

Outputs in ``experiments/results/``: ``collapse_<study>.png`` (rows = env; columns =
validation success, train success, in-group reward std, entropy, MI estimate, grad norm;
one colour per setting, thin per-seed lines and a thick mean over the seeds on the steps
they all reached) and ``collapse_<study>.md`` (steps reached, first/last/best validation
success as mean +- sd over seeds, and the first step where each collapse detector below
fired, per seed). ``regimes`` writes ``collapse_regimes.png`` and ``collapse_regimes.md``.

Collapse detectors (``ragen_jax.collapse_detectors``, pure functions of one run's series): reward std below 0.1 x the mean of its first 5 steps
(RAGEN's early-stop rule, without its 10-step streak); entropy below 0.5 x the mean of its
first 5 steps; MI estimate below 0.5 x the mean of its first 3 diagnostics points (only when
that mean is positive); grad norm above 3 x the median of all earlier steps (at least 5).

    python -m experiments.studies.collapse_studies filtering                    # 18 runs, 30 min
    python -m experiments.studies.collapse_studies algorithms                   # 12 runs, 30 min
    python -m experiments.studies.collapse_studies regimes                      # 1 run, 30 min
    python -m experiments.studies.collapse_studies regimes --run DIR            # reuse a run
    python -m experiments.studies.collapse_studies algorithms --envs bandit --seeds 0 --budget-min 3
    python -m experiments.studies.collapse_studies filtering --plot-only        # redraw from runs/

Conclusions at this scale are limited: a random-init 4-layer model, 64 episodes per step,
minutes of training; the tables say how many steps each run reached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.common import RESULTS, ROOT
from ragen_jax.collapse_detectors import DETECTORS, detect
from ragen_jax.metrics import read_jsonl
from ragen_jax.plots import find_tag, plot_regimes, series

RUNS = RESULTS / "runs" / "studies"

Metrics = dict[int, dict[str, float]]

# ---- the studies ------------------------------------------------------------------------------

NO_FILTER = ["--config.filter.strategy=top_p", "--config.filter.value=1.0"]
STUDIES: dict[str, dict] = {
    "filtering": {
        "envs": ("sokoban", "frozenlake"),
        "settings": {
            "no-filter": NO_FILTER,
            "snr-top-p-0.9": ["--config.filter.strategy=top_p", "--config.filter.value=0.9",
                              "--config.filter.top_p_prob_mode=softmax"],
            "starpo-s-top-25%": ["--config.filter.strategy=top_k", "--config.filter.value=0.25"],
        },
        "seeds": (0, 1, 2), "gradient_analysis": True,
        "share_warmstart": True,  # the settings differ only after step 0 (same model, algorithm)
    },
    "algorithms": {
        "envs": ("bandit", "frozenlake"),
        "settings": {
            "ppo": ["--config.algorithm.adv_estimator=gae", *NO_FILTER],
            "grpo": ["--config.algorithm.adv_estimator=grpo", *NO_FILTER],
        },
        "seeds": (0, 1, 2), "gradient_analysis": True,
        "share_warmstart": False,  # PPO's checkpoint holds a critic, GRPO's does not
    },
    "regimes": {
        "envs": ("frozenlake",),
        "settings": {"default": []},  # the tiny preset as it is (Dr.GRPO, no filter)
        "seeds": (0,), "gradient_analysis": False,  # the scatter needs only the MI metrics
        "share_warmstart": False,
    },
}

# (metric key with {tag}, panel title, log y)
PANELS = (
    ("val-env/{tag}/success", "validation success", False),
    ("train/{tag}/success", "train success (T=1)", False),
    ("rollout/in_group_reward_std", "in-group reward std", False),
    ("actor/entropy", "policy entropy (nats/token)", False),
    ("collapse_first_turn_sample/mi_estimate", "I(X;Z) estimate, first turn (nats)", False),
    ("actor/grad_norm", "actor grad norm (before clip)", True),
)


@dataclass(frozen=True)
class Run:
    study: str
    env: str
    setting: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.env}-{self.setting}-seed{self.seed}"

    @property
    def out(self) -> Path:
        return RUNS / self.study / self.name


# ---- running ----------------------------------------------------------------------------------


def common_overrides(args: argparse.Namespace, gradient_analysis: bool) -> list[str]:
    # save_freq 1000: no periodic checkpoints (time), so step 0's stays for seed_step0; the
    # SIGTERM stop still checkpoints the last step
    return ["--config.trainer.progress=False", "--config.trainer.save_trajectories=False",
            "--config.trainer.save_freq=1000",
            f"--config.trainer.test_freq={args.val_freq}",
            f"--config.rollout.val.env_groups={args.val_groups}",
            f"--config.diagnostics.compute_freq={args.diag_freq}",
            f"--config.diagnostics.gradient_analysis={gradient_analysis}", *args.override]


def seed_step0(run: Run, donor: Path) -> None:
    """Starts ``run`` from ``donor``'s step-0 checkpoint and step-0 metrics (warm-start and
    validation before training), so the launched run resumes at step 0 and skips both: the
    result is the one it would have computed itself (same env, seed and warm-start config;
    a resumed run continues as the uninterrupted run would)."""
    shutil.copytree(donor / "checkpoints" / "0", run.out / "checkpoints" / "0")
    lines = (donor / "metrics.jsonl").read_text().splitlines()
    step0 = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] == 0]
    (run.out / "metrics.jsonl").write_text("\n".join(step0) + "\n")
    (run.out / "step0_from.txt").write_text(f"{donor.name}\n")


def train(run: Run, budget_s: float, overrides: list[str], donor: Path | None = None) -> float:
    """One ``launch.py`` run in a fresh folder (seeded from ``donor``'s step 0 if given),
    SIGTERM after ``budget_s``; returns the wall seconds."""
    if run.out.exists():
        subprocess.run(["rm", "-rf", str(run.out)], check=True)
    run.out.mkdir(parents=True)
    if donor is not None:
        seed_step0(run, donor)
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", f"configs/{run.env}.py",
           f"--config.trainer.output_dir={run.out}", f"--config.seed={run.seed}", *overrides]
    print(f"[{time.strftime('%H:%M:%S')}] {run.name}: {budget_s:.0f} s\n  {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(run.out.parent / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=max(budget_s, 1.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # finishes the step, checkpoints, exits
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    (run.out / "wall_s.txt").write_text(f"{wall:.1f}\n")
    return wall


def prepare_step0(run: Run, overrides: list[str]) -> Path | None:
    """Warm-start and step-0 validation of ``run``'s env and seed, once, in
    ``<study>/_step0/<env>-seed<s>``: launched like ``run`` and stopped by SIGTERM as soon as
    step 0 is logged (the trainer then checkpoints step 0 and exits before training). Every
    setting then resumes from it, so none pays the warm-start inside its share."""
    out = RUNS / run.study / "_step0" / f"{run.env}-seed{run.seed}"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", f"configs/{run.env}.py",
           f"--config.trainer.output_dir={out}", f"--config.seed={run.seed}", *overrides]
    print(f"[{time.strftime('%H:%M:%S')}] step 0 of {run.env} seed {run.seed}\n  {' '.join(cmd)}",
          flush=True)
    metrics = out / "metrics.jsonl"  # created empty before the warm-start; step 0 comes after
    with open(out.parent / f"{run.env}-seed{run.seed}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and not (metrics.is_file() and metrics.stat().st_size > 0):
            time.sleep(1.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # step 0 logged: checkpoint it and exit
        proc.wait()
    return out if (out / "checkpoints" / "0").is_dir() else None


MIN_SHARE_S = 240  # below this a run is mostly start-up and its first (compiling) step


def run_study(runs: list[Run], budget_s: float, base: list[str]) -> None:
    """Runs in order; each gets the remaining budget over the remaining runs (so one run's
    SIGTERM overrun comes out of the later ones' shares). Where the study shares the
    warm-start, each (env, seed)'s step 0 is computed once first (``prepare_step0``, its
    time taken from the budget) and every setting resumes from it."""
    if budget_s / len(runs) < MIN_SHARE_S:
        print(f"warning: {len(runs)} runs in {budget_s / 60:g} min = {budget_s / len(runs):.0f} s "
              f"each; start-up and the first step take ~{MIN_SHARE_S // 60} min here, so expect "
              f"few steps per run (fewer --envs/--seeds or a larger --budget-min)", flush=True)
    deadline = time.perf_counter() + budget_s
    donors: dict[tuple[str, int], Path | None] = {}
    for i, run in enumerate(runs):
        overrides = [*STUDIES[run.study]["settings"][run.setting], *base]
        key = (run.env, run.seed)
        if STUDIES[run.study]["share_warmstart"] and key not in donors:
            donors[key] = prepare_step0(run, overrides)
        share = (deadline - time.perf_counter()) / (len(runs) - i)
        if share < 5:  # the budget is spent: leave no stale folder, say so
            subprocess.run(["rm", "-rf", str(run.out)], check=True)
            print(f"  {run.name}: skipped, the budget is spent", flush=True)
            continue
        wall = train(run, share, overrides, donors.get(key))
        print(f"  {run.name}: {wall:.0f} s, {steps_reached(load(run))} steps", flush=True)


# ---- summaries --------------------------------------------------------------------------------


def load(run: Run) -> Metrics:
    path = run.out / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else {}


def tag_of(metrics: Metrics) -> str | None:
    """The env's metric tag (from validation keys, else train keys), None if nothing logged."""
    try:
        return find_tag(metrics)
    except ValueError:
        for m in metrics.values():
            for k in m:
                if k.startswith("train/") and k.endswith("/success"):
                    return k.split("/")[1]
    return None


def steps_reached(metrics: Metrics) -> int:
    return max(metrics, default=0)


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


def val_stats(metrics: Metrics) -> tuple[float, float, float] | None:
    """(first, last, best) validation success of one run, None without validation."""
    tag = tag_of(metrics)
    _, val = series(metrics, f"val-env/{tag}/success") if tag else ([], [])
    return (val[0], val[-1], max(val)) if val else None


def per_seed(values: list[int | None]) -> str:
    return ", ".join("-" if v is None else str(v) for v in values)


def table_rows(study: str, envs: list[str], settings: list[str], seeds: list[int]) -> list[str]:
    rows = []
    for env in envs:
        for setting in settings:
            runs = [Run(study, env, setting, s) for s in seeds]
            metrics = [load(r) for r in runs]
            if not any(metrics):
                continue
            stats = [v for m in metrics if (v := val_stats(m))]
            found = [detect(m) for m in metrics]
            earliest = [min((s for s in f.values() if s is not None), default=None) for f in found]
            reached = ", ".join(f"{steps_reached(m)} ({wall_min(r)})" for r, m in zip(runs, metrics, strict=True))
            cells = [env, setting, reached,
                     *(mean_sd([s[i] for s in stats]) for i in range(3)),
                     *(per_seed([f[c] for f in found]) for c, _, _ in DETECTORS), per_seed(earliest)]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def save_meta(study: str, args: argparse.Namespace) -> None:
    """The study's budget and cadence, so ``--plot-only`` states what the runs had."""
    meta = {"budget_min": args.budget_min, "val_freq": args.val_freq,
            "val_groups": args.val_groups, "diag_freq": args.diag_freq, "override": args.override}
    (RUNS / study).mkdir(parents=True, exist_ok=True)
    (RUNS / study / "study.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_meta(study: str, args: argparse.Namespace) -> dict:
    path = RUNS / study / "study.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"budget_min": args.budget_min, "val_freq": args.val_freq,
            "val_groups": args.val_groups, "diag_freq": args.diag_freq, "override": args.override}


def wall_min(run: Run) -> str:
    path = run.out / "wall_s.txt"
    return f"{float(path.read_text()) / 60:.1f}" if path.is_file() else "?"


def write_table(study: str, envs: list[str], settings: list[str], seeds: list[int],
                meta: dict) -> Path:
    cols = ["env", "setting", "steps reached (wall min), per seed", "val success first", "val success last",
            "val success best", *(f"{c} (step, per seed)" for c, _, _ in DETECTORS),
            "earliest detector (per seed)"]
    rows = table_rows(study, envs, settings, seeds)
    n_runs = len(envs) * len(settings) * len(seeds)
    budget_min = meta["budget_min"]
    extra = f" Extra overrides: `{' '.join(meta['override'])}`." if meta["override"] else ""
    header = (
        f"# Collapse study: {study} (tiny presets, {os.cpu_count()} CPU cores)\n\n"
        f"![curves](collapse_{study}.png)\n\n"
        f"`python -m experiments.studies.collapse_studies {study} --budget-min {budget_min:g} "
        f"--envs {' '.join(envs)} --seeds {' '.join(map(str, seeds))}`\n\n"
        f"Budget {budget_min:g} min for {n_runs} runs, ~{budget_min / max(n_runs, 1):.1f} min each "
        f"(wall clock including start-up, warm-start and validation); the steps each run reached "
        f"are in the table. Validation every {meta['val_freq']} steps on {meta['val_groups']} fixed "
        f"seeds (T=0.5); collapse diagnostics every {meta['diag_freq']} steps.{extra} Settings: "
        + "; ".join(f"{name} = `{' '.join(o) or 'tiny preset defaults'}`"
                    for name, o in STUDIES[study]["settings"].items() if name in settings)
        + ".\n\nSuccess: mean +- sd over seeds. Detectors (first step each fired, `-` = never): "
        "in-group reward std below 0.1 x its first-5-step mean; entropy below 0.5 x its "
        "first-5-step mean; first-turn MI estimate below 0.5 x the mean of its first 3 "
        "diagnostics points; actor grad norm above 3 x the median of the earlier steps. "
        "The entropy and grad-norm detectors also fire in runs that learn (on the 130-step "
        "bandit run of `learning_curves.py`, which reached validation success 1.0, the "
        "grad-norm one fired at step 22 and the entropy one at step 53): read them with the "
        "success columns, not as collapse on their own.\n\n"
        "**Conclusions at this scale are limited**: a random-init 4-layer width-128 model "
        "warm-started on the answer format, 64 episodes per step, minutes per run, few seeds; "
        "a detector that fires in a short noisy run is a hint, not a finding.\n\n")
    short = [r.name for e in envs for st in settings for sd in seeds
             if (r := Run(study, e, st, sd)).out.is_dir() and steps_reached(load(r)) < 5]
    if short:
        header += (f"**{len(short)} run(s) reached fewer than 5 steps** ({', '.join(short)}): "
                   "their share did not cover much more than start-up (JAX import and "
                   "compilation, warm-start, step-0 validation); nothing about collapse can be "
                   "read from them. Give fewer envs/seeds or a larger budget.\n\n")
    shared = [r.name for e in envs for st in settings for sd in seeds
              if (r := Run(study, e, st, sd)).out.joinpath("step0_from.txt").is_file()]
    if shared:
        header += ("Every setting of an env and seed resumed from one step-0 checkpoint "
                   "(warm-start and step-0 validation computed once per env and seed, outside "
                   "the runs' shares but inside the budget; wall minutes below exclude it): "
                   f"{', '.join(shared)}.\n\n")
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *rows]
    md = RESULTS / f"collapse_{study}.md"
    md.write_text(header + "\n".join(table) + "\n")
    return md


# ---- plots ------------------------------------------------------------------------------------


def _mean_curve(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
    """Mean over the curves on the steps every one of them has."""
    common = sorted(set.intersection(*(set(x) for x, _ in curves))) if curves else []
    lookup = [dict(zip(x, y, strict=True)) for x, y in curves]
    return common, [statistics.mean(d[s] for d in lookup) for s in common]


def plot_grid(study: str, envs: list[str], settings: list[str], seeds: list[int]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(envs), len(PANELS), figsize=(3.4 * len(PANELS), 2.9 * len(envs)),
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, env in enumerate(envs):
        for j, setting in enumerate(settings):
            metrics = [m for s in seeds if (m := load(Run(study, env, setting, s)))]
            color = colors[j % len(colors)]
            for ax, (key, _, _) in zip(axes[row], PANELS, strict=True):
                curves = []
                for m in metrics:
                    tag = tag_of(m)
                    x, y = series(m, key.format(tag=tag)) if tag else ([], [])
                    if x:
                        curves.append((x, y))
                        ax.plot(x, y, color=color, lw=0.6, alpha=0.35)
                mx, my = _mean_curve(curves)
                if mx:
                    ax.plot(mx, my, color=color, lw=1.8, marker="o" if len(mx) < 30 else None,
                            ms=3, label=f"{setting} (n={len(curves)})")
        for col, (ax, (_, title, log)) in enumerate(zip(axes[row], PANELS, strict=True)):
            ax.set_title(f"{env}: {title}" if col == 0 else title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if log and ax.get_lines():
                ax.set_yscale("log")
            if not ax.get_lines():
                ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center",
                        va="center", color="0.5", fontsize=8)
        if axes[row][0].get_lines():
            axes[row][0].legend(fontsize=7)
    fig.suptitle(f"collapse study: {study} (thin: seeds; thick: mean over seeds on common steps)",
                 fontsize=10)
    fig.tight_layout()
    out = RESULTS / f"collapse_{study}.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---- regimes ----------------------------------------------------------------------------------


def regimes_report(run_dir: Path, budget_min: float | None) -> tuple[Path, Path]:
    """The four-regime scatter of one run and its (step, H, I, acc@1, chance) table."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    png = plot_regimes(run_dir, RESULTS / "collapse_regimes.png",
                       title=f"{run_dir.name}: H(Z|X) vs I(X;Z), first-turn pairs (split at run medians)")
    p = "collapse_first_turn_sample/"
    keys = ("conditional_entropy_est", "mi_estimate", "retrieval_accuracy", "retrieval_chance_level")
    rows = [f"| {s} | " + " | ".join(f"{metrics[s][p + k]:.3f}" for k in keys) + " |"
            for s in sorted(metrics) if all(p + k in metrics[s] for k in keys)]
    tag = tag_of(metrics)
    stats = val_stats(metrics)
    val = (f"validation success first {stats[0]:.3f}, last {stats[1]:.3f}, best {stats[2]:.3f}"
           if stats else "no validation logged")
    budget = f"a {budget_min:g}-minute budget" if budget_min is not None else "a reused run"
    md = RESULTS / "collapse_regimes.md"
    md.write_text(
        f"# Collapse study: reasoning regimes (one run, {tag}, tiny preset)\n\n"
        f"Run `{run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir}` "
        f"({budget}, {steps_reached(metrics)} steps reached; {val}). "
        f"Scatter: [collapse_regimes.png](collapse_regimes.png) (quadrants split at the run's medians, so they are "
        f"relative to this run, not absolute regimes). Estimates from first-turn pairs "
        f"(RAGEN V2's cross-scoring of sampled reasoning Z against the inputs X of the batch).\n\n"
        f"**Conclusions at this scale are limited**: a tiny random-init model over minutes; "
        f"the points are few and each estimate is noisy.\n\n"
        "| step | H(Z\\|X) (nats) | I(X;Z) (nats) | retrieval acc@1 | chance@1 |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return png, md


# ---- entry ------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("study", choices=sorted(STUDIES))
    p.add_argument("--budget-min", type=float, default=30.0, help="wall minutes for the whole study")
    p.add_argument("--envs", nargs="+", choices=("bandit", "frozenlake", "sokoban"),
                   help="default: the study's envs")
    p.add_argument("--seeds", nargs="+", type=int, help="default: the study's seeds")
    p.add_argument("--plot-only", action="store_true", help="redraw from the existing run folders")
    p.add_argument("--run", type=Path, help="regimes: reuse this run folder instead of training")
    p.add_argument("--val-freq", type=int, default=5, help="validate every k steps")
    p.add_argument("--val-groups", type=int, default=128, help="validation envs")
    p.add_argument("--diag-freq", type=int, default=5, help="collapse diagnostics every k steps")
    p.add_argument("--override", action="append", default=[],
                   help="extra --config.x=y for every run (write --override=--config.x=y)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    spec = STUDIES[args.study]
    envs = args.envs or list(spec["envs"])
    seeds = args.seeds or list(spec["seeds"])
    settings = list(spec["settings"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.study == "regimes" and args.run is not None:
        png, md = regimes_report(args.run.resolve(), None)
        print(f"wrote {png}\nwrote {md}")
        return
    # env, seed, setting order: a budget cut short costs every setting alike
    runs = [Run(args.study, e, st, s) for e in envs for s in seeds for st in settings]
    if not args.plot_only:
        save_meta(args.study, args)
        run_study(runs, args.budget_min * 60, common_overrides(args, spec["gradient_analysis"]))
    if args.study == "regimes":
        png, md = regimes_report(runs[0].out, load_meta(args.study, args)["budget_min"])
    else:
        png = plot_grid(args.study, envs, settings, seeds)
        md = write_table(args.study, envs, settings, seeds, load_meta(args.study, args))
    print(f"wrote {png}\nwrote {md}")
    print(md.read_text())


if __name__ == "__main__":
    main()
