"""FrozenLake: dynamics against a plain-Python reference, map generation, slip statistics,
rendering, and jit/vmap/gymnax properties."""

from __future__ import annotations

import math
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs.frozenlake import EnvParams, EnvState, FrozenLake
from tests.envs.ragen_text import format_coordinate_render

ENV = FrozenLake()
ENV6 = FrozenLake(size=6)
PARAMS = ENV.default_params

# ---- plain-Python reference (gymnasium FrozenLake semantics, RAGEN's symbols) ---------------

REF_DELTAS = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}  # Left, Down, Right, Up as (row, col)
REF_SYMBOLS = {"frozen": "_", "hole": "O", "goal": "G", "player": "P", "in_hole": "X",
               "on_goal": "√"}


def ref_step(holes, goal, player, move):
    """One move in direction ``move`` -> (player, reward, terminated, moved)."""
    n = len(holes)
    r, c = player
    if holes[r][c] or player == goal:  # absorbing
        return player, 0.0, True, False
    dr, dc = REF_DELTAS[move]
    nr, nc = r + dr, c + dc
    if not (0 <= nr < n and 0 <= nc < n):
        nr, nc = r, c
    new = (nr, nc)
    return new, float(new == goal), bool(holes[nr][nc]) or new == goal, new != player


def ref_grid(holes, goal, player):
    """The symbol rows of a map."""
    rows = []
    for r, row in enumerate(holes):
        line = ""
        for c, hole in enumerate(row):
            cell = "hole" if hole else ("goal" if (r, c) == goal else "frozen")
            if (r, c) == player:
                cell = {"hole": "in_hole", "goal": "on_goal"}.get(cell, "player")
            line += REF_SYMBOLS[cell]
        rows.append(line)
    return rows


def bfs_path_exists(holes, start, goal):
    n = len(holes)
    seen, todo = {start}, deque([start])
    while todo:
        r, c = todo.popleft()
        if (r, c) == goal:
            return True
        for dr, dc in REF_DELTAS.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and not holes[nr][nc] and (nr, nc) not in seen:
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


def as_map(state, i=None):
    """(holes as nested lists, start, goal, player) of one state, as Python values."""
    pick = (lambda x: np.asarray(x)) if i is None else (lambda x: np.asarray(x)[i])
    holes = pick(state.holes).tolist()
    return (holes, tuple(pick(state.start).tolist()), tuple(pick(state.goal).tolist()),
            tuple(pick(state.player).tolist()))


def symbols(obs) -> list[str]:
    from ragen_jax.envs.frozenlake import SYMBOLS

    return ["".join(SYMBOLS[c] for c in row) for row in np.asarray(obs)]


# ---- jitted helpers (compiled once per env size) -----------------------------------------

batch_reset = jax.jit(jax.vmap(ENV.reset_env, in_axes=(0, None)))
batch_reset6 = jax.jit(jax.vmap(ENV6.reset_env, in_axes=(0, None)))
jit_reset = jax.jit(ENV.reset_env)
jit_step = jax.jit(ENV.step_env)
N_MAPS = 400  # one batch size for every size-4 map sample: one compilation
N_MAPS6 = 300


@pytest.fixture(scope="module")
def maps4():
    keys = jax.random.split(jax.random.key(4), N_MAPS)
    return keys, batch_reset(keys, PARAMS)


@pytest.fixture(scope="module")
def maps6():
    return batch_reset6(jax.random.split(jax.random.key(6), N_MAPS6), PARAMS.replace(p=0.6))


@jax.jit
def auto_reset_rollout(keys, params, actions):
    """keys [B], actions [B, T] -> per-step pre-states and gymnax ``step`` outputs, [B, T, ...]."""

    def one_env(key, acts):
        key, key_reset = jax.random.split(key)
        _, state = ENV.reset_env(key_reset, params)

        def body(carry, action):
            state, key = carry
            key, key_step = jax.random.split(key)
            obs, new_state, reward, term, trunc, info = ENV.step(key_step, state, action, params)
            return (new_state, key), (state, new_state, obs, reward, term, trunc, info)

        return jax.lax.scan(body, (state, key), acts)[1]

    return jax.vmap(one_env)(keys, actions)


