"""Environment throughput and Sokoban level difficulty, against plain-Python baselines.

Measures, on this machine and in one run:
- env steps/s of each ragen_jax env for 1, 64, 1024, 4096 envs (vmapped ``step_env`` under
  ``lax.scan``, jitted), and with gymnax's auto-resetting ``step``;
- level resets/s (``vmap(reset)``) at the same sizes;
- the same for plain-Python baselines: the reference Sokoban of the tests, gym-sokoban's
  ``SokobanEnv.step`` and ``generate_room``, and a RAGEN-style generator
  (``ragen_style_generator.py``);
- the distribution of optimal solution lengths (BFS) of our levels next to gym-sokoban's and
  the RAGEN-style generator's, at 6x6/1, 8x8/2 and 10x10/3 boxes and search depths 10 and 300,
  with each generator's levels/s (``sokoban_difficulty_rows``);
- host envs (``envs.host``: Countdown, Sudoku) against the JAX envs in episodes/s, called
  directly and through the rollout's env drivers, and the share of a tiny rollout's wall time
  spent in the env calls (``host_env_rows``).

Writes ``experiments/results/bench_envs.md`` and ``bench_envs_solution_lengths.png`` and prints
the tables. ``--quick`` runs smaller sizes (a smoke test, a minute or two); ``--host-only``
runs only the host-env section and writes ``experiments/results/bench_envs_host.md``;
``--sokoban-only`` only the Sokoban difficulty section (``bench_envs_sokoban.md``, about ten
minutes on two cores with the default 300 levels per cell; ``--levels`` sets that number;
``--cell 10x10/3/300`` runs one cell and only prints its row).

    pip install -e ".[bench]" && python -m experiments.benchmarks.bench_envs
"""

from __future__ import annotations

import argparse
import os
import random
import time
import warnings

import jax
import numpy as np

from experiments.common import RESULTS, ROOT
from ragen_jax.envs import make
from ragen_jax.envs.sokoban.solver import solve
from tests.envs.test_sokoban import ReferenceSokoban


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


def generate_levels(source: str, dim, num_boxes: int, search_depth: int, n: int):
    """``n`` levels from ``source`` (ours, gym-sokoban, ragen-style) as (room_fixed, boxes,
    player), and the levels/s of making them (ours: a ``vmap``ped, jitted reset of the whole
    batch, compile excluded; the others: a plain loop, failed seeds included in the time)."""
    levels = []
    if source == "ragen_jax":
        env, params = make("sokoban", dim_room=dim, num_boxes=num_boxes, search_depth=search_depth)
        reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
        keys = jax.random.split(jax.random.key(123), n)
        batch = max(n, 512)  # the rate of a batch of at least 512 levels
        seconds = _time(reset, jax.random.split(jax.random.key(7), batch), params, repeats=2)
        _, states = reset(keys, params)
        host = jax.device_get(states)
        return [(host.room_fixed[i], host.boxes[i], host.player[i]) for i in range(n)], batch / seconds
    start = time.perf_counter()
    if source == "gym-sokoban":  # always searches to depth 300
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
        from experiments.benchmarks import ragen_style_generator
        seed = 0
        while len(levels) < n:
            level = ragen_style_generator.generate(dim, num_boxes, search_depth, seed)
            seed += 1
            if level is not None:
                levels.append(level)
    return levels, n / (time.perf_counter() - start)


# Sokoban difficulty parity: RAGEN's LargerSokoban-like settings with 1-3 boxes, at
# RAGEN's two search depths. gym-sokoban's generate_room always searches to depth 300; at 10x10
# with 3 boxes it makes about one level a second, so it is timed on GYM_LEVELS_3_BOXES levels
# (and their solution lengths are not measured).
GYM_LEVELS_3_BOXES = 30
DIFFICULTY_SETTINGS = [((6, 6), 1), ((8, 8), 2), ((10, 10), 3)]
DIFFICULTY_DEPTHS = (10, 300)


