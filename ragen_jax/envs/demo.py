"""Environment demo: ``python -m ragen_jax.envs.demo``.

Generates a level on device, plays one episode with a random policy (or, for Sokoban and the
cube, the optimal BFS solver; for 2048 the scripted baseline) and prints the text the agent
would read at every step.

    python -m ragen_jax.envs.demo                      # Sokoban, solved by the BFS solver
    python -m ragen_jax.envs.demo --env frozenlake --policy random --seed 3
    python -m ragen_jax.envs.demo --env rubikscube --policy solver
"""

from __future__ import annotations

import argparse

import jax
import numpy as np


def demo(env_name: str, policy: str, seed: int, max_steps: int, observation_format: str | None) -> float:
    from ragen_jax.envs import make

    kwargs = {"observation_format": observation_format} if observation_format else {}
    env, params = make(env_name, **kwargs)
    key_reset, key_play = jax.random.split(jax.random.key(seed))
    _, state = env.reset(key_reset, params)
    step = jax.jit(env.step_env)
    plan: list[int] | None = None
    if policy == "solver":
        if env_name not in ("sokoban", "rubikscube", "game2048"):
            raise SystemExit("--policy solver is only available for sokoban, rubikscube, game2048")
        from ragen_jax.envs.solvers import solve
    replan = policy == "solver" and env_name == "game2048"  # the baseline picks one move a time
    if policy == "solver" and not replan:
        plan = solve(env, jax.tree.map(np.asarray, state))
    print(f"{env_name} (seed {seed}), actions: {', '.join(env.action_names_for(state))}\n")
    print(env.render_text(state), "\n")
    total = 0.0
    for t in range(max_steps):
        key_play, key_act, key_step = jax.random.split(key_play, 3)
        names = env.action_names_for(state)
        if plan is not None and t >= len(plan):
            break  # the plan is played out (or the level started solved)
        if replan:
            action = (solve(env, jax.tree.map(np.asarray, state)) or [0])[0]
        elif plan is not None:
            action = plan[t]
        else:
            action = int(jax.random.randint(key_act, (), 0, len(names)))
        _, state, reward, terminated, info = step(key_step, state, action, params)
        truncated = bool(env.is_truncated(state, params))
        total += float(reward)
        print(f"step {t + 1}: {names[action]}  reward {float(reward):+.2f}  "
              f"effective {bool(info['action_is_effective'])}  success {bool(info['success'])}")
        print(env.render_text(state), "\n")
        if bool(terminated) or truncated:
            break
    print(f"episode return {total:+.2f}")
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ragen_jax.envs.demo",
                                     description="ragen_jax: play one episode of an env.")
    parser.add_argument("--env", default="sokoban",
                        choices=["sokoban", "frozenlake", "bandit", "game2048", "rubikscube"])
    parser.add_argument("--policy", default=None, choices=["random", "solver"],
                        help="default: solver for sokoban and rubikscube, random otherwise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--observation-format", default=None,
                        help="sokoban and frozenlake: grid | coord | grid_coord")
    args = parser.parse_args(argv)
    policy = args.policy or ("solver" if args.env in ("sokoban", "rubikscube") else "random")
    demo(args.env, policy, args.seed, args.max_steps, args.observation_format)


if __name__ == "__main__":
    main()