@jax.jit
def step_many(keys, state, actions, params):
    """Steps one state with many (key, action) pairs: keys [N], actions [N]."""
    return jax.vmap(ENV.step_env, in_axes=(0, None, 0, None))(keys, state, actions, params)


# ---- dynamics parity ---------------------------------------------------------------------


@pytest.mark.parametrize("slippery", [False, True])
def test_dynamics_match_reference(slippery):
    b, t = 64, 64  # 4096 transitions
    params = PARAMS.replace(is_slippery=slippery, max_steps=20)
    keys = jax.random.split(jax.random.key(11 + slippery), b)
    actions = jax.random.randint(jax.random.key(5), (b, t), 0, 4)
    pre, post, obs, reward, term, trunc, info = jax.tree.map(
        np.asarray, auto_reset_rollout(keys, params, actions)
    )
    actions = np.asarray(actions)
    counts = {"slips": 0, "goals": 0, "holes": 0, "truncations": 0}
    for i in range(b):
        holes, start, goal, player = as_map(pre, (i, 0))
        time = 0
        for s in range(t):
            a, move = int(actions[i, s]), int(info["move"][i, s])
            if slippery:
                assert move in (a, (a - 1) % 4, (a + 1) % 4)
                counts["slips"] += move != a
            else:
                assert move == a
            new, r, done, moved = ref_step(holes, goal, player, move)
            time += 1
            assert reward[i, s] == r
            assert term[i, s] == done
            assert trunc[i, s] == (time >= params.max_steps)
            assert info["success"][i, s] == (new == goal)
            assert info["action_is_effective"][i, s] == moved
            assert symbols(info["final_observation"][i, s]) == ref_grid(holes, goal, new)
            counts["goals"] += new == goal
            counts["holes"] += bool(holes[new[0]][new[1]])
            counts["truncations"] += bool(trunc[i, s]) and not done
            if done or time >= params.max_steps:  # gymnax auto-reset: a fresh map
                holes, start, goal, player = as_map(post, (i, s))
                assert player == start and int(post.time[i, s]) == 0
                time = 0
            else:
                player = new
                assert as_map(post, (i, s)) == (holes, start, goal, player)
                assert int(post.time[i, s]) == time
            assert symbols(obs[i, s]) == ref_grid(holes, goal, player)
    # The sample exercised every branch.
    assert counts["goals"] > 20 and counts["holes"] > 20 and counts["truncations"] > 5
    assert (counts["slips"] > 300) == slippery


# ---- map generation ----------------------------------------------------------------------


@pytest.mark.parametrize("size, p", [(4, 0.9), (6, 0.6)])
def test_every_map_has_a_path(size, p, maps4, maps6):
    _, states = maps4[1] if size == 4 else maps6
    states = jax.tree.map(np.asarray, states)
    n = len(states.time)
    hole_count = 0
    for i in range(n):
        holes, start, goal, player = as_map(states, i)
        assert start != goal and player == start
        assert not holes[start[0]][start[1]] and not holes[goal[0]][goal[1]]
        assert bfs_path_exists(holes, start, goal)
        hole_count += sum(map(sum, holes))
        # Maps are redrawn, not patched: the no-hole fallback must not fire at ordinary p.
        assert size == 4 or any(map(any, holes))
    assert np.all(states.time == 0)
    # Holes appear at about the drawn rate (a little less: maps without a path are redrawn).
    hole_rate = hole_count / (n * (size * size - 2))
    assert 0.5 * (1 - p) < hole_rate < 1.05 * (1 - p)


def test_start_and_goal_are_spread_over_the_board(maps4):
    _, states = maps4[1]
    for field in (states.start, states.goal):
        cells = np.asarray(field[:, 0] * 4 + field[:, 1])
        assert set(cells.tolist()) == set(range(16))


def test_same_key_same_map_different_keys_different_maps(maps4):
    keys, (_, a) = maps4
    _, b = batch_reset(keys, PARAMS)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))
    _, single = jit_reset(keys[7], PARAMS)
    assert as_map(single) == as_map(a, 7)
    distinct = {repr(as_map(a, i)) for i in range(N_MAPS)}
    # ~23% of 4x4 maps at p=0.9 have no hole, and those collide on start/goal (240 pairs).
    assert len(distinct) >= 0.9 * N_MAPS


