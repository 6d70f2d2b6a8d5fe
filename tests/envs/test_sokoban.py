"""Sokoban: dynamics against a plain-Python reference, level generation, rendering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import solvers
from ragen_jax.envs.sokoban.env import Sokoban
from ragen_jax.envs.sokoban.generator import (
    _STAMPS,
    WALK_DIRECTIONS,
    fallback_level,
    generate_level,
    topology_from_draws,
)
from ragen_jax.envs.sokoban.solver import solve
from ragen_jax.envs.sokoban.types import TARGET, EnvState
from tests.envs.ragen_text import format_coordinate_render

MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]


# One instance per configuration, so jitted functions compile once per test session; one batch
# size per configuration too (the generator takes ~8 CPU-s to compile at each shape).
ENV = Sokoban()
ENV8 = Sokoban(dim_room=(8, 8), num_boxes=2)
ENV10 = Sokoban(dim_room=(10, 10), num_boxes=3, search_depth=10)  # shallow: cheap to solve
BATCHED_RESET = {e: jax.jit(jax.vmap(e.reset_env, in_axes=(0, None))) for e in (ENV, ENV8, ENV10)}
BATCHED_STEP = jax.jit(jax.vmap(ENV.step_env, in_axes=(0, 0, 0, None)))
STEP = {e: jax.jit(e.step_env) for e in (ENV, ENV8, ENV10)}


class ReferenceSokoban:
    """gym-sokoban's push dynamics and rewards on a codes grid, written independently."""

    def __init__(self, codes: np.ndarray, max_steps: int = 100):
        codes = np.array(codes, dtype=int)
        self.fixed = np.where(np.isin(codes, (2, 3, 6)), 2, np.where(codes == 0, 0, 1))
        self.boxes = {tuple(p) for p in np.argwhere(np.isin(codes, (3, 4)))}
        self.player = tuple(np.argwhere(np.isin(codes, (5, 6)))[0])
        self.num_boxes = len(self.boxes)
        self.on_target = self._count()
        self.steps = 0
        self.max_steps = max_steps

    def _count(self) -> int:
        return sum(self.fixed[b] == 2 for b in self.boxes)

    def step(self, action: int):
        dr, dc = MOVES[action]
        one = (self.player[0] + dr, self.player[1] + dc)
        two = (one[0] + dr, one[1] + dc)
        moved = False
        if one in self.boxes:
            if self.fixed[two] != 0 and two not in self.boxes:
                self.boxes = (self.boxes - {one}) | {two}
                self.player, moved = one, True
        elif self.fixed[one] != 0:
            self.player, moved = one, True
        self.steps += 1
        count = self._count()
        reward = -0.1
        if count > self.on_target:
            reward += 1.0
        elif count < self.on_target:
            reward -= 1.0
        solved = count == self.num_boxes
        if solved:
            reward += 10.0
        self.on_target = count
        return reward, solved, self.steps >= self.max_steps, moved

    def codes(self) -> np.ndarray:
        out = self.fixed.copy()
        for b in self.boxes:
            out[b] = 3 if self.fixed[b] == 2 else 4
        out[self.player] = 6 if self.fixed[self.player] == 2 else 5
        return out


@pytest.mark.parametrize("env", [ENV, ENV8], ids=["6x6-1box", "8x8-2boxes"])
def test_step_matches_python_reference(env):
    params = env.default_params.replace(max_steps=40)
    n_envs, n_steps = 64, 60
    _, state = BATCHED_RESET[env](jax.random.split(jax.random.key(1), n_envs), params)
    actions = np.asarray(jax.random.randint(jax.random.key(2), (n_steps, n_envs), 0, 4))
    step = jax.vmap(STEP[env], in_axes=(None, 0, 0, None))
    codes0 = np.asarray(jax.vmap(env.get_obs)(state))
    refs = [ReferenceSokoban(codes0[i], 40) for i in range(n_envs)]
    for t in range(n_steps):
        obs, state, reward, terminated, info = step(jax.random.key(0), state, jnp.asarray(actions[t]), params)
        truncated = jax.vmap(env.is_truncated, in_axes=(0, None))(state, params)
        obs, reward, terminated, truncated, info = jax.device_get((obs, reward, terminated, truncated, info))
        for i, ref in enumerate(refs):
            if ref.steps >= ref.max_steps or ref.on_target == ref.num_boxes:
                continue  # the reference episode ended; the JAX env is not stepped past an end in use
            r, solved, trunc, moved = ref.step(int(actions[t, i]))
            np.testing.assert_array_equal(np.asarray(obs[i]), ref.codes())
            assert float(reward[i]) == pytest.approx(r, abs=1e-6)
            assert bool(terminated[i]) == solved == bool(info["success"][i])
            assert bool(truncated[i]) == trunc
            assert bool(info["action_is_effective"][i]) == moved


