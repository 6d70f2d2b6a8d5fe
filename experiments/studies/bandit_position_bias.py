"""Does a Bandit policy choose by the arms' names or by their order? Reads a run's validation
trajectories (``<run>/trajectories/val_stepNNNNN.jsonl``) and prints, per validation step and
tag: success, the share of answers naming the first-displayed arm, the share of levels whose
high-risk arm is displayed first (the success of "always answer the first arm"), and success
on the levels in each order, and their mean ("order-balanced" success: what the policy would
score on validation levels split evenly between the two orders; "always the first arm" scores
0.5 there, whatever share of the levels shows the high-risk arm first).

A policy that reads the names succeeds in both orders; one that collapsed to a position
succeeds on one order only, and its success equals that order's share of the levels whatever
it learned about the names.

    python -m experiments.studies.bandit_position_bias RUN_DIR [RUN_DIR ...] [--train] [--out FILE.md]
        [--plot FILE.png]

``--train`` adds each run's training steps from ``<run>/metrics.jsonl``: success, format
errors, answer tokens, entropy per token, first-turn I(X;Z), wall seconds of the step and of
its update. ``--plot`` draws, per run, validation success and order-balanced success on Bandit
and BanditTest, and training success, against the step.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ragen_jax.envs.bandit import ALL_PAIRS
from ragen_jax.metrics import read_jsonl
from ragen_jax.plots import series

_ARMS = re.compile(r"The arms are (\w+) and (\w+)\.")
_HIGH = {hi for _, hi in ALL_PAIRS}  # each pair is (low-risk, high-risk)


def episode_row(trajectory: dict) -> tuple[str, bool, bool | None, bool] | None:
    """(tag, success, answered the first arm (None: neither name), high-risk arm first) of one
    validation episode; None for an episode without a turn."""
    turns = trajectory.get("turns") or []
    if not turns:
        return None
    m = _ARMS.search(turns[0].get("state", ""))
    if m is None:
        return None
    first, second = m.group(1), m.group(2)
    # The arm the env pulled: an answer may list both names ("A || B"; one action a turn
    # executes the first), so the executed action, not the answer text, says which.
    executed = turns[0].get("executed") or [turns[0].get("answer", "")]
    answer = str(executed[0]).strip().lower()
    picked = True if answer == first.lower() else False if answer == second.lower() else None
    return trajectory.get("tag", ""), bool(trajectory.get("success")), picked, first in _HIGH


def summarise(path: Path) -> dict[str, dict[str, float]]:
    """Per tag: episodes, success, first-arm answers, high-risk-first levels, success by order."""
    rows = [r for line in path.read_text().splitlines() if line.strip()
            if (r := episode_row(json.loads(line))) is not None]
    out = {}
    for tag in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == tag]
        hi_first = [r for r in mine if r[3]]
        lo_first = [r for r in mine if not r[3]]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        out[tag] = {
            "episodes": len(mine),
            "success": mean([r[1] for r in mine]),
            "first_arm": mean([r[2] is True for r in mine]),
            "high_first": mean([r[3] for r in mine]),
            "success_high_first": mean([r[1] for r in hi_first]),
            "success_low_first": mean([r[1] for r in lo_first]),
        }
        out[tag]["balanced"] = (out[tag]["success_high_first"] + out[tag]["success_low_first"]) / 2
    return out


def validation(run: Path) -> dict[int, dict[str, dict[str, float]]]:
    """``{step: summarise(...)}`` over a run's validation trajectories, in step order."""
    return {int(p.stem.removeprefix("val_step")): summarise(p)
            for p in sorted((run / "trajectories").glob("val_step*.jsonl"))}


def table(runs: list[Path]) -> str:
    lines = ["| run | step | tag | episodes | success | answers naming the first arm | levels with "
             "the high-risk arm first | success when it is first | when it is second | order-balanced success |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for step, tags in validation(run).items():
            for tag, s in tags.items():
                lines.append(f"| {run.name} | {step} | {tag} | {s['episodes']} | {s['success']:.3f} | "
                             f"{s['first_arm']:.3f} | {s['high_first']:.3f} | "
                             f"{s['success_high_first']:.3f} | {s['success_low_first']:.3f} | "
                             f"{s['balanced']:.3f} |")
    return "\n".join(lines)


TRAIN_COLUMNS = (("success", "train/Bandit/success", "{:.3f}"),
                 ("format errors", "train/Bandit/format_error_rate", "{:.3f}"),
                 ("answer tokens", "train/Bandit/response_length", "{:.1f}"),
                 ("entropy", "actor/entropy", "{:.2f}"),
                 ("first-turn I(X;Z)", "collapse_first_turn_sample/mi_estimate", "{:.3f}"),
                 ("step s", "timing_s/step", "{:.0f}"),
                 ("update s", "timing_s/update", "{:.0f}"))


def train_table(run: Path) -> str:
    """One row per training step of a run's ``metrics.jsonl`` (a resumed run repeats the steps
    after its checkpoint: the later records win)."""
    steps = {step: m for step, m in read_jsonl(run / "metrics.jsonl").items()
             if "train/Bandit/success" in m}
    lines = [f"{run.name}, training steps:", "",
             "| step | " + " | ".join(name for name, _, _ in TRAIN_COLUMNS) + " |",
             "|---:|" + "---:|" * len(TRAIN_COLUMNS)]
    for step in sorted(steps):
        cells = [fmt.format(steps[step][key]) if key in steps[step] else ""
                 for _, key, fmt in TRAIN_COLUMNS]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[Path], out: Path) -> None:
    """Three panels against the step: Bandit validation, BanditTest validation (success solid,
    order-balanced success dashed) and training success; one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for i, run in enumerate(runs):
        colour = f"C{i}"
        val = validation(run)
        for ax, tag in zip(axes[:2], ("Bandit", "BanditTest"), strict=True):
            steps = [s for s in sorted(val) if tag in val[s]]
            ax.plot(steps, [val[s][tag]["success"] for s in steps], "o-", color=colour, label=run.name)
            ax.plot(steps, [val[s][tag]["balanced"] for s in steps], "s--", color=colour, alpha=0.6)
            ax.set_title(f"validation {tag} (solid: success, dashed: order-balanced)", fontsize=9)
        axes[2].plot(*series(read_jsonl(run / "metrics.jsonl"), "train/Bandit/success"), "-",
                     color=colour, label=run.name)
        axes[2].set_title("training success (each step's episodes)", fontsize=9)
    for ax in axes:
        ax.axhline(0.5, color="grey", lw=0.5)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("success")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--train", action="store_true", help="add each run's training steps")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to this image")
    args = parser.parse_args()
    text = table(args.runs)
    if args.train:
        text += "\n\n" + "\n\n".join(train_table(run) for run in args.runs)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(args.runs, args.plot)


if __name__ == "__main__":
    main()