def test_map_redraw_falls_back_to_no_holes_when_no_path_is_possible():
    # p = 0: every tile but start and goal is a hole, so only adjacent start/goal pairs survive.
    _, states = batch_reset(jax.random.split(jax.random.key(5), N_MAPS), PARAMS.replace(p=0.0))
    for i in range(0, N_MAPS, 8):
        holes, start, goal, _ = as_map(states, i)
        assert bfs_path_exists(holes, start, goal)
        assert abs(start[0] - goal[0]) + abs(start[1] - goal[1]) == 1 or not any(map(any, holes))


# ---- slipping ----------------------------------------------------------------------------


def open_board_state(player=(1, 1)):
    """4x4 without holes, goal in a corner, player away from walls and goal."""
    return EnvState(holes=jnp.zeros((4, 4), bool), start=jnp.array(player, jnp.int32),
                    goal=jnp.array([3, 3], jnp.int32), player=jnp.array(player, jnp.int32),
                    time=jnp.int32(0))


SLIP_N = 8000  # samples per action


@pytest.mark.parametrize("success_rate", [0.8, 0.5, 1.0 / 3.0])
def test_slip_frequencies_match_success_rate(success_rate):
    n = SLIP_N
    params = PARAMS.replace(success_rate=success_rate)
    actions = jnp.repeat(jnp.arange(4), n)
    keys = jax.random.split(jax.random.key(int(success_rate * 1000)), 4 * n)
    _, state, *_ = step_many(keys, open_board_state(), actions, params)
    players = np.asarray(state.player).reshape(4, n, 2)
    for a in range(4):
        landed = {}
        for p in map(tuple, players[a].tolist()):
            landed[p] = landed.get(p, 0) + 1
        expected = {a: success_rate, (a - 1) % 4: (1 - success_rate) / 2,
                    (a + 1) % 4: (1 - success_rate) / 2}
        cells = {(1 + REF_DELTAS[d][0], 1 + REF_DELTAS[d][1]): q for d, q in expected.items()}
        assert set(landed) == set(cells)  # never the opposite direction, never stays
        for cell, q in cells.items():
            bound = 5 * math.sqrt(n * q * (1 - q))  # 5 binomial standard deviations
            assert abs(landed[cell] - n * q) < bound, (a, cell, landed[cell], n * q)


def test_not_slippery_is_deterministic():
    params = PARAMS.replace(is_slippery=False)
    actions = jnp.repeat(jnp.arange(4), SLIP_N)
    _, state, _, _, info = step_many(jax.random.split(jax.random.key(0), 4 * SLIP_N),
                                     open_board_state(), actions, params)
    expected = np.array([[1 + REF_DELTAS[a][0], 1 + REF_DELTAS[a][1]] for a in np.asarray(actions)])
    np.testing.assert_array_equal(np.asarray(state.player), expected)
    np.testing.assert_array_equal(np.asarray(info["move"]), np.asarray(actions))


# ---- rendering and spaces ----------------------------------------------------------------