def test_reference_sees_box_pushes():
    """The comparison above is only meaningful if random play pushes boxes and scores."""
    env = ENV
    _, state = BATCHED_RESET[env](jax.random.split(jax.random.key(1), 64), env.default_params)
    rewards = []
    codes0 = np.asarray(jax.vmap(env.get_obs)(state))
    for i in range(64):
        ref = ReferenceSokoban(codes0[i])
        rng = np.random.default_rng(i)
        rewards += [ref.step(int(a))[0] for a in rng.integers(0, 4, 60)]
    assert any(r > 0 for r in rewards) and any(r < -0.5 for r in rewards)


def _generator(env: Sokoban, num_gen_steps: int | None = None, searches_per_try: int | None = None,
               max_tries: int | None = None, num_layouts: int | None = None):
    """``generate_level`` with the env's settings, some overridden; jitted and vmapped."""
    return jax.jit(jax.vmap(lambda k: generate_level(
        k, env.dim_room, env.num_boxes,
        env.num_gen_steps if num_gen_steps is None else num_gen_steps, env.search_budget,
        env.num_walks, env.num_pulls, env.greedy, env.lookahead,
        env.num_layouts if num_layouts is None else num_layouts,
        env.searches_per_try if searches_per_try is None else searches_per_try,
        env.max_tries if max_tries is None else max_tries)))


ONE_TRY = _generator(ENV, num_layouts=1, searches_per_try=1, max_tries=1)
NO_FLOOR = _generator(ENV8, num_gen_steps=0, max_tries=2)  # every try fails: no room at all


def _assert_fallback(state, env):
    fallback = fallback_level(env.dim_room, env.num_boxes)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(fallback), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_generate_level_reports_success():
    keys = jax.random.split(jax.random.key(5), 256)
    # With a single try of a single layout, some levels must fail (gym-sokoban: ~17%), and those
    # get the fallback level, never a solved one.
    ok, states = ONE_TRY(keys)
    ok = np.asarray(ok)
    assert 0.02 < 1 - float(np.mean(ok)) < 0.4
    host = jax.device_get(states)
    for i in np.flatnonzero(~ok)[:5]:
        _assert_fallback(jax.tree.map(lambda x, i=i: x[i], host), ENV)


def test_fallback_level_is_valid_and_unsolved():
    for dim, boxes in [((5, 5), 3), ((6, 6), 1), ((8, 8), 2), ((10, 10), 3), ((7, 12), 4)]:
        level = jax.device_get(fallback_level(dim, boxes))
        fixed, box_grid = np.asarray(level.room_fixed), np.asarray(level.boxes)
        assert box_grid.sum() == boxes == (fixed == TARGET).sum()
        assert not np.any(box_grid & (fixed == TARGET)) and int(level.boxes_on_target) == 0
        assert len(solve(fixed, box_grid, np.asarray(level.player))) >= boxes
    with pytest.raises(ValueError, match="num_boxes"):
        Sokoban(dim_room=(5, 5), num_boxes=4)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_failed_generation_never_starts_solved_or_pays(seed):
    """Forced failure (a room without floor) and single-try generation: a level is never solved
    at the start, its ``boxes_on_target`` is right, and a first step that pushes nothing costs
    exactly the step penalty."""
    ok, states = NO_FLOOR(jax.random.split(jax.random.key(seed), 2))
    assert not np.any(np.asarray(ok))
    _assert_fallback(jax.tree.map(lambda x: x[0], states), ENV8)
    one_ok, one_try = ONE_TRY(jax.random.split(jax.random.key(seed), 256))  # as in the test above
    one_ok = np.asarray(one_ok)
    some = np.concatenate([np.flatnonzero(~one_ok)[:4], np.flatnonzero(one_ok)[:4]])  # failed and not
    for env, batch, rows in ((ENV8, states, range(2)), (ENV, one_try, some)):
        host = jax.device_get(batch)
        for i in rows:
            s = jax.tree.map(lambda x, i=i: x[i], host)
            fixed, boxes = np.asarray(s.room_fixed), np.asarray(s.boxes)
            on_target = int(np.sum(boxes & (fixed == TARGET)))
            assert on_target < env.num_boxes and int(s.boxes_on_target) == on_target
            assert not bool(env.is_terminated(s, env.default_params))
            for action in range(4):
                dr, dc = MOVES[action]
                one = (int(s.player[0]) + dr, int(s.player[1]) + dc)
                if not boxes[one]:  # no push: the reward is the step penalty alone
                    _, _, reward, done, _ = STEP[env](jax.random.key(0), s, action, env.default_params)
                    assert float(reward) == pytest.approx(env.default_params.step_penalty)
                    assert not bool(done)


