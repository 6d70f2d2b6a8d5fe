"""Level identity (``envs.levels``) and held-out validation: a training or prior-data reset
never plays a validation level (nor, for Sokoban, a validation room; for FrozenLake in grid
text, a validation map), compared by the levels' states themselves, not their hashes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import levels, make
from ragen_jax.envs.sokoban.types import EnvState
from ragen_jax.rollout.env_driver import JaxEnvDriver, row_state
from ragen_jax.rollout.host_driver import HostEnvDriver

# The Sokoban sizes test_held_out_rooms.py trains at, reset at the same validation seeds: the
# same reset programs (the costly generator), read back from the session's compile cache.
JAX_ENVS = {
    "sokoban-6x6-1": ("sokoban", dict(dim_room=(6, 6), num_boxes=1)),
    "sokoban-8x8-2": ("sokoban", dict(dim_room=(8, 8), num_boxes=2)),
    "frozenlake-4": ("frozenlake", dict(size=4)),
}
VAL = 123 + np.arange(256)  # the presets' validation seeds
TRAIN = 2**30 + np.arange(256)  # the warm-start data's seed range (one shape: one compile)


def exact_levels(env, host, n: int, fields=None) -> list[bytes]:
    """Each row's level fields (or ``fields(state)``, e.g. ``env.holdout_fields``) as bytes:
    the ground truth the hashes are checked against."""
    fields = fields or env.level
    return [b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(fields(row_state(host, b))))
            for b in range(n)]


@pytest.fixture(scope="module", params=list(JAX_ENVS))
def jax_env(request):
    name, params = JAX_ENVS[request.param]
    return request.param, *make(name, **params)


def test_level_ids_partition_levels_exactly_as_their_states_do(jax_env):
    name, env, params = jax_env
    out = JaxEnvDriver(env, params, 1).reset(np.arange(256))
    distinct = {}
    for ids, fields in ((out.levels, env.level), (out.holdout, env.holdout_fields)):
        exact = exact_levels(env, out.host, 256, fields)
        by_id = {}
        for level_id, key in zip(ids.tolist(), exact, strict=True):
            assert by_id.setdefault(level_id, key) == key, f"{name}: two levels share an id"
        assert len(by_id) == len(set(exact))
        distinct[fields.__name__] = len(by_id)
    assert distinct["level"] < 256 or name != "frozenlake-4"  # FrozenLake 4x4 repeats maps
    # Held out by room (Sokoban) or by map without its start (FrozenLake, grid): coarser.
    assert distinct["holdout_fields"] <= distinct["level"]
    assert distinct["holdout_fields"] < distinct["level"] or name == "sokoban-8x8-2"


def test_frozenlake_holds_out_its_map_in_grid_text_and_its_level_in_coordinates():
    """Grid text does not show the start (a state with another start reads the same), so
    held out are holes and goal; coordinate text names the start, so there the level."""
    grid, params = make("frozenlake", size=4)
    coord, _ = make("frozenlake", size=4, observation_format="coord")
    host = JaxEnvDriver(grid, params, 1).reset(VAL[:8]).host
    for b in range(8):
        state = row_state(host, b)
        moved = state.replace(start=(np.asarray(state.start) + 1) % 4)
        assert grid.render_text(moved) == grid.render_text(state)
        assert coord.render_text(moved) != coord.render_text(state)
        assert [np.asarray(x).tolist() for x in grid.holdout_fields(state)] == [
            np.asarray(state.holes).tolist(), np.asarray(state.goal).tolist()]
    out = JaxEnvDriver(coord, params, 1).reset(VAL)
    np.testing.assert_array_equal(out.holdout, out.levels)


def test_held_out_resets_never_play_a_validation_level(jax_env):
    """Nor, for Sokoban, a validation level's room (what it holds out)."""
    name, env, params = jax_env
    driver = JaxEnvDriver(env, params, 1)
    val = driver.reset(VAL)
    plain = driver.reset(TRAIN)
    val_keys = set(exact_levels(env, val.host, len(VAL), env.holdout_fields))
    seen = np.array([k in val_keys for k in exact_levels(env, plain.host, len(TRAIN),
                                                         env.holdout_fields)])
    if name in ("sokoban-6x6-1", "frozenlake-4"):  # small generators: seed ranges overlap
        assert seen.sum() > 3, f"{name}: expected validation levels among training seeds"
    driver.hold_out(val.holdout)
    held = driver.reset(TRAIN)
    assert not any(k in val_keys for k in exact_levels(env, held.host, len(TRAIN),
                                                       env.holdout_fields))
    assert not (set(exact_levels(env, val.host, len(VAL)))
                & set(exact_levels(env, held.host, len(TRAIN))))
    # Exactly the rows that met a held-out one were drawn again; the others are unchanged.
    np.testing.assert_array_equal(held.redraws > 0, seen)
    np.testing.assert_array_equal(held.levels[~seen], plain.levels[~seen])
    # Validation itself still plays its own levels.
    np.testing.assert_array_equal(driver.reset(VAL, held_out=False).levels, val.levels)