def test_render_grid_and_coord():
    holes = np.zeros((4, 4), bool)
    holes[0, 3] = holes[2, 1] = True
    state = EnvState(holes=holes, start=np.array([0, 0]), goal=np.array([3, 3]),
                     player=np.array([1, 2]), time=np.int32(0))
    assert ENV.render_text(state) == "___O\n__P_\n_O__\n___G"
    assert FrozenLake(observation_format="coord").render_text(state) == ENV.render_text(
        state, "coord")
    coord = ENV.render_text(state, "coord").split("\n")
    note = FrozenLake(observation_format="coord").observation_note()
    assert note.endswith("to (3, 3) at the bottom right.") and "(5, 5)" not in note
    assert ENV.observation_note() == "" == FrozenLake(observation_format="grid_coord").observation_note()
    assert coord == ["Board size: 4 rows x 4 cols (zero-indexed).", "Start: (0, 0)",
                     "Goal: (3, 3)", "Player: (1, 2)", "Holes: (0, 3), (2, 1)"]
    no_holes = state.replace(holes=np.zeros((4, 4), bool))
    assert ENV.render_text(no_holes, "coord").split("\n")[-1] == "Player: (1, 2)"  # no Holes line
    assert FrozenLake(observation_format="grid_coord").render_text(state) == (
        "Coordinates: \n" + "\n".join(coord) + "\nGrid Map: \n___O\n__P_\n_O__\n___G")
    in_hole = state.replace(player=np.array([2, 1]))
    assert ENV.render_text(in_hole) == "___O\n____\n_X__\n___G"
    assert "Player in hole: (2, 1)" in ENV.render_text(in_hole, "coord")
    on_goal = state.replace(player=np.array([3, 3]))
    assert ENV.render_text(on_goal).endswith("___√")
    assert "Player on goal: (3, 3)" in ENV.render_text(on_goal, "coord")
    with pytest.raises(ValueError):
        ENV.render_text(state, "pixels")
    with pytest.raises(ValueError):
        FrozenLake(observation_format="pixels")


def test_render_matches_get_obs_and_board_size(maps6):
    obs, states = maps6
    for i in range(20):
        one = jax.tree.map(lambda x, i=i: np.asarray(x[i]), states)
        assert ENV6.render_text(one).split("\n") == symbols(obs[i])
    assert "to (5, 5) at the bottom right" in FrozenLake(size=6, observation_format="coord").observation_note()


# RAGEN's FrozenLakeEnv._render_text and its utils' coordinate lines (ragen/env/frozen_lake/),
# written out on gymnasium's map: desc, bytes S start, F frozen, H hole, G goal.
RAGEN_MAP_LOOKUP = {b"P": 0, b"F": 1, b"H": 2, b"G": 3}
RAGEN_GRID_LOOKUP = {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"}
RAGEN_COORD_LABELS = [("start", "Start"), ("goal", "Goal"), ("player", "Player"),
                      ("player_on_goal", "Player on goal"), ("player_in_hole", "Player in hole"),
                      ("holes", "Holes")]


def ragen_frozenlake_text(desc: np.ndarray, player: tuple[int, int], fmt: str) -> str:
    if fmt == "grid":
        room = np.where(desc == b"S", b"F", desc)
        room[player] = b"P"
        room = np.vectorize(lambda x: RAGEN_MAP_LOOKUP[x])(room)
        room[player] = 4 if desc[player] == b"H" else 5 if desc[player] == b"G" else 0
        return "\n".join("".join(RAGEN_GRID_LOOKUP.get(c, "?") for c in row) for row in room)
    if fmt == "grid_coord":
        return ("Coordinates: \n" + ragen_frozenlake_text(desc, player, "coord") + "\n"
                + "Grid Map: \n" + ragen_frozenlake_text(desc, player, "grid"))
    coords = {}
    for key, tile in (("start", b"S"), ("goal", b"G"), ("holes", b"H")):
        found = [(int(r), int(c)) for r, c in np.argwhere(desc == tile)]
        if found:
            coords[key] = found
    tile = desc[player]
    coords["player_on_goal" if tile == b"G" else "player_in_hole" if tile == b"H" else "player"] = [player]
    return format_coordinate_render(coords, desc.shape, RAGEN_COORD_LABELS)


@pytest.mark.parametrize("size", [4, 6])
def test_text_is_ragens(size, maps4, maps6):
    """Every format on random maps (some without holes), the player on the start, the goal,
    a hole and a random cell, against RAGEN's rules above."""
    env = ENV if size == 4 else ENV6
    _, states = maps4[1] if size == 4 else maps6
    host = jax.device_get(states)
    rng = np.random.default_rng(size)
    without_holes = 0
    for i in range(40):
        holes, start, goal, _ = as_map(host, i)
        desc = np.where(np.asarray(holes), b"H", b"F").astype("S1")
        desc[start], desc[goal] = b"S", b"G"
        hole_cells = [tuple(int(v) for v in h) for h in np.argwhere(np.asarray(holes))]
        without_holes += not hole_cells
        cells = [start, goal, tuple(int(v) for v in rng.integers(0, size, 2)), *hole_cells[:1]]
        for player in cells:
            state = EnvState(holes=np.asarray(holes), start=np.array(start), goal=np.array(goal),
                             player=np.array(player), time=np.int32(0))
            for fmt in ("grid", "coord", "grid_coord"):
                assert env.render_text(state, fmt) == ragen_frozenlake_text(desc, player, fmt)
    assert size == 6 or without_holes > 0  # 4x4 at p=0.9: about one map in five


def test_spaces_contain_reset_and_step_outputs():
    obs, state = jit_reset(jax.random.key(0), PARAMS)
    assert ENV.action_space(PARAMS).n == 4 == ENV.num_actions
    assert ENV.action_names == ("Left", "Down", "Right", "Up")
    assert obs.shape == (4, 4) and obs.dtype == jnp.int8
    assert bool(ENV.observation_space(PARAMS).contains(obs))
    obs, *_ = jit_step(jax.random.key(1), state, 0, PARAMS)
    assert bool(ENV.observation_space(PARAMS).contains(obs))
    space = ENV.state_space(PARAMS).spaces
    for name in ("holes", "start", "goal", "player", "time"):
        assert bool(space[name].contains(getattr(state, name)))


def test_make_builds_frozenlake():
    pytest.importorskip("ragen_jax.envs.sokoban")
    from ragen_jax.envs.registry import make

    env, params = make("frozenlake", size=4, p=0.8, max_steps=20)
    assert isinstance(env, FrozenLake) and env.size == 4
    assert params == EnvParams(p=0.8, max_steps=20)
    env, _ = make("frozenlake", size=5, observation_format="coord")
    assert env.size == 5 and env.observation_format == "coord"


# ---- properties --------------------------------------------------------------------------

T = 24


@jax.jit
def run_step_env(key, params, actions):
    """Reset then step_env (no auto-reset) through ``actions`` [T]."""
    key, key_reset = jax.random.split(key)
    _, state = ENV.reset_env(key_reset, params)

    def body(state, inputs):
        key, action = inputs
        _, new, reward, term, info = ENV.step_env(key, state, action, params)
        return new, (state, new, reward, term, info)

    return jax.lax.scan(body, state, (jax.random.split(key, T), actions))[1]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(st.integers(0, 3), min_size=T, max_size=T),
       slippery=st.booleans(), p=st.floats(0.5, 1.0))
