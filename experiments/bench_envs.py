"""Environment throughput and Sokoban level difficulty, against plain-Python baselines.

Measures, on this machine and in one run:
- env steps/s of each ragen_jax env for 1, 64, 1024, 4096 envs (vmapped ``step_env`` under
  ``lax.scan``, jitted), and with gymnax's auto-resetting ``step``;
- level resets/s (``vmap(reset)``) at the same sizes;
- the same for plain-Python baselines: the reference Sokoban of the tests, gym-sokoban's
  ``SokobanEnv.step`` and ``generate_room``, and a RAGEN-style generator
  (``ragen_style_generator.py``);
- the distribution of optimal solution lengths (BFS) of our levels next to gym-sokoban's and
  the RAGEN-style generator's, at the same settings.

Writes ``experiments/results/bench_envs.md`` and ``bench_envs_solution_lengths.png`` and prints
the tables. ``--quick`` runs smaller sizes (a smoke test, a minute or two).

    pip install -e ".[bench]" && python experiments/bench_envs.py
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
warnings.filterwarnings("ignore")

from ragen_jax.envs import make  # noqa: E402
from ragen_jax.envs.sokoban_solver import solve  # noqa: E402
from tests.envs.test_sokoban import ReferenceSokoban  # noqa: E402

RESULTS = ROOT / "experiments" / "results"


def _time(fn, *args, repeats: int = 3) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def jax_rates(name: str, kwargs: dict, n_envs: int, n_steps: int) -> dict[str, float]:
    """Steps/s (step_env and auto-resetting step) and resets/s for ``n_envs`` envs."""
    env, params = make(name, **kwargs)
    keys = jax.random.split(jax.random.key(0), n_envs)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    _, state = reset(keys, params)

    def rollout(step_fn, n_steps=n_steps):
        def run(state, key):
            def body(state, key):
                k_act, k_step = jax.random.split(key)
                actions = jax.random.randint(k_act, (n_envs,), 0, env.num_actions)
                out = jax.vmap(step_fn, in_axes=(0, 0, 0, None))(
                    jax.random.split(k_step, n_envs), state, actions, params)
                return out[1], out[2].sum()
            return jax.lax.scan(body, state, jax.random.split(key, n_steps))
        return jax.jit(run)

    t_step = _time(rollout(env.step_env), state, jax.random.key(1))
    auto_steps = max(5, n_steps // 20)  # gymnax's step generates a level every step: slow
    t_auto = _time(rollout(env.step, auto_steps), state, jax.random.key(1), repeats=1)
    t_reset = _time(reset, keys, params)
    return {"steps/s": n_envs * n_steps / t_step, "auto-reset steps/s": n_envs * auto_steps / t_auto,
            "resets/s": n_envs / t_reset}


def python_sokoban_rates(n_steps: int = 20000) -> dict[str, float]:
    from gym_sokoban.envs import room_utils
    from gym_sokoban.envs.sokoban_env import SokobanEnv

    env, params = make("sokoban")
    _, state = env.reset(jax.random.key(0), params)
    codes = np.asarray(env.get_obs(state))
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, n_steps)
    ref = ReferenceSokoban(codes, max_steps=10**9)
    start = time.perf_counter()
    for a in actions:
        ref.step(int(a))
    ref_rate = n_steps / (time.perf_counter() - start)

    gym_env = SokobanEnv(dim_room=(6, 6), num_boxes=1, max_steps=10**9)
    random.seed(0)
    np.random.seed(0)  # noqa: NPY002 (gym-sokoban draws from the global RNG)
    gym_env.reset()
    start = time.perf_counter()
    for a in actions:  # gym-sokoban's step minus its image rendering
        gym_env.num_env_steps += 1
        gym_env._push(int(a) + 1)
        gym_env._calc_reward()
        gym_env._check_if_done()
    gym_rate = n_steps / (time.perf_counter() - start)

    n_levels, start, made = 0, time.perf_counter(), 0
    while time.perf_counter() - start < 5.0:
        random.seed(n_levels)
        np.random.seed(n_levels)  # noqa: NPY002
        n_levels += 1
        try:
            room_utils.generate_room(dim=(6, 6), num_steps=20, num_boxes=1)
            made += 1
        except (RuntimeError, RuntimeWarning):
            pass
    gym_gen = made / (time.perf_counter() - start)
    return {"reference steps/s": ref_rate, "gym-sokoban steps/s": gym_rate,
            "gym-sokoban levels/s": gym_gen}


def solution_lengths(source: str, dim, num_boxes: int, search_depth: int, n: int) -> list[int]:
    """Optimal solution lengths of ``n`` levels from ``source``: ours, gym-sokoban, ragen-style."""
    levels = []
    if source == "ragen_jax":
        env, params = make("sokoban", dim_room=dim, num_boxes=num_boxes, search_depth=search_depth)
        _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(
            jax.random.split(jax.random.key(123), n), params)
        host = jax.device_get(states)
        levels = [(host.room_fixed[i], host.boxes[i], host.player[i]) for i in range(n)]
    elif source == "gym-sokoban":
        from gym_sokoban.envs import room_utils
        seed = 0
        while len(levels) < n:
            random.seed(seed)
            np.random.seed(seed)  # noqa: NPY002
            seed += 1
            try:
                fixed, state, _ = room_utils.generate_room(
                    dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes)
            except (RuntimeError, RuntimeWarning):
                continue
            levels.append((fixed, np.isin(state, (3, 4)), np.argwhere(state == 5)[0]))
    else:
        import ragen_style_generator
        seed = 0
        while len(levels) < n:
            level = ragen_style_generator.generate(dim, num_boxes, search_depth, seed)
            seed += 1
            if level is not None:
                levels.append(level)
    return [len(solve(*level)) for level in levels]


def ragen_style_rate(dim, num_boxes, search_depth, seconds: float = 5.0) -> float:
    import ragen_style_generator
    start, seed, made = time.perf_counter(), 0, 0
    while time.perf_counter() - start < seconds:
        made += ragen_style_generator.generate(dim, num_boxes, search_depth, seed) is not None
        seed += 1
    return made / (time.perf_counter() - start)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = parser.parse_args()
    sizes = [1, 64] if args.quick else [1, 64, 1024, 4096]
    n_levels = 30 if args.quick else 300
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [f"# bench_envs ({jax.devices()[0].device_kind}, {os.cpu_count()} cores, "
             f"jax {jax.__version__})", ""]

    lines += ["## Throughput (vmapped, jitted, `lax.scan`; random actions)", "",
              "| env | envs | steps/s (`step_env`) | steps/s (gymnax `step`, auto-reset) | resets/s |",
              "|---|---|---|---|---|"]
    envs = [("sokoban", {}), ("sokoban", {"dim_room": (8, 8), "num_boxes": 2}),
            ("frozenlake", {}), ("bandit", {})]
    for name, kwargs in envs:
        label = name + (" 8x8/2" if kwargs else "")
        for n in sizes:
            rates = jax_rates(name, kwargs, n, 1000 if n == 1 else 100)
            lines.append(f"| {label} | {n} | {_fmt(rates['steps/s'])} | "
                         f"{_fmt(rates['auto-reset steps/s'])} | {_fmt(rates['resets/s'])} |")
            print(lines[-1], flush=True)

    py = python_sokoban_rates(2000 if args.quick else 20000)
    ours = jax_rates("sokoban", {}, sizes[-1], 100)
    rs_6 = ragen_style_rate((6, 6), 1, 300, 2.0 if args.quick else 5.0)
    lines += ["", "## Sokoban 6x6, 1 box: ours vs plain Python", "",
              f"| what | plain-Python rate | ours (JAX, {sizes[-1]} envs) | ratio |", "|---|---|---|---|",
              f"| steps/s vs the tests' reference | {_fmt(py['reference steps/s'])} | "
              f"{_fmt(ours['steps/s'])} | {ours['steps/s'] / py['reference steps/s']:.0f}x |",
              f"| steps/s vs gym-sokoban `step` dynamics (no rendering) | {_fmt(py['gym-sokoban steps/s'])} | "
              f"{_fmt(ours['steps/s'])} | {ours['steps/s'] / py['gym-sokoban steps/s']:.0f}x |",
              f"| levels/s vs gym-sokoban `generate_room` | {_fmt(py['gym-sokoban levels/s'])} | "
              f"{_fmt(ours['resets/s'])} | {ours['resets/s'] / py['gym-sokoban levels/s']:.0f}x |",
              f"| levels/s vs RAGEN-style generator (depth 300) | {_fmt(rs_6)} | "
              f"{_fmt(ours['resets/s'])} | {ours['resets/s'] / rs_6:.0f}x |"]
    print("\n".join(lines[-7:]), flush=True)

    lines += ["", f"## Optimal solution lengths (BFS), {n_levels} levels each", "",
              "| setting | generator | mean | p10 | p25 | median | p75 | p90 |",
              "|---|---|---|---|---|---|---|---|"]
    settings = [((6, 6), 1, 300, ("ragen_jax", "ragen-style", "gym-sokoban")),
                ((8, 8), 2, 300, ("ragen_jax", "ragen-style", "gym-sokoban")),
                ((8, 8), 2, 10, ("ragen_jax", "ragen-style"))]
    all_lengths = {}
    for dim, boxes, depth, sources in settings:
        for source in sources:
            lengths = solution_lengths(source, dim, boxes, depth, n_levels)
            setting = f"{dim[0]}x{dim[1]}, {boxes} box(es), search_depth {depth}"
            all_lengths[(setting, source)] = lengths
            q = np.percentile(lengths, [10, 25, 50, 75, 90])
            lines.append(f"| {setting} | {source} | {np.mean(lengths):.2f} | "
                         + " | ".join(f"{v:.0f}" for v in q) + " |")
            print(lines[-1], flush=True)

    (RESULTS / "bench_envs.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = [s for s in dict.fromkeys(k[0] for k in all_lengths)]
        fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5))
        for ax, setting in zip(axes, names, strict=True):
            for (s, source), lengths in all_lengths.items():
                if s == setting:
                    ax.hist(lengths, bins=range(0, max(lengths) + 2), alpha=0.5, label=source, density=True)
            ax.set_title(setting, fontsize=9)
            ax.set_xlabel("optimal solution length (steps)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "bench_envs_solution_lengths.png", dpi=100)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {RESULTS / 'bench_envs.md'}")


if __name__ == "__main__":
    main()