@pytest.mark.parametrize("env,n", [(ENV, 64), (ENV8, 64), (ENV10, 16)],
                         ids=["6x6-1box", "8x8-2boxes", "10x10-3boxes-depth10"])
def test_levels_are_solvable_and_unsolved(env, n):
    _, states = BATCHED_RESET[env](jax.random.split(jax.random.key(0), n), env.default_params)
    step = STEP[env]
    host = jax.device_get(states)
    lengths = []
    for i in range(n):
        s = jax.tree.map(lambda x, i=i: x[i], host)
        fixed, boxes = np.asarray(s.room_fixed), np.asarray(s.boxes)
        assert boxes.sum() == env.num_boxes
        assert (fixed == 2).sum() == env.num_boxes
        assert not np.all(fixed[boxes] == 2), "level starts solved"
        assert int(s.boxes_on_target) == int(np.sum(fixed[boxes] == 2)) == 0
        assert fixed[tuple(np.asarray(s.player))] != 0 and not boxes[tuple(np.asarray(s.player))]
        plan = solve(fixed, boxes, np.asarray(s.player))
        assert plan, f"level {i} has no solution"
        if i < 5:  # the warm-start's dispatch reaches the same solver
            assert solvers.solve(env, s) == plan
        lengths.append(len(plan))
        if i < 20:  # replaying the solver's plan in the JAX env solves the level
            for a in plan:
                _, s, _, done, info = step(jax.random.key(0), s, a, env.default_params)
            assert bool(done) and bool(info["success"])
    assert np.mean(lengths) > 2.5  # not trivially easy


# Batch sizes as in test_levels_are_solvable_and_unsolved, so each batched reset compiles once.
@pytest.mark.parametrize("env,n", [(ENV, 64), (ENV8, 64)], ids=["6x6-1box", "8x8-2boxes"])
def test_same_key_same_level_and_keys_differ(env, n):
    params = env.default_params
    _, a = env.reset(jax.random.key(7), params)
    _, b = env.reset(jax.random.key(7), params)
    chex_equal = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert all(jax.tree.leaves(chex_equal))
    keys = jax.random.split(jax.random.key(8), n)
    _, many = BATCHED_RESET[env](keys, params)
    _, again = BATCHED_RESET[env](keys, params)  # batched: the same levels again
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), many, again)))
    first = jax.tree.map(lambda x: x[0], many)  # batched and unbatched agree
    _, single = env.reset(keys[0], params)
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), first, single)))
    obs = np.asarray(jax.vmap(env.get_obs)(many)).reshape(n, -1)
    assert len({row.tobytes() for row in obs}) >= n - n // 20


def test_several_boxes_are_as_hard_as_ragens():
    """8x8 with 2 boxes, search depth 300: RAGEN-style levels have a BFS-optimal length of
    median 13 / p90 23 (experiments/results/bench_envs_sokoban.md); the parallel random walks
    this generator had before gave 8 / 11."""
    _, states = BATCHED_RESET[ENV8](jax.random.split(jax.random.key(11), 64), ENV8.default_params)
    host = jax.device_get(states)
    lengths = [len(solve(host.room_fixed[i], host.boxes[i], host.player[i])) for i in range(64)]
    assert np.median(lengths) >= 10 and np.percentile(lengths, 90) >= 16, lengths