def sokoban_difficulty_rows(n_levels: int, gym_levels: int, cell: str | None = None
                            ) -> tuple[list[str], dict]:
    """Per setting and depth: BFS-optimal solution lengths of ``n_levels`` of our levels and of
    the RAGEN-style generator's (and gym-sokoban's at depth 300, ``gym_levels`` of them), and
    levels/s of each generator. ``cell`` (e.g. ``"10x10/3/300"``) runs that one cell only."""
    lines = [f"## Sokoban difficulty: BFS-optimal solution lengths ({n_levels} levels per cell) "
             "and generation speed", "",
             "Ours: the on-device reverse search (`vmap`ped reset of the whole batch, jitted, "
             "compile excluded). RAGEN-style: `experiments/benchmarks/ragen_style_generator.py` (RAGEN's "
             "reverse DFS at the given depth). gym-sokoban: `room_utils.generate_room` (depth "
             f"300 whatever the setting; {gym_levels} levels, {GYM_LEVELS_3_BOXES} with 3 boxes, "
             "lengths not measured). *Within 10%*: our median and p90 "
             "each within 10% of the RAGEN-style generator's. Speeds include failed seeds for the "
             "plain-Python generators.", "",
             "| setting | ours median / p90 (mean) | RAGEN-style median / p90 (mean) | "
             "gym-sokoban median / p90 (mean) | within 10% | ours levels/s | RAGEN-style levels/s "
             "| gym `generate_room` levels/s | ours / `generate_room` | ours / RAGEN-style |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    all_lengths = {}
    gym_rates = {}
    for dim, boxes in DIFFICULTY_SETTINGS:
        if cell and not cell.startswith(f"{dim[0]}x{dim[1]}/{boxes}/"):
            continue
        gym_n = gym_levels if boxes < 3 else GYM_LEVELS_3_BOXES
        gym_levels_made, gym_rates[dim] = generate_levels("gym-sokoban", dim, boxes, 300, gym_n)
        gym_lengths = [len(solve(*level)) for level in gym_levels_made] if boxes < 3 else None
        for depth in DIFFICULTY_DEPTHS:
            if cell and cell != f"{dim[0]}x{dim[1]}/{boxes}/{depth}":
                continue
            setting = f"{dim[0]}x{dim[1]}, {boxes} box(es), search_depth {depth}"
            stats, rates = {}, {}
            for source in ("ragen_jax", "ragen-style"):
                levels, rates[source] = generate_levels(source, dim, boxes, depth, n_levels)
                lengths = [len(solve(*level)) for level in levels]
                all_lengths[(setting, source)] = lengths
                stats[source] = (np.median(lengths), np.percentile(lengths, 90), np.mean(lengths))
            if depth == 300 and gym_lengths is not None:
                all_lengths[(setting, "gym-sokoban")] = gym_lengths
            ours, ref = stats["ragen_jax"], stats["ragen-style"]
            within = all(abs(o - r) <= 0.1 * r for o, r in zip(ours[:2], ref[:2], strict=True))
            gym = (f"{np.median(gym_lengths):.0f} / {np.percentile(gym_lengths, 90):.0f} "
                   f"({np.mean(gym_lengths):.2f})" if depth == 300 and gym_lengths else "-")
            lines.append(
                f"| {setting} | {ours[0]:.0f} / {ours[1]:.1f} ({ours[2]:.2f}) | "
                f"{ref[0]:.0f} / {ref[1]:.1f} ({ref[2]:.2f}) | {gym} | {'yes' if within else 'NO'} | "
                f"{_fmt(rates['ragen_jax'])} | {_fmt(rates['ragen-style'])} | {_fmt(gym_rates[dim])} | "
                f"{rates['ragen_jax'] / gym_rates[dim]:.0f}x | "
                f"{rates['ragen_jax'] / rates['ragen-style']:.1f}x |")
            print(lines[-1], flush=True)
    return lines, all_lengths


def ragen_style_rate(dim, num_boxes, search_depth, seconds: float = 5.0) -> float:
    from experiments.benchmarks import ragen_style_generator
    start, seed, made = time.perf_counter(), 0, 0
    while time.perf_counter() - start < seconds:
        made += ragen_style_generator.generate(dim, num_boxes, search_depth, seed) is not None
        seed += 1
    return made / (time.perf_counter() - start)


# (registered name, make kwargs, label, actions per episode: RAGEN's max_actions_per_traj)
HOST_ENVS = [("countdown", {}, "Countdown", 1),
             ("sudoku", {"size": 4, "difficulty": "easy"}, "SimpleSudoku 4x4", 20),
             ("sudoku", {"size": 9, "difficulty": "medium"}, "MediumSudoku 9x9", 30)]
JAX_ENVS = [("bandit", {}, "Bandit", 1), ("frozenlake", {}, "FrozenLake", 10),
            ("sokoban", {}, "Sokoban 6x6/1", 10)]


def host_direct_rate(name: str, kwargs: dict, actions: int, seconds: float) -> tuple[float, float]:
    """``(episodes/s, resets/s)`` of one instance in a plain loop: reset, then random
    well-formed actions (``random_action``) until done or ``actions`` are played."""
    family, _ = make(name, **kwargs)
    env, rng = family.factory(), np.random.default_rng(0)
    start, episodes, reset_time = time.perf_counter(), 0, 0.0
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        env.reset(episodes)
        reset_time += time.perf_counter() - t0
        for _ in range(actions):
            if env.step(env.random_action(rng))[2]:
                break
        episodes += 1
    return episodes / (time.perf_counter() - start), episodes / reset_time


def driver_rate(name: str, kwargs: dict, actions: int, n_envs: int, per_turn: int = 2,
                repeats: int = 3) -> float:
    """Episodes/s of ``n_envs`` envs through the rollout's env driver: a batched reset, then
    turns of ``per_turn`` random actions (random valid names for a JAX env, ``random_action``
    for a host env) until every episode is done or has played ``actions``."""
    from ragen_jax.envs.host.family import HostEnvFamily
    from ragen_jax.rollout.agent import make_driver
    from ragen_jax.rollout.env_driver import TurnActions, row_state

    env, params = make(name, **kwargs)
    driver = make_driver(env, params, per_turn)
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), n_envs)
    host_env = isinstance(env, HostEnvFamily)

    def episode_batch(seed0: int) -> None:
        states, host = driver.reset(seed0 + np.arange(n_envs))[:2]
        live, played = set(range(n_envs)), np.zeros(n_envs, int)
        while live:
            turn = {}
            for b in live:
                k = min(per_turn, actions - played[b])
                if host_env:
                    texts = [env.random_action(row_state(host, b), rng) for _ in range(k)]
                    turn[b] = TurnActions(list(range(k)), texts)
                else:
                    names = env.action_names_for(row_state(host, b))
                    ids = [int(a) for a in rng.integers(len(names), size=k)]
                    turn[b] = TurnActions(ids, [names[a] for a in ids])
            states, host, out = driver.step(states, turn, keys)
            played += out.executed
            live = {b for b in live if not (out.terminated[b] or out.truncated[b] or b in out.errors
                                            or played[b] >= actions)}

    episode_batch(0)  # compiles (JAX) / builds the instances (host)
    best = min(_wall(episode_batch, 1000 * (r + 1)) for r in range(repeats))
    return n_envs / best


