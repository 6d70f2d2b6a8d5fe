"""The 2x2 Rubik's cube: moves against a plain-Python reference (RAGEN's sticker swaps), group
properties, RAGEN's non-physical B against a real cube, rewards, RAGEN's text, levels, and the
BFS solver (optimal, and it solves)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs.rubiks import SOLVED, EnvState, RubiksCube, move_table, scramble_move

ENV = RubiksCube()
PHYSICAL = RubiksCube(moves="physical")
PARAMS = ENV.default_params

# ---- plain-Python reference (RAGEN's RubiksCube2x2Env moves, as sticker swaps) --------------


def _face_cw(s, f):
    b = 4 * f
    s[b], s[b + 1], s[b + 3], s[b + 2] = s[b + 2], s[b], s[b + 1], s[b + 3]


def _cycle(s, groups):
    """``groups`` = [g0, g1, g2, g3]: g0 takes g1's stickers, g1 g2's, g2 g3's, g3 g0's."""
    old = [[s[i] for i in g] for g in groups]
    for k, g in enumerate(groups):
        for i, v in zip(g, old[(k + 1) % 4], strict=True):
            s[i] = v


# Per face: (its index in U L F R B D, the four sticker groups cycled around it).
REF_SIDES = {
    "U": (0, [(8, 9), (12, 13), (16, 17), (4, 5)]),
    "D": (5, [(10, 11), (6, 7), (18, 19), (14, 15)]),
    "L": (1, [(0, 2), (19, 17), (20, 22), (8, 10)]),
    "R": (3, [(1, 3), (9, 11), (21, 23), (18, 16)]),
    "F": (2, [(2, 3), (7, 5), (21, 20), (12, 14)]),
    # RAGEN's B: its middle two assignments take the stickers in reverse order ...
    "B": (4, [(0, 1), (13, 15), (22, 23), (6, 4)]),
}
REF_PHYSICAL_B = (4, [(0, 1), (13, 15), (23, 22), (6, 4)])  # ... B on a real cube


def ref_turn(s, face, physical=False):
    """One clockwise turn of ``face`` (U D L R F B) on the sticker list ``s``, in place."""
    index, sides = REF_PHYSICAL_B if physical and face == "B" else REF_SIDES[face]
    _face_cw(s, index)
    _cycle(s, sides)


def ref_apply(s, action, physical=False):
    """Action 0-11 (U U' D D' L L' R R' F F' B B'): a prime is three clockwise turns."""
    face = "UDLRFB"[action // 2]
    for _ in range(3 if action % 2 else 1):
        ref_turn(s, face, physical)


def ref_solved(s):
    return all(len(set(s[4 * f: 4 * f + 4])) == 1 for f in range(6))


# Corners as (sticker, sticker, sticker) positions; a real turn moves whole corners.
CORNERS = [(2, 8, 5), (3, 9, 12), (1, 13, 16), (0, 17, 4),
           (20, 10, 7), (21, 11, 14), (23, 15, 18), (22, 19, 6)]


def corner_colours(s):
    return sorted(tuple(sorted(int(s[i]) for i in c)) for c in CORNERS)


# ---- jitted helpers ----------------------------------------------------------------------

T = 30


def make_rollout(env):
    @jax.jit
    def rollout(key, params, actions):
        _, state = env.reset_env(key, params)

        def body(state, action):
            _, new, reward, term, info = env.step_env(key, state, action, params)
            return new, (new, reward, term, info)

        return state, jax.lax.scan(body, state, actions)[1]

    return rollout


ROLLOUT = {"ragen": make_rollout(ENV), "physical": make_rollout(PHYSICAL)}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(st.integers(0, 11), min_size=T, max_size=T),
       moves=st.sampled_from(["ragen", "physical"]), depth=st.integers(0, 6))
def test_scramble_and_steps_match_the_reference(seed, actions, moves, depth):
    params = PARAMS.replace(scramble_depth=depth)
    key = jax.random.key(seed)
    start, (post, reward, term, info) = jax.tree.map(
        np.asarray, ROLLOUT[moves](key, params, jnp.array(actions)))
    physical = moves == "physical"
    s = SOLVED.tolist()
    for i in range(depth):
        ref_apply(s, int(scramble_move(key, i)), physical)
    assert start.stickers.tolist() == s and int(start.time) == 0
    for t, a in enumerate(actions):
        ref_apply(s, a, physical)
        assert post.stickers[t].tolist() == s
        solved = ref_solved(s)
        assert bool(term[t]) == solved == bool(info["success"][t])
        assert reward[t] == float(solved)
        assert bool(info["action_is_effective"][t]) and int(post.time[t]) == t + 1
        assert sorted(s) == sorted(SOLVED.tolist())  # colours permuted, never created


@pytest.mark.parametrize("moves", ["ragen", "physical"])
def test_group_properties(moves):
    table = move_table(moves)
    ident = np.arange(24)
    for face in range(6):
        cw, ccw = table[2 * face], table[2 * face + 1]
        assert sorted(cw.tolist()) == ident.tolist()  # a permutation
        x = ident
        for k in range(1, 5):
            x = x[cw]
            assert (x == ident).all() == (k == 4)  # order exactly 4
        assert (ident[cw][ccw] == ident).all() and (ident[ccw][cw] == ident).all()
    # Opposite faces turned against each other turn the whole cube: still solved.
    for a, b in ((0, 3), (4, 7), (8, 11)):  # U D', L R', F B'
        assert ref_solved(SOLVED[table[a]][table[b]].tolist())


@settings(max_examples=40, deadline=None)
@given(seq=st.lists(st.integers(0, 11), min_size=1, max_size=25),
       moves=st.sampled_from(["ragen", "physical"]))
def test_a_scramble_then_its_inverse_is_solved(seq, moves):
    env = ENV if moves == "ragen" else PHYSICAL
    stickers = jnp.asarray(SOLVED)
    for a in seq:
        stickers = env.apply(stickers, a)
    for a in reversed(seq):
        stickers = env.apply(stickers, a ^ 1)  # ids 2k and 2k+1 are a move and its inverse
    np.testing.assert_array_equal(np.asarray(stickers), SOLVED)


def test_ragens_b_breaks_corners_and_the_physical_one_does_not():
    rng = np.random.default_rng(0)
    solved_corners = corner_colours(SOLVED)
    broken = 0
    for _ in range(20):
        s = SOLVED.tolist()
        for a in rng.integers(0, 12, 30):
            ref_apply(s, int(a), physical=True)
        assert corner_colours(s) == solved_corners  # real turns keep every corner whole
        ref_apply(s, 10)  # RAGEN's B from a (real) scrambled cube
        broken += corner_colours(s) != solved_corners
    assert broken >= 15


def test_rewards_truncation_and_render():
    one_move = EnvState(stickers=jnp.asarray(SOLVED)[jnp.asarray(move_table()[0])],
                        time=jnp.int32(0), max_steps=jnp.int32(20))
    text = ENV.render_text(one_move)
    assert text == (
        "=== Rubik's Cube 2x2 State ===\nStep: 0/20\n\n"
        "Up (U):    [W, W]\n [W, W]\nLeft (L):  [G, G]\n [O, O]\n"
        "Front (F): [R, R]\n [G, G]\nRight (R): [B, B]\n [R, R]\n"
        "Back (B):  [O, O]\n [B, B]\nDown (D):  [Y, Y]\n [Y, Y]\n\n"
        "Available Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?")
    step = jax.jit(ENV.step_env)
    _, wrong, reward, term, _ = step(jax.random.key(0), one_move, 0, PARAMS)  # U again
    assert float(reward) == 0.0 and not bool(term)
    _, solved, reward, term, info = step(jax.random.key(0), one_move, 1, PARAMS)  # U'
    assert float(reward) == 1.0 and bool(term) and bool(info["success"])
    assert ENV.render_text(solved).endswith("\n\n=== Game Over: Cube Solved! ===")
    late = wrong.replace(time=jnp.int32(20))
    assert bool(ENV.is_truncated(late, PARAMS))
    assert ENV.render_text(late).endswith("=== Game Over: Max steps reached. ===")
    assert ENV.action_names[1] == "U'" and ENV.num_actions == 12
    assert ENV.instruction.startswith("You are solving a 2x2 Rubik's Cube (Pocket Cube).")


def test_make_spaces_and_levels():
    from ragen_jax.envs import levels, make

    env, params = make("rubikscube", moves="physical", scramble_depth=5, max_steps=30)
    assert isinstance(env, RubiksCube) and env.moves == "physical"
    assert params.scramble_depth == 5 and params.max_steps == 30
    with pytest.raises(ValueError):
        RubiksCube(moves="mirror")
    keys = jax.random.split(jax.random.key(0), 512)
    reset = jax.jit(jax.vmap(ENV.reset_env, in_axes=(0, None)))
    obs, states = reset(keys, PARAMS)
    assert bool(ENV.observation_space(PARAMS).contains(obs[0]))
    one = jax.tree.map(lambda x: x[0], states)
    for name, space in ENV.state_space(PARAMS).spaces.items():
        assert bool(space.contains(getattr(one, name))), name
    ids = levels.as_uint64(jax.vmap(lambda s: levels.level_hash(ENV, s))(states))
    assert len(set(ids.tolist())) == 12  # depth 1: the 12 one-move cubes, hence held_out_val=False
    _, deep = reset(keys, PARAMS.replace(scramble_depth=5))
    assert len({np.asarray(s).tobytes() for s in deep.stickers}) > 400


# ---- the BFS solver --------------------------------------------------------------------------


def shortest_by_brute_force(stickers, moves, up_to):
    """The length of a shortest solving sequence of at most ``up_to`` moves, or None."""
    table = move_table(moves)
    for length in range(up_to + 1):
        for seq in itertools.product(range(12), repeat=length):
            s = np.asarray(stickers)
            for a in seq:
                s = s[table[a]]
            if ref_solved(s.tolist()):
                return length
    return None


@pytest.mark.parametrize("moves", ["ragen", "physical"])
def test_solver_is_optimal_within_the_scramble_depth_and_solves(moves):
    from ragen_jax.envs import solvers
    from ragen_jax.envs.rubiks_solver import solve

    env = ENV if moves == "ragen" else PHYSICAL
    step = jax.jit(env.step_env)
    rng = np.random.default_rng(1)
    lengths = []
    for depth in (1, 2, 3, 4, 5, 5, 5, 6):
        for _ in range(3 if depth < 5 else 2):
            scramble = rng.integers(0, 12, depth)
            state = EnvState(stickers=jnp.asarray(SOLVED), time=jnp.int32(0), max_steps=jnp.int32(20))
            for a in scramble:
                state = state.replace(stickers=env.apply(state.stickers, int(a)))
            path = solvers.solve(env, state)
            assert path == solve(np.asarray(state.stickers), moves)
            assert len(path) <= depth
            lengths.append(len(path))
            if len(path) <= 3:  # optimal: nothing shorter solves (brute force)
                assert shortest_by_brute_force(state.stickers, moves, len(path)) == len(path)
            for j, a in enumerate(path):  # replayed in the env, solved at the last move only
                _, state, reward, term, _ = step(jax.random.key(0), state, a, PARAMS)
                assert bool(term) == (j == len(path) - 1) and float(reward) == float(bool(term))
    assert max(lengths) >= 4  # some scrambles were not trivially undone
    assert solve(SOLVED) == [] and solve(SOLVED[move_table()[0]], max_depth=0) is None
