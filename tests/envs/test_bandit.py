"""Bandit: dynamics against a plain-Python reference, payoff statistics, names and order,
rendering, and jit/vmap/gymnax properties."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs.bandit import ALL_PAIRS, TEST_PAIRS, TRAIN_PAIRS, Bandit, EnvParams

ENV = Bandit()
PARAMS = ENV.default_params
N = 4096  # one batch size everywhere: one compilation per function

# ---- plain-Python reference ----------------------------------------------------------------


def ref_shown(low, high, hi_first):
    """The two arm names in displayed order."""
    return (high, low) if hi_first else (low, high)


def ref_pull(low, high, hi_first, action, params, jackpot):
    """Pull arm ``action`` -> (arm name, reward, success). ``jackpot``: the high arm pays."""
    arm = ref_shown(low, high, hi_first)[action]
    if arm == high:
        return arm, (params.hi_arm_score if jackpot else 0.0), True
    return arm, params.lo_arm_score, False


# ---- jitted helpers -----------------------------------------------------------------------


def reset_then_step(reset_key, step_key, action, params):
    obs0, state = ENV.reset_env(reset_key, params)
    return obs0, state, *ENV.step_env(step_key, state, action, params)


batched_episode = jax.jit(jax.vmap(reset_then_step, in_axes=(0, 0, 0, None)))


def keys_actions(seed, actions=None):
    reset_keys = jax.random.split(jax.random.key(seed), N)
    step_keys = jax.random.split(jax.random.key(seed + 1), N)
    if actions is None:
        actions = jax.random.randint(jax.random.key(seed + 2), (N,), 0, 2)
    return reset_keys, step_keys, actions


def one(tree, i):
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)


# ---- dynamics parity -----------------------------------------------------------------------


@pytest.mark.parametrize("hi_arm_prob", [0.0, 1.0])
def test_dynamics_match_reference(hi_arm_prob):
    # With hi_arm_prob 0 or 1 the payoff is deterministic, so every step compares exactly.
    params = PARAMS.replace(lo_arm_score=0.3, hi_arm_score=2.5, hi_arm_prob=hi_arm_prob)
    reset_keys, step_keys, actions = keys_actions(int(hi_arm_prob) * 10)
    obs0, state0, obs, state, reward, term, info = jax.tree.map(
        np.asarray, batched_episode(reset_keys, step_keys, actions, params))
    actions = np.asarray(actions)
    for i in range(N):
        low, high = ALL_PAIRS[int(state0.pair[i])]
        assert (low, high) in TRAIN_PAIRS
        hi_first = bool(state0.hi_first[i])
        shown = ref_shown(low, high, hi_first)
        assert ENV.action_names_for(one(state0, i)) == shown
        arm, r, success = ref_pull(low, high, hi_first, int(actions[i]), params, hi_arm_prob == 1.0)
        assert reward[i] == np.float32(r) and state.reward[i] == np.float32(r)
        assert info["success"][i] == success and info["action_is_effective"][i]
        assert term[i] and state.time[i] == 1 and state.pulled[i] == actions[i]
        assert ENV.render_text(one(state, i)) == f"{arm}: {round(float(np.float32(r)), 4)} points"
        assert obs0[i, 2] == -1 and obs[i, 2] == actions[i]
        assert list(obs[i, :2]) == list(obs0[i, :2])
        # name ids: 2 * pair + (1 for the high-risk arm), in displayed order
        ids = [2 * int(state0.pair[i]) + (name == high) for name in shown]
        assert list(obs0[i, :2]) == ids


# ---- payoffs and names ---------------------------------------------------------------------


def test_payoff_means_within_binomial_bounds():
    reset_keys, step_keys, actions = keys_actions(100)
    _, state0, *_ = batched_episode(reset_keys, step_keys, actions, PARAMS)
    hi_action = jnp.where(state0.hi_first, 0, 1)
    rewards, successes = [], []
    for actions in (hi_action, 1 - hi_action):
        *_, reward, _, info = batched_episode(reset_keys, step_keys, actions, PARAMS)
        rewards.append(np.asarray(reward))
        successes.append(np.asarray(info["success"]))
    hi, lo = rewards
    assert set(np.unique(hi).tolist()) == {0.0, 1.0}
    q = PARAMS.hi_arm_prob
    assert abs(hi.mean() - q) < 5 * math.sqrt(q * (1 - q) / N)
    np.testing.assert_array_equal(lo, np.float32(0.1))
    assert successes[0].all() and not successes[1].any()
    # Another payoff probability is honoured too (params are traced, not baked in).
    *_, reward, _, _ = batched_episode(reset_keys, step_keys, hi_action,
                                       PARAMS.replace(hi_arm_prob=0.6))
    assert abs(np.asarray(reward).mean() - 0.6) < 5 * math.sqrt(0.6 * 0.4 / N)


@pytest.mark.parametrize("split, pairs", [("train", TRAIN_PAIRS), ("test", TEST_PAIRS)])
def test_names_and_order(split, pairs):
    env = Bandit(split=split)
    keys = jax.random.split(jax.random.key(7), N)
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
    _, a = reset(keys, PARAMS)
    _, b = reset(keys, PARAMS)
    np.testing.assert_array_equal(a.pair, b.pair)  # same key -> same names and order
    np.testing.assert_array_equal(a.hi_first, b.hi_first)
    assert env.pairs == pairs
    seen = {ALL_PAIRS[int(p)] for p in np.asarray(a.pair)}
    assert seen == set(pairs)  # every pair of the split occurs, and no other
    hi_first = np.asarray(a.hi_first).mean()
    assert abs(hi_first - 0.5) < 5 * math.sqrt(0.25 / N)  # both orders, about 50/50
    names = {env.action_names_for(one(a, i)) for i in range(200)}
    assert {tuple(sorted(n)) for n in names} <= {tuple(sorted(p)) for p in pairs}


def test_train_and_test_names_are_disjoint():
    assert len(TRAIN_PAIRS) == 12 and len(TEST_PAIRS) == 8
    train = {name for pair in TRAIN_PAIRS for name in pair}
    test = {name for pair in TEST_PAIRS for name in pair}
    assert len(train) == 24 and len(test) == 16
    assert not train & test
    assert not {"Phoenix", "Dragon"} & (train | test)


def test_phoenix_dragon_variant():
    env = Bandit(variant="phoenix_dragon")
    keys = jax.random.split(jax.random.key(3), 200)
    _, states = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))(keys, PARAMS)
    orders = {env.action_names_for(one(states, i)) for i in range(200)}
    assert orders == {("Phoenix", "Dragon"), ("Dragon", "Phoenix")}
    state = one(states, 0)
    dragon = env.action_names_for(state).index("Dragon")
    for action, success in ((dragon, True), (1 - dragon, False)):
        _, after, reward, _, info = env.step_env(jax.random.key(0), state, action, PARAMS)
        assert bool(info["success"]) == success
        if not success:
            assert env.render_text(after) == "Phoenix: 0.1 points"


# ---- rendering, spaces, construction -------------------------------------------------------


def test_render_before_and_after_the_pull():
    _, state = ENV.reset(jax.random.key(0), PARAMS)
    first, second = ENV.action_names_for(state)
    prompt = ENV.render_text(state)
    assert first in prompt and second in prompt and prompt.index(first) < prompt.index(second)
    assert "arm" in prompt and "?" in prompt
    state_np = jax.tree.map(np.asarray, state)
    after = state_np.replace(pulled=np.int32(1), reward=np.float32(1.0))
    assert ENV.render_text(after) == f"{second}: 1.0 points"
    after = state_np.replace(pulled=np.int32(0), reward=np.float32(0.0))
    assert ENV.render_text(after) == f"{first}: 0.0 points"


def test_spaces_and_constructor():
    obs, state = ENV.reset(jax.random.key(1), PARAMS)
    assert ENV.action_space(PARAMS).n == 2 == ENV.num_actions == len(ENV.action_names)
    assert bool(ENV.observation_space(PARAMS).contains(obs))
    obs, state, *_ = ENV.step_env(jax.random.key(2), state, 1, PARAMS)
    assert bool(ENV.observation_space(PARAMS).contains(obs))
    space = ENV.state_space(PARAMS).spaces
    for name in ("pair", "pulled", "reward", "time"):
        assert bool(space[name].contains(getattr(state, name)))
    with pytest.raises(ValueError):
        Bandit(split="val")
    with pytest.raises(ValueError):
        Bandit(variant="dragons")


def test_make_builds_bandit():
    pytest.importorskip("ragen_jax.envs.sokoban")
    from ragen_jax.envs.registry import make

    env, params = make("bandit", split="test")
    assert isinstance(env, Bandit) and env.split == "test" and env.pairs == TEST_PAIRS
    assert params == EnvParams()
    env, params = make("bandit", variant="phoenix_dragon", hi_arm_prob=0.5)
    assert env.variant == "phoenix_dragon" and params.hi_arm_prob == 0.5


def test_make_shares_one_env_object_per_class_and_settings():
    """An env holds no state, so ``make`` gives equal constructor settings one object (its
    jitted rollout functions then compile once per process); settings that differ, in value
    or only in type, get their own; env params (traced values) never matter."""
    pytest.importorskip("ragen_jax.envs.sokoban")
    from ragen_jax.envs.registry import _frozen, make
    from ragen_jax.envs.sokoban.env import Sokoban

    env, params = make("bandit", split="test", hi_arm_prob=0.5)
    again, other_params = make("bandit", split="test", hi_arm_prob=0.25)
    assert again is env and other_params.hi_arm_prob == 0.25 and params.hi_arm_prob == 0.5
    assert make("bandit", split="train")[0] is not env
    room = make("sokoban", dim_room=[6, 6], num_boxes=1)[0]
    assert isinstance(room, Sokoban) and room.dim_room == (6, 6)
    assert make("sokoban", dim_room=(6, 6), num_boxes=1)[0] is room  # a config's list, a tuple
    assert make("sokoban", dim_room=(6, 7), num_boxes=1)[0] is not room
    assert make("frozenlake", size=5)[0] is make("frozenlake", size=5, is_slippery=False)[0]
    assert _frozen(True) != _frozen(1) != _frozen(1.0) and _frozen([6, 6]) == _frozen((6, 6))


# ---- properties ----------------------------------------------------------------------------

jit_reset_then_step = jax.jit(reset_then_step)
small_batch = jax.jit(jax.vmap(reset_then_step, in_axes=(0, 0, 0, None)))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(st.integers(0, 1), min_size=3, max_size=3))
def test_jit_and_vmap_match_unbatched(seed, actions):
    reset_keys = jax.random.split(jax.random.key(seed), 3)
    step_keys = jax.random.split(reset_keys[0], 3)
    batched = small_batch(reset_keys, step_keys, jnp.array(actions), PARAMS)
    plain = reset_then_step(reset_keys[0], step_keys[0], actions[0], PARAMS)  # eager
    assert_trees_equal(plain, jit_reset_then_step(reset_keys[0], step_keys[0], actions[0], PARAMS))
    for i in range(3):
        jitted = jit_reset_then_step(reset_keys[i], step_keys[i], actions[i], PARAMS)
        assert_trees_equal(jitted, jax.tree.map(lambda x, i=i: x[i], batched))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), action=st.integers(0, 1))
def test_gymnax_step_auto_resets(seed, action):
    key = jax.random.key(seed)
    obs, state = ENV.reset(key, PARAMS)
    key_step = jax.random.fold_in(key, 1)
    obs, new, reward, term, trunc, info = ENV.step(key_step, state, action, PARAMS)
    k_step, k_reset = jax.random.split(key_step)
    expected_obs, expected = ENV.reset(k_reset, PARAMS)
    assert bool(term) and bool(trunc)  # one pull ends the episode, and max_steps is 1
    assert_trees_equal((obs, new), (expected_obs, expected))
    assert int(new.pulled) == -1 and int(info["final_observation"][2]) == action
    obs_st, _, reward_st, _, _ = ENV.step_env(k_step, state, action, PARAMS)
    assert float(reward) == float(reward_st)
    np.testing.assert_array_equal(info["final_observation"], obs_st)


def test_the_envs_import_gymnaxs_base_modules_alone_and_gymnax_sees_the_same_ones():
    """An env here loads gymnax's ``environment`` and ``spaces`` without gymnax's package
    ``__init__`` (all of gymnax's envs, seaborn and scipy.stats: ~4 s a process); a later
    ``import gymnax`` finds those same modules, so our envs are its ``Environment``s."""
    code = ("import sys\n"
            "import ragen_jax.envs.bandit, ragen_jax.envs.sokoban.env\n"
            "assert 'gymnax' not in sys.modules and 'seaborn' not in sys.modules\n"
            "from ragen_jax.envs.base import TextEnv\n"
            "from ragen_jax.envs.gymnax_base import spaces as ours\n"
            "import gymnax\n"
            "from gymnax.environments import environment, spaces\n"
            "assert issubclass(TextEnv, environment.Environment) and spaces is ours\n"
            "env, params = gymnax.make('CartPole-v1')\n"
            "assert isinstance(env, environment.Environment)\n"
            "assert isinstance(ragen_jax.envs.bandit.Bandit().action_space(), spaces.Discrete)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
