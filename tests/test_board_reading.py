"""``ragen_jax.board_reading``: a run's first-move accuracy on a synthetic run folder
(FrozenLake levels whose first answers are known to be optimal, not optimal or malformed, by
the plain BFS), and the labelled Sokoban states and token rows of the supervised probe."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax import board_reading
from ragen_jax.envs import frozenlake_solver
from ragen_jax.envs.frozenlake import DELTAS
from ragen_jax.envs.registry import make
from ragen_jax.envs.solvers import solve
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.rollout.env_driver import JaxEnvDriver, env_functions, row_state

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
    seeds = np.arange(40, dtype=np.uint32)
    # the batched reset the function itself runs on the file's seeds: one program for both
    reset, _ = env_functions(env)
    states = jax.device_get(reset(jax.vmap(jax.random.key)(seeds), params)[1])
    for seed in seeds.tolist():
        state = row_state(states, seed)
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

    r = board_reading.first_move_accuracy(jsonl, None)
    assert r["levels"] == levels > 20
    assert r["policy"] == expected / levels
    assert 0.0 < r["random_legal"] <= 1.0
    assert np.isclose(r["mixture_data"], 0.3 + 0.7 * r["random_legal"])
    assert board_reading.first_move_accuracy(jsonl, 1.0)["mixture_data"] == 1.0


def test_first_action_is_the_first_move_the_rollout_executes():
    context = board_reading.run_context({"rollout": {"enable_think": False, "max_actions_per_turn": 2}})
    assert board_reading.first_action("<answer> up || Left</answer>", NAMES, context) == 3
    assert board_reading.first_action("<answer>Jump || Left</answer>", NAMES, context) == 0  # Jump is skipped
    assert board_reading.first_action("Left <answer>Jump</answer>", NAMES, context) is None
    assert board_reading.first_action("Right", NAMES, context) is None
    thinking = board_reading.run_context({"rollout": {"enable_think": True}})
    assert board_reading.first_action("<think>go</think><answer>Down</answer>", NAMES, thinking) == 1
    assert board_reading.first_action("<answer>Down</answer>", NAMES, thinking) is None  # no think block


def test_rows_are_labelled_by_the_solver_and_encoded_as_the_rollout_shows_them():
    env, params = make("sokoban", dim_room=(6, 6), num_boxes=1, max_steps=100)
    rows = board_reading.board_rows(env, params, np.arange(6), walk=1, rng=np.random.default_rng(0))
    assert 6 <= len(rows) <= 12
    for state, optimal, legal, solver in rows:
        path = solve(env, state)
        assert solver == path[0] and solver in optimal and set(optimal) <= set(legal)
        for a in legal:  # a legal move is optimal exactly when the solver needs one move less after it
            _, nxt, *_ = env.step_env(None, jax.tree.map(jnp.asarray, state), a, params)
            rest = solve(env, nxt)
            assert (a in optimal) == (rest is not None and len(rest) == len(path) - 1)
    tok = tokenizers.builtin()
    names = env.action_names_for(rows[0][0])
    for form in ("chat", "bare"):
        data = board_reading.encode_board_rows(env, rows, tok, form, len(names))
        assert data["input_ids"].shape[0] == len(rows)
        assert (data["optimal"] <= data["legal"]).all() and (data["solver"].sum(1) == 1).all()
    text = tok.decode(board_reading.encode_board_rows(env, rows[:1], tok, "chat", len(names))["input_ids"][0])
    assert env.render_text(rows[0][0]) in text and text.endswith("assistant\n<answer>")


def test_held_out_levels_are_no_training_level_and_each_once():
    env, params = make("sokoban", dim_room=(6, 6), num_boxes=1, max_steps=100)
    train, candidates = np.arange(256), 1000 + np.arange(256)
    kept = board_reading.held_out_seeds(env, params, train, candidates)
    driver = JaxEnvDriver(env, params, 1)  # one batch size throughout: one compile
    seen, ids = set(driver.reset(train).levels.tolist()), driver.reset(candidates).levels.tolist()
    kept_ids = [ids[int(s) - 1000] for s in kept]
    assert not seen & set(kept_ids) and len(set(kept_ids)) == len(kept_ids)
    assert len(kept) == len(set(ids) - seen) < len(candidates)  # the ranges shared levels