def _reference_topology(dim, start, first_direction, change, new_direction, stamp):
    """gym-sokoban's ``room_topology_generation`` loop, fed with given draws."""
    level = np.zeros(dim, int)
    pos, direction = np.array(start), int(first_direction)
    for t in range(len(change)):
        if change[t]:
            direction = int(new_direction[t])
        pos = pos + WALK_DIRECTIONS[direction]
        pos[0] = max(min(pos[0], dim[0] - 2), 1)
        pos[1] = max(min(pos[1], dim[1] - 2), 1)
        level[pos[0] - 1:pos[0] + 2, pos[1] - 1:pos[1] + 2] += _STAMPS[stamp[t]]
    level = level > 0
    level[:, [0, dim[1] - 1]] = False
    level[[0, dim[0] - 1], :] = False
    return level


@pytest.mark.parametrize("dim", [(6, 6), (8, 8), (7, 10)])
def test_topology_matches_gym_sokoban_walk(dim):
    rng = np.random.default_rng(0)
    steps = int(1.7 * sum(dim))
    fn = jax.jit(lambda *a: topology_from_draws(dim, *a))
    for _ in range(50):
        draws = (rng.integers(1, [dim[0], dim[1]]), rng.integers(0, 4), rng.random(steps) < 0.35,
                 rng.integers(0, 4, steps), rng.integers(0, 5, steps))
        ours = np.asarray(fn(*(jnp.asarray(d) for d in draws)))
        np.testing.assert_array_equal(ours, _reference_topology(dim, *draws))


def test_solver_optimal_on_hand_level():
    # Player must walk around the box to push it left onto the target: 2 pushes + detour.
    fixed = np.array([
        [0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 0],
        [0, 2, 1, 1, 1, 0],
        [0, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0]])
    boxes = np.zeros_like(fixed, bool)
    boxes[2, 3] = True
    assert solve(fixed, boxes, (2, 4)) == [2, 2]  # Left, Left
    assert len(solve(fixed, boxes, (1, 1))) == 6  # Right, Right, Right, Down, Left, Left
    walled = fixed.copy()
    walled[2, 2] = 0
    walled[1, 2] = 0
    walled[3, 2] = 0
    assert solve(walled, boxes, (2, 4)) is None


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_invariants(seed, actions):
    env, step = ENV, STEP[ENV]
    params = env.default_params
    _, state = env.reset(jax.random.key(seed), params)
    fixed = np.asarray(state.room_fixed)
    total = 0.0
    prev_on = 0
    for a in actions:
        _, state, reward, done, info = step(jax.random.key(0), state, a, params)
        boxes = np.asarray(state.boxes)
        player = tuple(np.asarray(state.player))
        assert boxes.sum() == env.num_boxes  # boxes conserved
        assert fixed[player] != 0 and not boxes[player]  # player on free floor
        assert not np.any(boxes & (fixed == 0))  # no box in a wall
        on = int((boxes & (fixed == 2)).sum())
        expected = -0.1 + (1.0 if on > prev_on else -1.0 if on < prev_on else 0.0) + (10.0 if on == env.num_boxes else 0.0)
        assert float(reward) == pytest.approx(expected, abs=1e-6)
        total += float(reward)
        prev_on = on
        if bool(done):
            break
    assert total >= -0.1 * len(actions) - 1.0 * env.num_boxes * len(actions)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_jit_and_vmap_match_unbatched(seed):
    env = ENV
    params = env.default_params
    # 64 rows, the batch the other tests reset (one compile); the first four are compared.
    keys = jax.random.split(jax.random.key(seed), 64)
    actions = jnp.arange(64) % 4
    obs_b, st_b = BATCHED_RESET[env](keys, params)
    out_b = BATCHED_STEP(keys, st_b, actions, params)
    for i in range(4):
        obs, s = env.reset(keys[i], params)
        np.testing.assert_array_equal(np.asarray(obs), np.asarray(obs_b[i]))
        out = env.step_env(keys[i], s, actions[i], params)  # not jitted
        for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(out_b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y[i]))


def test_gymnax_step_autoresets_and_spaces():
    env = ENV
    params = env.default_params.replace(max_steps=3)
    obs, state = env.reset(jax.random.key(0), params)
    assert env.observation_space(params).contains(obs)
    for t in range(3):
        obs, state, reward, terminated, truncated, info = env.step(jax.random.key(t), state, 0, params)
    assert bool(truncated) and int(state.time) == 0  # auto-reset after the time limit
    assert env.action_space(params).n == 4 == len(env.action_names)


