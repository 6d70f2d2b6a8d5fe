"""What holding Sokoban's validation out by room (and grid-text FrozenLake's by map) costs at
the presets' sizes, against holding it out by level.

    python -m experiments.studies.holdout_rooms --out experiments/results/holdout_rooms.md

For each setting (the tiny preset, ``configs/sokoban.py``: 6x6 with one box; the same preset at
7x7 and 8x8 with two boxes; FrozenLake 4x4 in grid text, which holds out its map without the
start, on the seeds of its tiny preset): the preset's validation seeds (how many distinct levels and rooms
they are); the training seeds the preset resets (the warm start's two collections,
``warmstart.data_seeds``: the mixture's groups of one episode per action and the single-turn
rows' own levels, and every RL step's groups, ``rollout.agent.train_seeds``), and how many of
them each rule draws again: holding out by level (their level is a validation level, the rule
before) or by room (their room is a validation room, ``Sokoban.holdout_fields``). Last, one
jitted reset of ``--batch`` envs (the prior's mixture collection resets 1,024 x 4) with nothing
held out, held out by level and held out by room (warm calls, best of ``--repeats``).
"""

from __future__ import annotations

import argparse
import copy

import jax
import numpy as np

from experiments.common import ROOT, report, timed
from ragen_jax.config.loading import from_config_dict, load_config
from ragen_jax.config.resolve import resolve
from ragen_jax.envs import make
from ragen_jax.rollout.agent import train_seeds
from ragen_jax.rollout.env_driver import JaxEnvDriver
from ragen_jax.warmstart import data_seeds

SETTINGS = {  # tag: the config and its overrides of the tiny preset
    "6x6, 1 box (the tiny preset)": ("sokoban", []),
    "7x7, 2 boxes": ("sokoban", ["--config.env.params.dim_room=(7, 7)", "--config.env.params.num_boxes=2"]),
    "8x8, 2 boxes": ("sokoban", ["--config.env.params.dim_room=(8, 8)", "--config.env.params.num_boxes=2"]),
    "FrozenLake 4x4, grid text (map)": ("frozenlake", ["--config.env.params.observation_format=grid"]),
}


def by_level(env):
    """``env`` held out by its level, the rule before rooms (a copy: resets are compiled and
    cached per env object)."""
    twin = copy.copy(env)
    twin.holdout_fields = twin.level
    return twin


def streams(run) -> dict[str, np.ndarray]:
    """The group seeds the preset's training resets: the warm start's two collections
    (``WarmStart._data``: the single-turn rows' own episodes, where the preset has them, use
    the next seed, one a level) and the RL steps'."""
    w, plan = run.warmstart, resolve(run)
    seed = w.seed_for(run.seed)
    out = {"prior, mixture episodes": data_seeds(w.episodes, 4, seed)}  # a group per action
    if w.own_turn_data and w.turns.episodes:
        out["prior, single-turn rows"] = data_seeds(w.turns.episodes, 1, seed + 1)
    out[f"RL, {run.trainer.total_steps} steps"] = np.concatenate(
        [train_seeds(plan.rollout, i) for i in range(run.trainer.total_steps)])
    return out


def in_chunks(driver: JaxEnvDriver, seeds: np.ndarray, size: int, held_out: bool):
    """``(level ids, held-out ids, redraws)`` of ``seeds``' resets, ``size`` at a time (one
    compiled program; the last chunk filled up with the first seeds, then cut)."""
    padded = np.resize(seeds, -(-len(seeds) // size) * size)
    outs = [driver.reset(c, held_out=held_out) for c in padded.reshape(-1, size)]
    return tuple(np.concatenate([getattr(o, k) for o in outs])[:len(seeds)]
                 for k in ("levels", "holdout", "redraws"))


def reset_times(rooms: JaxEnvDriver, levels: JaxEnvDriver, batch: int, repeats: int
                ) -> tuple[list[float], list[float]]:
    """Seconds of one warm reset of ``batch`` envs with nothing held out, held out by level
    and by room (best of ``repeats``), and the share of rows each rule draws again."""
    seeds = 2**30 + 7 + np.arange(batch)  # the warm start's range, off its first groups
    times = []
    for driver, held_out in ((rooms, False), (levels, True), (rooms, True)):
        def reset(driver=driver, held_out=held_out):
            jax.block_until_ready(driver.reset(seeds, held_out=held_out).states)

        reset()  # compiles
        times.append(timed(reset, repeats))
    return times, [float((d.reset(seeds).redraws > 0).mean()) for d in (levels, rooms)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="a substring of the settings to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    counts, costs = [], []
    for tag, (config, overrides) in SETTINGS.items():
        if args.only and args.only not in tag:
            continue
        run = from_config_dict(load_config(["--config", str(ROOT / f"configs/{config}.py"), *overrides]))
        env, params = make(run.env.name, **run.env.params)
        rooms, levels = JaxEnvDriver(env, params, 1), JaxEnvDriver(by_level(env), params, 1)
        val_seeds = run.rollout.val.seed + np.arange(run.rollout.val.env_groups)
        val_levels, val_rooms, _ = in_chunks(rooms, val_seeds, args.batch, False)
        rooms.hold_out(val_rooms)
        levels.hold_out(val_levels)
        for what, seeds in streams(run).items():
            plain_levels, plain_rooms, _ = in_chunks(rooms, seeds, args.batch, False)
            by_room = np.isin(plain_rooms, val_rooms)
            by_lvl = np.isin(plain_levels, val_levels)
            _, held_rooms, redraws = in_chunks(rooms, seeds, args.batch, True)
            # The room rule redraws exactly the seeds whose room is a validation room, and
            # leaves none in one.
            assert np.array_equal(redraws > 0, by_room) and not np.isin(held_rooms, val_rooms).any()
            counts.append(
                f"| {tag} | {len(np.unique(val_levels))} / {len(np.unique(val_rooms))} | {what} | "
                f"{len(seeds):,} | {int(by_lvl.sum())} ({by_lvl.mean():.1%}) | "
                f"{int(by_room.sum())} ({by_room.mean():.1%}) | {int(redraws.sum()):,} |")
            print(counts[-1], flush=True)
        times, share = reset_times(rooms, levels, args.batch, args.repeats)
        costs.append(f"| {tag} | {args.batch} | {1e3 * times[0]:.0f} | {1e3 * times[1]:.0f} "
                     f"({share[0]:.1%} redrawn) | {1e3 * times[2]:.0f} ({share[1]:.1%} redrawn) | "
                     f"{times[2] / times[1]:.2f}x |")
        print(costs[-1], flush=True)

    lines = [
        "# Holding Sokoban's validation out by room (FrozenLake's grid text by map): what it costs",
        "",
        f"`python -m experiments.studies.holdout_rooms --batch {args.batch} --repeats {args.repeats}` "
        f"on {jax.devices()[0].device_kind} (jax {jax.__version__}).",
        "",
        "Training seeds each rule draws again (the seed's level is a validation level / its room "
        "(FrozenLake: map) is a validation room), over the seeds the tiny preset's training resets, "
        "a group once:",
        "",
        "| setting | validation levels / rooms (256 seeds) | stream | seeds | redrawn by level | "
        "redrawn by room | draws again by room, all |",
        "|---|---:|---|---:|---:|---:|---:|",
        *counts,
        "",
        f"One jitted reset (`env_driver.held_out_reset`), warm, best of {args.repeats}, in ms:",
        "",
        "| setting | envs | none held out | held out by level | held out by room | room / level |",
        "|---|---:|---:|---:|---:|---:|",
        *costs,
    ]
    report(lines, args.out)


if __name__ == "__main__":
    main()
