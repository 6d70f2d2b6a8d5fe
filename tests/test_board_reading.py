"""``experiments/board_reading.py``: its labelled Sokoban states and token rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.envs.registry import make
from ragen_jax.envs.solvers import solve
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.rollout.env_driver import JaxEnvDriver

_DIR = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("board_reading", _DIR / "board_reading.py")
board_reading = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(board_reading)


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
        data = board_reading.encode(env, rows, tok, form, len(names))
        assert data["input_ids"].shape[0] == len(rows)
        assert (data["optimal"] <= data["legal"]).all() and (data["solver"].sum(1) == 1).all()
    text = tok.decode(board_reading.encode(env, rows[:1], tok, "chat", len(names))["input_ids"][0])
    assert env.render_text(rows[0][0]) in text and text.endswith("assistant\n<answer>")


def test_held_out_levels_are_no_training_level_and_each_once():
    env, params = make("sokoban", dim_room=(6, 6), num_boxes=1, max_steps=100)
    train, candidates = np.arange(256), 1000 + np.arange(256)
    kept = board_reading.held_out_seeds(env, params, train, candidates)
    driver = JaxEnvDriver(env, params, 1)
    seen, ids = set(driver.reset(train).levels.tolist()), driver.reset(candidates).levels.tolist()
    kept_ids = driver.reset(kept).levels.tolist()
    assert not seen & set(kept_ids) and len(set(kept_ids)) == len(kept_ids)
    assert len(kept) == len(set(ids) - seen) < len(candidates)  # the ranges shared levels