def test_player_stays_on_board_and_rewards_only_at_goal(seed, actions, slippery, p):
    params = PARAMS.replace(is_slippery=slippery, p=p)
    pre, post, reward, term, info = jax.tree.map(
        np.asarray, run_step_env(jax.random.key(seed), params, jnp.array(actions)))
    assert np.all((post.player >= 0) & (post.player < 4))
    assert set(np.unique(reward).tolist()) <= {0.0, 1.0}
    at_goal = np.all(post.player == post.goal, axis=-1)
    was_done = np.all(pre.player == pre.goal, axis=-1) | pre.holes[
        np.arange(T), pre.player[:, 0], pre.player[:, 1]]
    np.testing.assert_array_equal(reward == 1.0, at_goal & ~was_done)
    assert reward.sum() <= 1.0  # the goal pays once: it is absorbing
    np.testing.assert_array_equal(info["success"], at_goal)
    # Once terminated, nothing moves.
    after = np.cumsum(term) > 0
    assert np.all(post.player[after] == post.player[after][:1])
    assert np.all(post.time == np.arange(1, T + 1))


def reset_then_step(reset_key, step_key, action, params):
    obs0, state = ENV.reset_env(reset_key, params)
    return obs0, state, *ENV.step_env(step_key, state, action, params)


batched_reset_then_step = jax.jit(jax.vmap(reset_then_step, in_axes=(0, 0, 0, None)))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eager_matches_jit():
    # Eager reset retraces its while loops on every call (~0.7 s), so this runs outside hypothesis.
    reset_keys = jax.random.split(jax.random.key(0), 3)
    step_keys = jax.random.split(jax.random.key(1), 3)
    batched = batched_reset_then_step(reset_keys, step_keys, jnp.array([0, 1, 2]), PARAMS)
    plain = reset_then_step(reset_keys[2], step_keys[2], 2, PARAMS)
    assert_trees_equal(plain, jax.tree.map(lambda x: x[2], batched))


