"""GiGPO against Dr.GRPO and bi-level GAE on the tiny presets: ``python -m experiments.studies.gigpo_compare``.

For each env (``configs/sokoban.py``, ``configs/frozenlake.py``, tiny: the solver-mixture prior,
held-out validation on 256 fixed seeds at T=0.5), each arm and seed, ``launch.py`` under the
preset's wall budget (``learning_curves.RUNS``: 20 minutes, counted from the process start)
into ``experiments/results/runs_gigpo/<env>-<arm>-s<seed>/``. The arms differ only in the
advantages:

* ``drgrpo``: the presets' estimator (group-centred score, ``seq-mean-token-sum``);
* ``gigpo``: Dr.GRPO's episode part plus the step part (``norm_adv_by_std=False``, verl-agent's
  default ``mean_norm``; the same loss aggregation as ``drgrpo``; gamma 0.95, weight 1);
* ``bilevel_gae``: RAGEN's two-level GAE with a critic (``adv_estimator=gae``,
  ``bi_level_gae=True``, its own defaults).

The table (``experiments/results/gigpo_compare.md``, between its markers) gives per env and
arm: validation success start -> last (mean over seeds, and each seed's), first-turn I(X;Z)
(RAGEN V2's input dependence) first -> last, and the share of turns that found an anchor
group (``rollout/anchored_turns``; ``anchored_later_turns``: after the first turn, which a
group's episodes always share), mean over the run's steps: every arm logs them, so they say
how often the states repeat whatever trains on them.

    python -m experiments.studies.gigpo_compare                              # both envs, 3 arms, seeds 0 1 2
    python -m experiments.studies.gigpo_compare --only frozenlake --seeds 0 --budget 480
    python -m experiments.studies.gigpo_compare --only sokoban --jobs 2 --imitation-seeds 0
    python -m experiments.studies.gigpo_compare --summary-only
"""

from __future__ import annotations

import argparse
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from experiments.common import RESULTS
from experiments.studies.learning_curves import (
    RUNS,
    build_prior,
    imitation_curves,
    launch,
    run_curves,
    run_jobs,
    write_table,
)
from ragen_jax.metrics import read_jsonl

ENVS = ("sokoban", "frozenlake")
ARMS = {
    "drgrpo": ["--config.algorithm.adv_estimator=drgrpo"],
    "gigpo": ["--config.algorithm.adv_estimator=gigpo", "--config.algorithm.norm_adv_by_std=False",
              "--config.algorithm.loss_agg_mode=seq-mean-token-sum"],
    "bilevel_gae": ["--config.algorithm.adv_estimator=gae", "--config.algorithm.bi_level_gae=True"],
}
# Bi-level GAE credits turns inside a trajectory row (the critic's values at turn ends), so it
# does not combine with turn rows: on Sokoban, whose preset trains turn rows of a one-turn
# window, it trains RAGEN's whole transcripts in 4 x 32 rows (the preset's documented
# alternative). The other arms keep the preset's rows.
ARM_ROWS = {("sokoban", "bilevel_gae"): [
    "--config.rollout.window.mode=full", "--config.rollout.window.turns=0",
    "--config.algorithm.sample_unit=trajectory", "--config.actor.ppo_mini_batch_size=32"]}
ANCHORED = ("rollout/anchored_turns", "rollout/anchored_later_turns")
MD = RESULTS / "gigpo_compare.md"


def run_all(envs: list[str], arms: list[str], seeds: list[int], imitation_seeds: list[int],
            budget: float | None, extra: list[str], runs: Path, workers: int) -> None:
    """Every (env, arm, seed) run and (env, imitation, seed) control, ``workers`` at once;
    each env's prior built first."""
    for env in envs:
        build_prior(env, extra, runs)

    def one(job: tuple[str, str, int]) -> None:
        env, arm, seed = job
        if arm == "imitation":
            run_jobs([("imitation", env, seed)], {env: budget or RUNS[env]}, extra, runs, 1)
            return
        out = runs / f"{env}-{arm}-s{seed}"
        shutil.rmtree(out, ignore_errors=True)
        launch(env, out, [*extra, *ARMS[arm], *ARM_ROWS.get((env, arm), []), f"--config.seed={seed}"],
               budget or RUNS[env],
               runs / f"{env}-{arm}-s{seed}.log")

    with ThreadPoolExecutor(workers) as pool:
        # Seed-major: the runs side by side are different arms, so a machine that slows down
        # during the study slows every arm alike.
        jobs = [(e, a, s) for e in envs for s in seeds for a in arms]
        jobs += [(e, "imitation", s) for e in envs for s in imitation_seeds]
        for result in [pool.submit(one, job) for job in jobs]:
            result.result()


def validated(out: Path) -> bool:
    """Whether the run has validated at least once (a run that failed at its start has not)."""
    metrics = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else {}
    return any(k.startswith("val-env/") and k.endswith("/success") for m in metrics.values() for k in m)


