"""Does a policy read the board? Its first moves against the BFS solver's, on validation levels.

    python experiments/first_move_accuracy.py RUN/trajectories/val_step00000.jsonl [MORE.jsonl ...]

For every validation episode of a saved trajectories file (``trainer.save_trajectories``; the
env and its parameters come from the run's ``config.json`` beside the ``trajectories`` folder):
the level is reset from the episode's seed as the rollout resets it, the *optimal first moves*
are every action after which the env's BFS solver (``ragen_jax/envs/solvers.py``) needs one
move less to finish, and the first move the env executed for the policy's first answer (the
rollout's parser with the run's settings) is checked against them. Printed beside the policy's rate, on the same levels:

- *random legal*: the expected rate of a uniformly random move among those that change the
  state (``LegalActions``: the solver-mixture data's non-solver moves);
- *mixture data (share s)*: ``s + (1 - s) * random legal``, what the solver-mixture data the
  prior is supervised on score (``warmstart.solver_share``).

A policy that reads the board scores above *random legal*; one that has learnt the answer
format and which moves are common, but not where the player, box and target are, scores at
or below it. Levels the solver cannot finish are skipped. The episode's first answer was
sampled at the validation temperature (0.5 by default), not greedily.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ragen_jax.config import legacy  # noqa: E402
from ragen_jax.envs.registry import make  # noqa: E402
from ragen_jax.envs.solvers import solve  # noqa: E402
from ragen_jax.rollout.config import RolloutConfig  # noqa: E402
from ragen_jax.rollout.context import ContextConfig, parse_response  # noqa: E402
from ragen_jax.rollout.env_driver import env_functions, row_state  # noqa: E402
from ragen_jax.rollout.scripted import LegalActions  # noqa: E402


class FirstMoves(NamedTuple):
    """The optimal and legal first moves from a state, with what was computed on the way."""

    optimal: set[int]  # action ids after which the solver needs one move less
    legal: np.ndarray  # action ids that change the state
    path: list[int]  # one optimal action sequence from the state
    next_states: Any  # the state after each action (``LegalActions``)
    done: np.ndarray  # whether each action ends the episode


def optimal_first_moves(env, legal_actions: LegalActions, state) -> FirstMoves | None:
    """The optimal and legal first moves from ``state``, or None when unsolvable."""
    path = solve(env, state)
    if not path:
        return None
    legal, nxt, done = legal_actions(state)
    optimal = set()
    for a in legal:
        rest = solve(env, row_state(nxt, int(a)))
        if rest is not None and len(rest) == len(path) - 1:
            optimal.add(int(a))
    return FirstMoves(optimal, legal, path, nxt, done)


def first_action(answer: str, names: tuple[str, ...], context: ContextConfig) -> int | None:
    """The first move the env executed for ``answer``: the rollout's own parser
    (``rollout.context.parse_response``) with the run's settings; None when it found no
    valid action (the turn earned the format penalty and the env did not move)."""
    parsed = parse_response(answer, names, context)
    return parsed.action_ids[0] if parsed.action_ids else None


def run_context(config: dict) -> ContextConfig:
    """The parsing settings of the run whose ``config.json`` is ``config`` (of any schema:
    ``config.legacy.upgrade``)."""
    rollout, default = legacy.upgrade(config).get("rollout", {}), RolloutConfig()
    think = rollout.get("prompt", {}).get("enable_think", default.prompt.enable_think)
    return dataclasses.replace(default.context, enable_think=think, max_actions_per_turn=rollout.get(
        "max_actions_per_turn", default.max_actions_per_turn))


def measure(jsonl: Path, share: float | None) -> dict[str, float]:
    config = json.loads((jsonl.parent.parent / "config.json").read_text())
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in config["env"]["params"].items()}
    env, env_params = make(config["env"]["name"], **params)
    episodes = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    seeds = np.array([e["seed"] for e in episodes], np.uint32)
    reset, _ = env_functions(env)
    _, states = jax.device_get(reset(jax.vmap(jax.random.key)(seeds), env_params))
    names = tuple(env.action_names_for(row_state(states, 0)))
    legal_actions = LegalActions(env, env_params, len(names), 1)
    context = run_context(config)
    hits, random_legal, used = 0, [], 0
    for i, ep in enumerate(episodes):
        found = optimal_first_moves(env, legal_actions, row_state(states, i))
        if found is None:
            continue
        optimal, legal = found.optimal, found.legal
        answers = [m["content"] for m in ep["messages"] if m["role"] == "assistant"]
        action = first_action(answers[0], names, context) if answers else None
        used += 1
        hits += action in optimal
        random_legal.append(len(optimal) / len(legal))
    share = config["warmstart"]["solver_share"] if share is None else share
    rl = float(np.mean(random_legal))
    return {"levels": used, "policy": hits / used, "random_legal": rl,
            "share": share, "mixture_data": share + (1 - share) * rl}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", type=Path)
    p.add_argument("--share", type=float, help="mixture share to compare with (default: the run's)")
    args = p.parse_args()
    print("| trajectories | levels | policy: optimal first move | random legal move | mixture data (share) |")
    print("|---|---:|---:|---:|---:|")
    for f in args.jsonl:
        r = measure(f, args.share)
        print(f"| {f} | {r['levels']} | {r['policy']:.3f} | {r['random_legal']:.3f} "
              f"| {r['mixture_data']:.3f} ({r['share']:g}) |")


if __name__ == "__main__":
    main()