# Few examples: each steps eagerly (op by op, the costly part), and each compares three rows
# (three actions, slippery or not) of one batch.
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       slippery=st.booleans())
def test_jit_and_vmap_match_unbatched(seed, actions, slippery):
    params = PARAMS.replace(is_slippery=slippery)
    reset_keys = jax.random.split(jax.random.key(seed), 3)
    step_keys = jax.random.split(reset_keys[0], 3)
    batched = batched_reset_then_step(reset_keys, step_keys, jnp.array(actions), params)
    for i in range(3):
        obs0, state = jit_reset(reset_keys[i], params)
        # step_env unjitted (eager) and jitted, from the jitted reset's state.
        for step in (ENV.step_env, jit_step):
            one = (obs0, state, *step(step_keys[i], state, actions[i], params))
            assert_trees_equal(one, jax.tree.map(lambda x, i=i: x[i], batched))


# Each example steps eagerly 12 times past a 5-step limit: both branches (auto-reset or not)
# in every example, so few examples.
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_gymnax_step_auto_resets(seed, actions):
    params = PARAMS.replace(max_steps=5)
    key = jax.random.key(seed)
    obs, state = ENV.reset(key, params)
    for action in actions:
        key, key_step = jax.random.split(key)
        obs, new, reward, term, trunc, info = ENV.step(key_step, state, action, params)
        k_step, k_reset = jax.random.split(key_step)
        obs_st, state_st, reward_st, term_st, _ = jit_step(k_step, state, action, params)
        assert float(reward) == float(reward_st) and bool(term) == bool(term_st)
        np.testing.assert_array_equal(info["final_observation"], obs_st)
        if bool(term) or bool(trunc):
            expected_obs, expected = jit_reset(k_reset, params)
            assert int(new.time) == 0
        else:
            expected_obs, expected = obs_st, state_st
        assert as_map(new) == as_map(expected) and int(new.time) == int(expected.time)
        np.testing.assert_array_equal(obs, expected_obs)
        state = new


# ---- the BFS solver (solver-mixture warm-start) --------------------------------------------


def ref_shortest_length(holes, goal, player):
    """Fewest moves to the goal by expanding ``ref_step`` move sequences level by level."""
    frontier, seen = {player}, {player}
    for depth in range(len(holes) ** 2):
        if goal in frontier:
            return depth
        nxt = set()
        for p in frontier:
            for move in REF_DELTAS:
                q, _, done, _ = ref_step(holes, goal, p, move)
                if q not in seen and not (done and q != goal):
                    nxt.add(q)
        seen |= nxt
        frontier = nxt
    return None


def test_solver_paths_are_shortest_and_reach_the_goal(maps4):
    from ragen_jax.envs import solvers
    from ragen_jax.envs.frozenlake_solver import solve

    _, states = maps4[1]
    states = jax.tree.map(np.asarray, states)
    params = PARAMS.replace(is_slippery=False)
    for i in range(40):
        holes, _, goal, player = as_map(states, i)
        state = jax.tree.map(lambda x, i=i: x[i], states)
        path = solvers.solve(ENV, state)
        assert path == solve(np.array(holes), np.array(player), np.array(goal))
        assert len(path) == ref_shortest_length(holes, goal, player)
        for j, a in enumerate(path):  # replayed in the JAX env it ends on the goal, not before
            _, state, reward, done, _ = jit_step(jax.random.key(j), state, a, params)
            assert bool(done) == (j == len(path) - 1) and float(reward) == float(j == len(path) - 1)
    walled = np.zeros((4, 4), bool)
    walled[2, 3] = walled[3, 2] = True
    assert solve(walled, np.array([0, 0]), np.array([3, 3])) is None  # goal cut off
    assert solve(walled, np.array([3, 3]), np.array([3, 3])) == []  # already there
    assert solve(walled, np.array([2, 3]), np.array([0, 0])) is None  # in a hole