def anchored(out: Path) -> list[float]:
    """The run's ``ANCHORED`` metrics, each averaged over its training steps."""
    metrics = read_jsonl(out / "metrics.jsonl")
    return [float(np.mean([m[k] for m in metrics.values() if k in m] or [np.nan]))
            for k in ANCHORED]


def summarize(env: str, seeds: list[int], runs: Path) -> list[str]:
    """The table rows of ``env``, one per arm with runs. Besides each run's last validation
    within the budget, each arm at the last validated step all of its seeds reached, beside
    the first arm (the preset's estimator) at that step: the arms' steps cost differently
    (the critic, whole transcripts) and the machine's speed drifts over a study, so equal
    steps compare the advantages themselves."""
    rows, arms = [], {}
    for arm in ARMS:
        outs = {s: runs / f"{env}-{arm}-s{s}" for s in seeds}
        outs = {s: o for s, o in outs.items() if validated(o)}
        if outs:
            arms[arm] = (outs, {s: run_curves(o) for s, o in outs.items()})
    if not arms:
        return rows
    def at_step(curves: dict, step: int) -> np.ndarray | None:
        """Each seed's success at ``step`` (None when a seed did not validate there)."""
        if not all(step in c["steps"].tolist() for c in curves.values()):
            return None
        return np.array([c["val"][c["steps"].tolist().index(step)] for c in curves.values()])

    base_arm, (_, base) = next(iter(arms.items()))
    for arm, (outs, curves) in arms.items():
        common = max(set.intersection(*(set(c["steps"].tolist()) for c in curves.values())))
        at, ref = at_step(curves, common), at_step(base, common)
        versus = "" if arm == base_arm or ref is None else f"; {base_arm} {ref.mean():.3f}"
        start = np.array([c["val"][0] for c in curves.values()])
        last = np.array([c["val"][-1] for c in curves.values()])
        steps = np.array([c["last_step"] for c in curves.values()])
        wall = np.array([c["wall"][-1] / 60 for c in curves.values()])
        mi = [f"{c['mi'][0]:.2f} -> {c['mi'][-1]:.2f}" for c in curves.values() if len(c["mi"])]
        share = np.array([anchored(o) for o in outs.values()])  # [seeds, 2]
        per_seed = ", ".join(f"s{s}: {c['val'][0]:.3f} -> {c['val'][-1]:.3f} (step {c['steps'][-1]})"
                             for s, c in curves.items())
        rows.append(f"| {env} | {arm} | {len(curves)} | {steps.mean():.0f} | {wall.mean():.1f} "
                    f"| {start.mean():.3f} -> {last.mean():.3f} | {(last - start).mean():+.3f} "
                    f"| {common}: {at.mean():.3f} ({(at - start).mean():+.3f}{versus}) | {per_seed} | {'; '.join(mi) or '-'} | {share[:, 0].mean():.2f} "
                    f"| {share[:, 1].mean():.2f} |")
    ic = imitation_curves(env, seeds, runs)
    if ic:  # supervised steps on the prior's own data for the same wall time: what RL must beat
        start = np.array([c[0]["success"] for c in ic.values()])
        last = np.array([c[-1]["success"] for c in ic.values()])
        per_seed = ", ".join(f"s{s}: {c[0]['success']:.3f} -> {c[-1]['success']:.3f} ({c[-1]['sft_steps']} SFT steps)"
                             for s, c in ic.items())
        rows.append(f"| {env} | imitation control | {len(ic)} | - | - | {start.mean():.3f} -> {last.mean():.3f} "
                    f"| {(last - start).mean():+.3f} | - | {per_seed} | - | - | - |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=ENVS, action="append")
    p.add_argument("--arms", choices=list(ARMS), nargs="+", default=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--imitation-seeds", type=int, nargs="*", default=[],
                   help="also run the imitation control (learning_curves') for these seeds")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per run (default: the preset's, learning_curves.RUNS)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every run")
    p.add_argument("--summary-only", action="store_true", help="the table from existing runs")
    args = p.parse_args()
    envs = args.only or list(ENVS)
    runs = RESULTS / "runs_gigpo"
    runs.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        run_all(envs, args.arms, args.seeds, args.imitation_seeds, args.budget, args.override, runs, args.jobs)
    rows = [row for env in ENVS for row in summarize(env, args.seeds, runs)]
    table = "\n".join([
        "| env | arm | seeds | steps (mean) | wall min (mean) | val success start -> last (mean) "
        "| gain (mean) | at the last step all its seeds reached: success (gain; the first arm's there) | per seed "
        "| first-turn I(X;Z) nats, first -> last | anchored turns (mean over steps) "
        "| anchored turns after the first |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]) + "\n"
    print(table)
    if not MD.is_file():
        MD.write_text("# GiGPO vs Dr.GRPO vs bi-level GAE, tiny presets\n\n"
                      "`python -m experiments.studies.gigpo_compare` (see the script's docstring).\n\n"
                      "<!-- table -->\n<!-- /table -->\n")
    write_table(MD, table)
    print(f"wrote {MD}")


if __name__ == "__main__":
    main()
