"""How many distinct levels each generator yields at the presets' settings, and what holding
validation out costs.

    python -m experiments.studies.level_counts --out experiments/results/level_counts.md

For each env (the presets' parameters): ``--draws`` seeds from a training range, their level
ids (``envs.levels``), the distinct count and the Chao1 estimate of how many levels the
generator has in all (``distinct + f1^2 / (2 f2)``, f1 / f2 the levels seen once / twice: a
lower bound that is tight when most levels were seen); then the presets' 256 validation seeds
(``rollout.val.seed + i``): how many distinct levels they are, and how many of them a training
range of ``--draws`` seeds would replay without holding out (the seed ranges are disjoint, the
levels are not). Last, for the JAX envs, the cost of holding out on device: one jitted reset of
``--batch`` envs with the 256 validation levels held out (Sokoban: their rooms), against the
same reset with none (warm calls, best of ``--repeats``), and the share of rows drawn again.
``experiments.studies.holdout_rooms`` compares Sokoban's two rules.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from experiments.common import report
from ragen_jax.envs import make
from ragen_jax.rollout.env_driver import JaxEnvDriver
from ragen_jax.rollout.host_driver import HostEnvDriver

ENVS = {  # tag: (registry name, the preset's parameters)
    "Sokoban 6x6, 1 box (configs/sokoban.py)": ("sokoban", dict(dim_room=(6, 6), num_boxes=1)),
    "Sokoban 8x8, 2 boxes": ("sokoban", dict(dim_room=(8, 8), num_boxes=2)),
    "FrozenLake 4x4 (configs/frozenlake.py)": ("frozenlake", dict(size=4, p=0.9)),
    "FrozenLake 8x8": ("frozenlake", dict(size=8, p=0.9)),
    "Bandit, train names (configs/bandit.py)": ("bandit", dict(split="train")),
    "Countdown (configs/countdown.py)": ("countdown", dict()),
    "Sudoku 4x4 easy (configs/sudoku.py)": ("sudoku", dict(size=4, difficulty="easy")),
}
VAL_SEED, TRAIN_SEED = 123, 2**30  # the presets' validation seeds; the prior's data range


def driver_for(name: str, params: dict):
    env, env_params = make(name, **params)
    return env, (JaxEnvDriver(env, env_params, 1) if env_params is not None else HostEnvDriver(env))


def chao1(ids: np.ndarray) -> float:
    """Chao1's estimate of the number of distinct values behind the sample ``ids``."""
    _, counts = np.unique(ids, return_counts=True)
    f1, f2 = int((counts == 1).sum()), int((counts == 2).sum())
    return len(counts) + (f1 * f1 / (2 * f2) if f2 else f1 * (f1 - 1) / 2)


def reset_cost(driver: JaxEnvDriver, val_ids: np.ndarray, batch: int, repeats: int) -> tuple[float, float, float]:
    """``(seconds with none held out, seconds with val_ids held out, share of rows redrawn)``."""
    seeds = TRAIN_SEED + 7 + np.arange(batch)

    def best(held_out: bool) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = driver.reset(seeds, held_out=held_out)
            jax.block_until_ready(out.states)
            times.append(time.perf_counter() - t0)
        return min(times)

    driver.hold_out(val_ids)
    driver.reset(seeds, held_out=False)  # compiles (the held-out set's shape is static: twice)
    driver.reset(seeds)
    plain, held = best(False), best(True)
    share = float((driver.reset(seeds).redraws > 0).mean())
    driver.hold_out(np.zeros(0, np.uint64))
    return plain, held, share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=4096)
    ap.add_argument("--host-draws", type=int, default=2048)
    ap.add_argument("--val", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="a substring of the env rows to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rows, costs = [], []
    for tag, (name, params) in ENVS.items():
        if args.only and args.only not in tag:
            continue
        env, driver = driver_for(name, params)
        host = isinstance(driver, HostEnvDriver)
        n = args.host_draws if host else args.draws
        train = driver.reset(TRAIN_SEED + np.arange(n), held_out=False).levels
        val_reset = driver.reset(VAL_SEED + np.arange(args.val), held_out=False)
        val = val_reset.levels
        replayed = np.isin(val, train)
        rows.append(f"| {tag} | {len(np.unique(train))} of {n} | {chao1(train):,.0f} | "
                    f"{len(np.unique(val))} of {args.val} | {int(replayed.sum())} "
                    f"({len(np.unique(val[replayed]))} distinct) |")
        print(rows[-1], flush=True)
        if not host and name != "bandit":
            plain, held, share = reset_cost(driver, val_reset.holdout, args.batch, args.repeats)
            costs.append(f"| {tag} | {args.batch} | {1e3 * plain:.1f} | {1e3 * held:.1f} | "
                         f"{held / plain:.2f}x | {share:.1%} |")
            print(costs[-1], flush=True)
    lines = [
        "# Distinct levels per generator, and the cost of holding validation out",
        "",
        f"`python -m experiments.studies.level_counts --draws {args.draws} --host-draws {args.host_draws} "
        f"--batch {args.batch}` on {jax.devices()[0].device_kind} (jax {jax.__version__}).",
        "",
        f"| env | distinct levels in training seeds | Chao1 estimate of all levels | distinct "
        f"levels in the {args.val} validation seeds | validation seeds whose level those training "
        f"seeds replay (without holding out) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        "Holding the validation levels out on device (a jitted reset that draws a held-out "
        "level, or Sokoban a level in a validation room, again, ``env_driver.held_out_reset``), "
        "best of "
        f"{args.repeats}:",
        "",
        "| env | envs | reset ms, none held out | reset ms, validation held out | ratio | rows drawn again |",
        "|---|---:|---:|---:|---:|---:|",
        *costs,
    ]
    report(lines, args.out)


if __name__ == "__main__":
    main()