def test_a_redrawn_group_still_shares_one_level():
    name, params = JAX_ENVS["sokoban-6x6-1"]
    env, params = make(name, **params)
    driver = JaxEnvDriver(env, params, 1)
    plain = driver.reset(TRAIN)
    driver.hold_out(driver.reset(VAL).holdout)
    rows = driver.reset(np.repeat(TRAIN[:64], 4))
    assert (rows.redraws > 0).any()
    np.testing.assert_array_equal(rows.levels.reshape(64, 4), np.repeat(rows.levels[::4, None], 4, 1))
    assert (rows.levels[::4] != plain.levels[:64]).sum() == (rows.redraws[::4] > 0).sum()


def test_a_generator_too_small_to_hold_out_is_a_clear_error():
    env, params = make("bandit", split="train")
    driver = JaxEnvDriver(env, params, 1)
    driver.hold_out(driver.reset(np.arange(256)).holdout)  # every pair and order
    with pytest.raises(levels.HeldOutError, match="rollout.val.held_out=False"):
        driver.reset(1000 + np.arange(8))


def test_bandit_test_names_are_never_training_levels():
    train, params = make("bandit", split="train")
    test, _ = make("bandit", split="test")
    a = JaxEnvDriver(train, params, 1).reset(np.arange(512)).levels
    b = JaxEnvDriver(test, params, 1).reset(np.arange(512)).levels
    assert not set(a.tolist()) & set(b.tolist())


_SOKOBAN = make("sokoban", dim_room=(6, 6), num_boxes=1)[0]
_hash = jax.jit(lambda room, boxes, player: levels.level_hash(_SOKOBAN, EnvState(
    room_fixed=room, boxes=boxes, player=player, boxes_on_target=jnp.int32(0), time=jnp.int32(0))))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 35))
def test_changing_any_one_cell_changes_the_id(seed, cell):
    rng = np.random.default_rng(seed)
    room = rng.integers(0, 3, (6, 6)).astype(np.int8)
    boxes = rng.random((6, 6)) < 0.2
    player = rng.integers(0, 6, 2).astype(np.int32)
    same = levels.as_uint64(_hash(room.copy(), boxes.copy(), player.copy()))
    assert same == levels.as_uint64(_hash(room, boxes, player))
    flipped = boxes.copy()
    flipped.flat[cell] ^= True
    assert levels.as_uint64(_hash(room, flipped, player)) != same
    room2 = room.copy()
    room2.flat[cell] = (room2.flat[cell] + 1) % 3
    assert levels.as_uint64(_hash(room2, boxes, player)) != same


def test_ids_round_trip_through_device_lanes():
    ids = np.array([0, 1, 2**32, 2**64 - 1, 0x0123456789ABCDEF], np.uint64)
    np.testing.assert_array_equal(levels.as_uint64(levels.as_lanes(ids)), ids)
    np.testing.assert_array_equal(levels.as_uint64(jnp.asarray(levels.as_lanes(ids))), ids)


@pytest.mark.parametrize("name,params,puzzle", [
    ("countdown", dict(), lambda e: repr(e.puzzle)),
    ("sudoku", dict(size=4, difficulty="easy"), lambda e: e.puzzle.tobytes()),
])
def test_host_env_resets_never_play_a_validation_level(name, params, puzzle):
    """Read on the instances themselves, so in this process (``isolation="thread"``); the
    worker-process driver plays the same levels with the same redraws."""
    family, _ = make(name, isolation="thread", **params)
    driver = HostEnvDriver(family)

    def played(seeds, **kw):
        out = driver.reset(seeds, **kw)
        return out, [puzzle(s.env) for s in out.states]

    val, val_puzzles = played(VAL)
    plain, plain_puzzles = played(TRAIN)
    seen = np.array([p in set(val_puzzles) for p in plain_puzzles])
    driver.hold_out(val.holdout)
    held, held_puzzles = played(TRAIN)
    assert not set(held_puzzles) & set(val_puzzles)
    np.testing.assert_array_equal(held.redraws > 0, seen)
    in_workers = HostEnvDriver(make(name, **params)[0])
    in_workers.hold_out(val.holdout)
    out = in_workers.reset(TRAIN)
    np.testing.assert_array_equal(out.levels, held.levels)
    np.testing.assert_array_equal(out.redraws, held.redraws)
    assert [s.text for s in out.states] == [s.text for s in held.states]
    in_workers.close()


def test_redraw_seeds_are_fixed_and_spread():
    assert levels.redraw_seed(5, 0) == 5
    assert levels.redraw_seed(5, 1) == levels.redraw_seed(5, 1)
    seeds = {levels.redraw_seed(s, d) for s in range(100) for d in range(1, 4)}
    assert len(seeds) == 300 and all(0 <= s < 2**31 for s in seeds)