def _wall(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def rollout_env_share(name: str, kwargs: dict, config: str, policy_kind: str) -> dict[str, float]:
    """One tiny-preset training rollout (``env_groups x group_size`` episodes, the preset's
    budgets) after a warm-up: wall time and the share spent in env calls (``timing["env_s"]``,
    reset and steps). ``policy_kind``: ``model`` (the tiny random-weight model through the
    sampler: its answers rarely parse, so envs are mostly reset only) or ``random`` (random
    well-formed answers, no model: every turn steps the env; an upper bound on the share)."""
    from ragen_jax.config.loading import from_config_dict, load_config
    from ragen_jax.config.resolve import resolve
    from ragen_jax.models import compute_copy
    from ragen_jax.policy import build_actor, load_tokenizer
    from ragen_jax.rollout import Sampler
    from ragen_jax.rollout.agent import AgentRollout, train_seeds
    from ragen_jax.rollout.scripted import RandomActionPolicy

    run = from_config_dict(load_config(["--config", str(ROOT / "configs" / config)]))
    cfg = resolve(run).rollout
    env, params = make(name, **kwargs)
    tok = load_tokenizer(run.model)
    rollout = AgentRollout(env, params, tok, cfg)
    if policy_kind == "model":
        policy = Sampler.for_rollout(compute_copy(build_actor(run.model, 0)), cfg,
                                     pad_id=tok.pad_token_id)
    else:
        policy = RandomActionPolicy(env, params, tok, cfg.context, seed=0)
    seeds = train_seeds(cfg, 0)
    rollout.collect(policy, seeds, jax.random.key(0))  # compiles
    batch = rollout.collect(policy, train_seeds(cfg, 1), jax.random.key(1))
    t = batch.timing
    return {"episodes": len(batch.trajectories), "total_s": t["total_s"], "env_s": t["env_s"],
            "share": t["env_s"] / t["total_s"], "turns": float(np.mean(batch.num_turns))}


def host_env_rows(quick: bool) -> list[str]:
    """The host-env section: episodes/s direct and through the drivers, and rollout shares."""
    seconds = 1.0 if quick else 5.0
    sizes = [64] if quick else [64, 1024]
    lines = ["## Host envs (Python) vs JAX envs: episodes/s", "",
             "An episode: a reset, then random well-formed actions until done or RAGEN's "
             "`max_actions_per_traj`. *Direct*: one instance in a plain Python loop. *Driver*: "
             "the rollout's env driver (`rollout.env_driver`) on a batch, 2 actions a turn: "
             "JAX envs `vmap`ped and jitted, host envs one instance per row on the driver's "
             "worker thread (timeouts armed; Countdown and Sudoku are not `parallel_friendly`).",
             "", "| env | kind | actions/episode | direct episodes/s | resets/s | "
             + " | ".join(f"driver episodes/s ({n} envs)" for n in sizes) + " |",
             "|---|---|---|---|---|" + "---|" * len(sizes)]
    for name, kwargs, label, actions in HOST_ENVS:
        direct, resets = host_direct_rate(name, kwargs, actions, seconds)
        driven = [driver_rate(name, kwargs, actions, n, repeats=1 if quick else 3) for n in sizes]
        lines.append(f"| {label} | host | {actions} | {_fmt(direct)} | {_fmt(resets)} | "
                     + " | ".join(_fmt(x) for x in driven) + " |")
        print(lines[-1], flush=True)
    for name, kwargs, label, actions in JAX_ENVS:
        driven = [driver_rate(name, kwargs, actions, n, repeats=1 if quick else 3) for n in sizes]
        lines.append(f"| {label} | JAX | {actions} | - | - | " + " | ".join(_fmt(x) for x in driven) + " |")
        print(lines[-1], flush=True)
    lines += ["", "## Share of a tiny rollout's wall time in env calls", "",
              "One training rollout of the tiny preset (`configs/<env>.py`: 8 groups x 8, its "
              "token budgets), after a warm-up rollout. *model*: the tiny random-weight model "
              "through the sampler (its answers rarely parse, so the envs are mostly only reset); "
              "*random answers*: well-formed random answers without a model (every turn steps "
              "the env: an upper bound).", "",
              "| env | policy | episodes | mean turns | rollout wall s | env calls s | env share |",
              "|---|---|---|---|---|---|---|"]
    for name, kwargs, label, config in [("countdown", {}, "Countdown", "countdown.py"),
                                        ("sudoku", {}, "SimpleSudoku 4x4", "sudoku.py")]:
        for kind in ("model", "random"):
            r = rollout_env_share(name, kwargs, config, kind)
            lines.append(f"| {label} | {'tiny model' if kind == 'model' else 'random answers'} | "
                         f"{r['episodes']} | {r['turns']:.1f} | {r['total_s']:.2f} | "
                         f"{r['env_s']:.3f} | {100 * r['share']:.1f}% |")
            print(lines[-1], flush=True)
    return lines


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def _plot(all_lengths: dict) -> None:
    """Histograms of optimal solution lengths per setting: bench_envs_solution_lengths.png."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    names = list(dict.fromkeys(k[0] for k in all_lengths))
    cols = 3 if len(names) > 3 else len(names)
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax, setting in zip(axes.reshape(-1), names, strict=False):
        for (s, source), lengths in all_lengths.items():
            if s == setting:
                ax.hist(lengths, bins=range(0, max(lengths) + 2), alpha=0.5, label=source, density=True)
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("optimal solution length (steps)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_envs_solution_lengths.png", dpi=100)


def main() -> None:
    warnings.filterwarnings("ignore")  # gym-sokoban's and the baselines' deprecation notes
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host-env section (bench_envs_host.md)")
    parser.add_argument("--sokoban-only", action="store_true",
                        help="only the Sokoban difficulty section (bench_envs_sokoban.md)")
    parser.add_argument("--levels", type=int, default=None, help="levels per difficulty cell")
    parser.add_argument("--envs", default=None,
                        help="only the throughput rows of these envs, e.g. game2048,rubikscube "
                             "(prints, writes nothing)")
    parser.add_argument("--cell", default=None,
                        help="with --sokoban-only: one cell, e.g. 10x10/3/300 (prints, writes nothing)")
    args = parser.parse_args()
    sizes = [1, 64] if args.quick else [1, 64, 1024, 4096]
    n_levels = args.levels or (30 if args.quick else 300)
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [f"# bench_envs ({jax.devices()[0].device_kind}, {os.cpu_count()} cores, "
             f"jax {jax.__version__})", ""]
    if args.host_only:
        lines += host_env_rows(args.quick)
        (RESULTS / "bench_envs_host.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS / 'bench_envs_host.md'}")
        return

    if args.sokoban_only and args.cell:
        sokoban_difficulty_rows(n_levels, 40 if args.quick else 300, args.cell)
        return
    if args.sokoban_only:
        difficulty, all_lengths = sokoban_difficulty_rows(n_levels, 40 if args.quick else 300)
        lines += difficulty
        (RESULTS / "bench_envs_sokoban.md").write_text("\n".join(lines) + "\n")
        _plot(all_lengths)
        print(f"wrote {RESULTS / 'bench_envs_sokoban.md'}")
        return

    lines += ["## Throughput (vmapped, jitted, `lax.scan`; random actions)", "",
              "| env | envs | steps/s (`step_env`) | steps/s (gymnax `step`, auto-reset) | resets/s |",
              "|---|---|---|---|---|"]
    envs = [("sokoban", {}), ("sokoban", {"dim_room": (8, 8), "num_boxes": 2}),
            ("frozenlake", {}), ("bandit", {}), ("game2048", {}), ("rubikscube", {})]
    if args.envs:
        envs = [(name, {}) for name in args.envs.split(",")]
    for name, kwargs in envs:
        label = name + (" 8x8/2" if kwargs else "")
        for n in sizes:
            rates = jax_rates(name, kwargs, n, 1000 if n == 1 else 100)
            lines.append(f"| {label} | {n} | {_fmt(rates['steps/s'])} | "
                         f"{_fmt(rates['auto-reset steps/s'])} | {_fmt(rates['resets/s'])} |")
            print(lines[-1], flush=True)
    if args.envs:
        return

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

    difficulty, all_lengths = sokoban_difficulty_rows(n_levels, 40 if args.quick else 300)
    lines += [""] + difficulty
    lines += [""] + host_env_rows(args.quick)
    (RESULTS / "bench_envs.md").write_text("\n".join(lines) + "\n")
    _plot(all_lengths)
    print(f"wrote {RESULTS / 'bench_envs.md'}")


if __name__ == "__main__":
    main()
