"""``experiments/first_move_accuracy.py`` on a synthetic run folder: FrozenLake levels whose
first answers are known to be optimal, not optimal or malformed (labels from the plain BFS)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np

from ragen_jax.envs import frozenlake_solver
from ragen_jax.envs.frozenlake import DELTAS
from ragen_jax.envs.registry import make

_PATH = Path(__file__).resolve().parent.parent / "experiments" / "first_move_accuracy.py"
_spec = importlib.util.spec_from_file_location("first_move_accuracy", _PATH)
fma = importlib.util.module_from_spec(_spec)
sys.modules["first_move_accuracy"] = fma
_spec.loader.exec_module(fma)

NAMES = ("Left", "Down", "Right", "Up")
PARAMS = {"size": 4, "p": 0.8, "is_slippery": False}


def _labels(state) -> tuple[int, int | None]:
    """(an optimal first move, a move that is not optimal or None) by the plain solver."""
    holes, player, goal = (np.asarray(state.holes), np.asarray(state.player), np.asarray(state.goal))
    path = frozenlake_solver.solve(holes, player, goal)
    for a, (dr, dc) in enumerate(DELTAS.tolist()):
        nxt = (int(player[0]) + dr, int(player[1]) + dc)
        if not (0 <= nxt[0] < 4 and 0 <= nxt[1] < 4):
            return path[0], a  # off the lake: no move at all
        rest = frozenlake_solver.solve(holes, np.array(nxt), goal)
        if rest is None or len(rest) >= len(path):
            return path[0], a
    return path[0], None


def test_first_move_accuracy_counts_the_optimal_first_answers(tmp_path):
    env, params = make("frozenlake", **PARAMS)
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(
        {"env": {"name": "frozenlake", "params": PARAMS}, "warmstart": {"solver_share": 0.3},
         "rollout": {"enable_think": False, "max_actions_per_turn": 2}}))
    lines, expected, levels = [], 0, 0
    for seed in range(40):
        state = env.reset_env(jax.random.key(seed), params)[1]
        if not frozenlake_solver.solve(np.asarray(state.holes), np.asarray(state.player),
                                       np.asarray(state.goal)):
            continue  # unsolvable or already done: the script skips it too
        good, bad = _labels(state)
        kind = levels % 3
        if kind == 0:
            answer, expected = f"<answer>{NAMES[good]} || Up</answer>", expected + 1
        elif kind == 1 and bad is not None:
            answer = f"<answer>{NAMES[bad]}</answer>"
        else:
            answer = f"I go {NAMES[good]}"  # no answer tags: not counted as a move
        levels += 1
        lines.append(json.dumps({"seed": seed, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": answer}]}))
    jsonl = run / "trajectories" / "val_step00000.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")

    r = fma.measure(jsonl, None)
    assert r["levels"] == levels > 20
    assert r["policy"] == expected / levels
    assert 0.0 < r["random_legal"] <= 1.0
    assert np.isclose(r["mixture_data"], 0.3 + 0.7 * r["random_legal"])
    assert fma.measure(jsonl, 1.0)["mixture_data"] == 1.0


def test_first_action_is_the_first_move_the_rollout_executes():
    context = fma.run_context({"rollout": {"enable_think": False, "max_actions_per_turn": 2}})
    assert fma.first_action("<answer> up || Left</answer>", NAMES, context) == 3
    assert fma.first_action("<answer>Jump || Left</answer>", NAMES, context) == 0  # Jump is skipped
    assert fma.first_action("Left <answer>Jump</answer>", NAMES, context) is None
    assert fma.first_action("Right", NAMES, context) is None
    thinking = fma.run_context({"rollout": {"enable_think": True}})
    assert fma.first_action("<think>go</think><answer>Down</answer>", NAMES, thinking) == 1
    assert fma.first_action("<answer>Down</answer>", NAMES, thinking) is None  # no think block