def test_render_formats():
    env = ENV
    _, state = env.reset(jax.random.key(3), env.default_params)
    grid = env.render_text(state)
    rows = grid.split("\n")
    assert len(rows) == 6 and all(len(r) == 6 for r in rows)
    assert set(grid) <= set("#_O√XPS\n") and grid.count("X") == 1 and grid.count("O") == 1
    assert "P" in grid
    coord = env.render_text(state, "coord")
    assert coord.startswith("Board size: 6 rows x 6 cols (zero-indexed).")
    r, c = np.asarray(state.player)
    assert f"Player: ({r}, {c})" in coord
    both = env.render_text(state, "grid_coord")
    assert both == "Coordinates: \n" + coord + "\nGrid Map: \n" + grid
    alt = Sokoban(grid_vocab="alt").render_text(state)
    assert alt == grid.translate(str.maketrans("#_O√XPS", "W.GCBA@"))
    assert env.symbol_legend().startswith("#: wall, _: empty, O: target")


# RAGEN's SokobanEnv._render_text and its utils' coordinate lines (ragen/env/sokoban/), written
# out on gym-sokoban's arrays: room_fixed (0 wall, 1 floor, 2 target) and room_state (3 box on
# target, 4 box, 5 the player, on a target too).
RAGEN_GRID_LOOKUP = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
RAGEN_COORD_LABELS = [("walls", "Walls"), ("targets", "Targets"), ("boxes", "Boxes"),
                      ("boxes_on_target", "Boxes on target"), ("player", "Player"),
                      ("player_on_target", "Player on target")]


def ragen_sokoban_text(room_fixed: np.ndarray, room_state: np.ndarray, fmt: str) -> str:
    if fmt == "grid":
        room = np.where((room_state == 5) & (room_fixed == 2), 6, room_state)
        return "\n".join("".join(RAGEN_GRID_LOOKUP.get(c, "?") for c in row) for row in room.tolist())
    if fmt == "grid_coord":
        return ("Coordinates: \n" + ragen_sokoban_text(room_fixed, room_state, "coord") + "\n"
                + "Grid Map: \n" + ragen_sokoban_text(room_fixed, room_state, "grid"))
    cells = {"targets": [tuple(p) for p in np.argwhere(room_fixed == 2)],  # walls: not rendered
             "boxes_on_target": [tuple(p) for p in np.argwhere(room_state == 3)],
             "boxes": [tuple(p) for p in np.argwhere(room_state == 4)]}
    players = [(int(r), int(c)) for r, c in np.argwhere(room_state == 5)]
    cells["player"] = [p for p in players if room_fixed[p] != 2]
    cells["player_on_target"] = [p for p in players if room_fixed[p] == 2]
    return format_coordinate_render(cells, room_fixed.shape, RAGEN_COORD_LABELS)


@pytest.mark.parametrize("env", [ENV, ENV8], ids=["6x6-1box", "8x8-2boxes"])
def test_text_is_ragens(env):
    """Every format on random rooms with boxes and player placed at random (on and off
    targets, so every line of the coordinates shows up), against RAGEN's rules above."""
    _, states = BATCHED_RESET[env](jax.random.split(jax.random.key(5), 64), env.default_params)
    host = jax.device_get(states)
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(12):
        fixed = np.asarray(host.room_fixed[i])
        for _ in range(4):
            free = np.argwhere(fixed != 0)
            picks = free[rng.choice(len(free), env.num_boxes + 1, replace=False)]
            boxes = np.zeros(fixed.shape, bool)
            boxes[tuple(picks[1:].T)] = True
            player = picks[0]
            state = EnvState(fixed, boxes, player.astype(np.int32), np.int32(0), np.int32(0))
            room_state = np.where(boxes, np.where(fixed == 2, 3, 4), fixed)  # gym-sokoban's
            room_state[tuple(player)] = 5
            for fmt in ("grid", "coord", "grid_coord"):
                assert env.render_text(state, fmt) == ragen_sokoban_text(fixed, room_state, fmt)
            seen |= {line.split(":")[0] for line in env.render_text(state, "coord").split("\n")[1:]}
    assert seen == {"Targets", "Boxes", "Boxes on target", "Player", "Player on target"}


def test_bad_params_name_the_field():
    with pytest.raises(ValueError, match="observation_format"):
        Sokoban(observation_format="pixels")
    with pytest.raises(ValueError, match="num_boxes"):
        Sokoban(num_boxes=0)
