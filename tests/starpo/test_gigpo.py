"""GiGPO (``adv_estimator=gigpo``): per-turn advantages against hand-computed values, its
reduction to the episode part without repeated states, parity with verl-agent (cases derived
by running its code, and random cases against its algorithm written out here) on both
statistics paths and both penalty placements, the rollout's anchor ids, and the update's rows
(both units, filtering, env errors)."""

from __future__ import annotations

import dataclasses
import difflib
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import levels, make
from ragen_jax.models import tokenizer as tk
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.batch import Episode
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.sharding import make_mesh
from ragen_jax.starpo import advantages as A
from ragen_jax.starpo.anchors import anchored_turns, turn_table
from ragen_jax.starpo.estimators import AdvantageSettings
from ragen_jax.starpo.rows import RowSettings, build_step_batch
from ragen_jax.starpo.update import step_advantages

# Compiled: one program a shape, where op by op every call dispatches (and first compiles)
# each of its hundreds of small ops.
_gigpo = jax.jit(A.gigpo, static_argnames=("num_groups", "norm_by_std", "episode_stats"))
_grpo = jax.jit(A.grpo, static_argnames=("num_groups", "norm_by_std"))


def lanes(ids) -> np.ndarray:
    """Anchor ids ``[E, T]`` (small ints) as hash lanes ``[E, T, 2]``."""
    ids = np.asarray(ids, np.uint64)
    return levels.as_lanes(ids.reshape(-1)).reshape(*ids.shape, 2)


# -- the pure estimator ------------------------------------------------------------------------

# Four episodes of two turns (gamma 0.5): anchors A=1, B=2, D=4; episode 1 stays in A
# (a push into a wall), episode 3 plays one turn, episode 4 is an env error (group -1) that
# acted from A with a large return: it must change nothing.
HAND = dict(
    scores=np.array([1.0, 0.0, 1.0, 1.0, 9.0], np.float32),
    group_ids=np.array([0, 0, 1, 1, -1], np.int32),
    rewards=np.array([[0, 1], [0, 0], [0, 1], [1, 0], [9, 0]], np.float32),
    anchors=lanes([[1, 2], [1, 1], [1, 4], [1, 0], [1, 1]]),
    played=np.array([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1]], bool))


@pytest.mark.parametrize("norm_by_std,want", [
    # Returns: ep0 [0 + .5 * 1, 1] = [.5, 1], ep1 [0, 0], ep2 [.5, 1], ep3 [1].
    # Episode part (mean): group 0 scores 1, 0 -> +.5, -.5; group 1 scores 1, 1 -> 0, 0.
    # Step part: group 0's A holds ep0 t1 (.5), ep1 t1 and t2 (0, 0): mean 1/6 -> +1/3,
    # -1/6, -1/6; B (ep0 t2) alone -> 0. Group 1's A (another group's A: apart) holds ep2 t1
    # (.5) and ep3 t1 (1): mean .75 -> -.25, +.25; D alone -> 0.
    (False, [[0.5 + 1 / 3, 0.5], [-0.5 - 1 / 6, -0.5 - 1 / 6], [-0.25, 0.0], [0.25, 0.0],
             [0.0, 0.0]]),
    # With the std (unbiased): episode group 0 std sqrt(.5) -> +-.707107; group 1 std 0 ->
    # 0 / eps = 0. Step group 0's A: deviations 1/3, -1/6, -1/6, var (1/9 + 2/36) / 2 = 1/12,
    # std .288675 -> 1.154701, -.577350, -.577350; group 1's A: std .353553 -> -+.707107.
    (True, [[0.707107 + 1.154701, 0.707107], [-0.707107 - 0.577350] * 2, [-0.707107, 0.0],
            [0.707107, 0.0], [0.0, 0.0]]),
])
def test_gigpo_by_hand(norm_by_std, want):
    h = HAND
    got = _gigpo(jnp.asarray(h["scores"]), jnp.asarray(h["group_ids"]), 2,
                  jnp.asarray(h["rewards"]), jnp.asarray(h["anchors"]), jnp.asarray(h["played"]),
                  gamma=0.5, norm_by_std=norm_by_std)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_step_weight_scales_only_the_step_part():
    h = {k: jnp.asarray(v) for k, v in HAND.items()}
    args = (h["scores"], h["group_ids"], 2, h["rewards"], h["anchors"], h["played"])
    full, none = _gigpo(*args, gamma=0.5, norm_by_std=False), _gigpo(
        *args, gamma=0.5, step_weight=0.0, norm_by_std=False)
    half = _gigpo(*args, gamma=0.5, step_weight=0.5, norm_by_std=False)
    np.testing.assert_allclose(np.asarray(half), (np.asarray(full) + np.asarray(none)) / 2,
                               atol=1e-6)
    # Without the step part: Dr.GRPO's episode advantage on every played turn.
    episode = _grpo(h["scores"], h["group_ids"], 2, norm_by_std=False)
    np.testing.assert_allclose(np.asarray(none),
                               np.asarray(episode)[:, None] * HAND["played"] * (HAND["group_ids"] >= 0)[:, None],
                               atol=1e-6)


EPISODES, TURNS_MAX, GROUPS_MAX = 12, 5, 4


@settings(max_examples=40, deadline=None)
@given(data=st.data(), norm_by_std=st.booleans(), gamma=st.floats(0.0, 1.0))
def test_without_repeated_states_gigpo_is_its_episode_part(data, norm_by_std, gamma):
    """No anchor repeats within a group (ids may repeat across groups: other groups' turns
    are never compared), so every step group is a single turn and GiGPO's advantage is the
    episode's GRPO / Dr.GRPO advantage on each played turn, whatever the rewards. (One shape,
    one compile: the episodes' groups, turn counts, scores and rewards vary.)"""
    n, t = EPISODES, TURNS_MAX
    group_ids = np.array(data.draw(st.lists(st.integers(-1, GROUPS_MAX - 1), min_size=n,
                                            max_size=n)), np.int32)
    scores = np.array(data.draw(st.lists(st.floats(-5, 5, width=32), min_size=n, max_size=n)),
                      np.float32)
    rewards = np.array(data.draw(st.lists(st.floats(-2, 2, width=32), min_size=n * t,
                                          max_size=n * t)), np.float32).reshape(n, t)
    counts = np.array(data.draw(st.lists(st.integers(0, t), min_size=n, max_size=n)))
    played = np.arange(t)[None, :] < counts[:, None]
    # Unique within each group (by the episode's rank in it), the same ids in every group.
    rank = np.array([np.sum(group_ids[:i] == group_ids[i]) for i in range(n)])
    ids = rank[:, None] * t + np.arange(t)[None, :] + 1
    got = _gigpo(scores, group_ids, GROUPS_MAX, rewards, lanes(ids), played, gamma=gamma,
                 norm_by_std=norm_by_std)
    episode = np.asarray(_grpo(scores, group_ids, GROUPS_MAX, norm_by_std=norm_by_std))
    want = np.where(played & (group_ids >= 0)[:, None], episode[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


# -- parity with verl-agent --------------------------------------------------------------------

def _episodes(steps_per_episode, penalty: float = 0.0) -> list[Episode]:
    """Host-env episodes (text anchors) from ``[(reward, observation text[, invalid]), ...]``
    lists; an invalid step's turn carries ``penalty`` (ragen_jax's format penalty)."""
    return [Episode(text_anchors=True, turns=[
        {"turn": t + 1, "reward": step[0], "penalty": penalty if _invalid(step) else 0.0,
         "state": step[1], "anchor": int(levels.text_level_id(step[1]))}
        for t, step in enumerate(steps)]) for steps in steps_per_episode]


def _invalid(step) -> bool:
    return len(step) > 2 and bool(step[2])


def verl_agent_gigpo(steps, groups, gamma, weight, norm_by_std, cross_steps, coef=0.0,
                     eps=1e-6, similarity=1.0) -> np.ndarray:
    """verl-agent's GiGPO advantage of each step row, written out in float64 from its code
    (langfengQ/verl-agent, read at the fork zhengxuyu/verl-agent@3d91c9b), rows in
    episode-then-step order as its ``TrajectoryCollector`` gathers them; ``steps[e]`` lists
    episode ``e``'s ``(env reward, observation[, invalid])``. As ``RayPPOTrainer.fit``
    composes it:

    * ``compute_step_discounted_returns`` (before the reward): each row's
      ``R_t = r_t + gamma R_{t+1}`` over its episode's env rewards;
    * ``EpisodeRewardManager``: each row's token scores sum to its episode's env rewards;
    * ``apply_invalid_action_penalty``: ``coef * invalid`` off that row's score and return;
    * ``compute_gigpo_outcome_advantage``: ``episode_norm_reward`` (a group's mean and std
      over its rows' scores with ``compute_mean_std_cross_steps``, else over each episode's
      first row; one entry: mean 0, std 1), ``build_step_group`` (equal observations within
      a group; at ``similarity < 1`` greedy ``SequenceMatcher`` clusters), ``step_norm_reward``
      (one row: its own mean), summed with weight ``step_advantage_w``. ``mean_std_norm``
      divides by ``std + eps``, ``torch.std`` unbiased."""
    rows = [(groups[e], e, step[0], step[1], _invalid(step))
            for e, ep in enumerate(steps) for step in ep]
    n = len(rows)
    returns = np.zeros(n)
    for e in range(len(steps)):
        running = 0.0
        for i in reversed([i for i, row in enumerate(rows) if row[1] == e]):
            running = rows[i][2] + gamma * running
            returns[i] = running
    invalid = np.array([row[4] for row in rows], np.float64)
    scores = np.array([sum(step[0] for step in steps[row[1]]) for row in rows]) - coef * invalid
    returns = returns - coef * invalid

    def normalise(values, keys, entries, one_is_own_mean):
        by_key = defaultdict(list)
        for i in entries:
            by_key[keys[i]].append(values[i])
        out = np.zeros(n)
        for i in range(n):
            group = by_key[keys[i]]
            if len(group) == 1:
                mean, std = (group[0] if one_is_own_mean else 0.0), 1.0
            else:
                mean, std = np.mean(group), np.std(group, ddof=1)
            out[i] = (values[i] - mean) / (std + eps) if norm_by_std else values[i] - mean
        return out

    first = [i for i, row in enumerate(rows) if i == 0 or rows[i - 1][1] != row[1]]
    episode = normalise(scores, [row[0] for row in rows], range(n) if cross_steps else first,
                        False)
    def same(obs, rep):
        if similarity >= 1.0:
            return obs == rep
        return difflib.SequenceMatcher(None, obs, rep).ratio() >= similarity

    clusters = defaultdict(list)  # group -> [(its first observation, key)]
    keys = []
    for g, _, _, obs, _ in rows:
        found = [key for rep, key in clusters[g] if same(obs, rep)]
        if not found:
            clusters[g].append((obs, (g, len(clusters[g]))))
            found = [clusters[g][-1][1]]
        keys.append(found[0])
    return episode + weight * normalise(returns, keys, range(n), True)


def ours(steps, groups, gamma, weight, norm_by_std, episode_stats, penalty="discounted",
         coef=0.0, eps=1e-6, similarity=1.0, width=4) -> np.ndarray:
    """ragen_jax's GiGPO advantage of each played turn, episode then turn, of the same
    episodes: an invalid step's turn carries a format penalty of ``-coef``, and the episode's
    score is its turns' rewards plus penalties (``rollout.batch``, identity reward norm)."""
    eps_list = _episodes(steps, -coef)
    groups = np.array(groups, np.int32)
    table = turn_table(eps_list, groups, width, similarity)
    scores = np.array([sum(t["reward"] + t["penalty"] for t in ep.turns) for ep in eps_list],
                      np.float32)
    got = _gigpo(jnp.asarray(scores), jnp.asarray(groups), int(groups.max()) + 1,
                 jnp.asarray(table.rewards), jnp.asarray(table.anchors),
                 jnp.asarray(table.played), gamma=gamma, step_weight=weight,
                 norm_by_std=norm_by_std, eps=eps, episode_stats=episode_stats,
                 turn_penalties=jnp.asarray(table.penalties) if penalty == "own_turn" else None)
    return np.asarray(got)[table.played]


# Derived by running verl-agent's gigpo/core_gigpo.py (langfengQ/verl-agent, read at the fork
# zhengxuyu/verl-agent@3d91c9b; torch on CPU, its ``verl`` import stubbed) on these episodes,
# one row per step in episode-then-step order as its rollout gathers them, each step row's
# token_level_rewards summing to its episode's env rewards (its EpisodeRewardManager) less
# ``invalid_action_penalty_coef`` on an invalid step, the same off its step return (its
# apply_invalid_action_penalty): compute_step_discounted_returns, then
# compute_gigpo_outcome_advantage, or, for per-episode statistics,
# episode_norm_reward(compute_mean_std_cross_steps=False) + build_step_group +
# step_norm_reward, composed as that function composes them. One value per step row.
# ``stats``: ragen_jax's algorithm.gigpo_episode_stats for verl-agent's setting ("turn":
# compute_mean_std_cross_steps=True, its default).
MIXED_LENGTHS = [[(0.0, "s0"), (1.0, "s1")],
                 [(0.0, "s0"), (0.0, "s2"), (0.0, "s1"), (2.0, "s5")],
                 [(0.3, "s0")],
                 [(0.0, "s0"), (0.0, "s2"), (0.5, "s6")],
                 [(1.0, "s0")]]
PARITY = [
    # verl-agent's defaults: mode mean_norm, statistics over step rows (equal turn counts
    # within each group, where they equal the per-episode ones), gamma 0.95, weight 1.
    dict(groups=[0, 0, 0, 1, 1], gamma=0.95, weight=1.0, norm_by_std=False, similarity=1.0,
         stats="turn",
         steps=[[(0.0, "s0"), (0.0, "s1"), (1.0, "s2")],
                [(0.0, "s0"), (-0.1, "s3"), (0.0, "s1")],
                [(0.0, "s0"), (0.0, "s1"), (0.0, "s4")],
                [(0.5, "t0"), (0.0, "t1")],
                [(0.0, "t0"), (0.0, "t0")]],
         want=[1.333333, 1.333333, 0.7, -0.764167, -0.4, -0.716667, -0.569167, -0.616667,
               -0.3, 0.583333, 0.25, -0.416667, -0.416667]),
    # mean_std_norm with per-episode statistics (compute_mean_std_cross_steps=False, not
    # verl-agent's default), unequal turn counts, gamma 0.9, weight 0.5, a group of one.
    dict(groups=[0, 0, 0, 0, 1], gamma=0.9, weight=0.5, norm_by_std=True, similarity=1.0,
         stats="episode", steps=MIXED_LENGTHS,
         want=[0.192374, -0.28771, 2.035141, 1.736248, 1.736247, 1.382695, -1.294924,
               -0.932591, -0.946136, -0.592583, 0.999999]),
    # The same episodes with verl-agent's default statistics (over step rows).
    dict(groups=[0, 0, 0, 0, 1], gamma=0.9, weight=0.5, norm_by_std=True, similarity=1.0,
         stats="turn", steps=MIXED_LENGTHS, want=[-0.117019, -0.597102, 1.76195, 1.463056, 1.463056, 1.109503, -1.629657,
               -1.260083, -1.273629, -0.920076, 0.999999]),
    # enable_similarity with similarity_thresh 0.8 on text observations, mean_norm.
    dict(groups=[0, 0, 0], gamma=0.95, weight=1.0, norm_by_std=False, similarity=0.8,
         stats="turn",
         steps=[[(0.0, "room: #..P.#"), (1.0, "room: #.P..#")],
                [(0.0, "room: #..P.#"), (0.0, "room: #...P#")],
                [(0.0, "room: #..P.#"), (0.0, "a different text entirely")]],
         want=[1.226667, 1.276667, -0.723333, -0.723333, -0.723333, -0.333333]),
    # The invalid-action penalty (coef 0.1, verl-agent's default) with its defaults
    # otherwise; ragen_jax's algorithm.gigpo_penalty=own_turn.
    dict(groups=[0, 0, 0, 1, 1], gamma=0.95, weight=1.0, norm_by_std=False, similarity=1.0,
         stats="turn", penalty=0.1,
         steps=[[(0.0, "s0", True), (0.0, "s0"), (1.0, "s1")],
                [(0.0, "s0"), (0.0, "s2", True), (0.0, "s1", True)],
                [(0.0, "s0"), (1.0, "s1")],
                [(0.0, "t0", True), (1.0, "t1")],
                [(0.0, "t0"), (0.0, "t2"), (0.0, "t1", True)]],
         want=[0.439375, 0.686875, 0.779167, -1.263125, -0.6875, -1.420833, 0.686875,
               0.779167, 0.965, 1.19, -0.785, -0.36, -1.01]),
]


def _ours_for(case, **overrides):
    kw = dict(gamma=case["gamma"], weight=case["weight"], norm_by_std=case["norm_by_std"],
              episode_stats=case["stats"], similarity=case["similarity"],
              penalty="own_turn" if case.get("penalty") else "discounted",
              coef=case.get("penalty", 0.0)) | overrides
    return ours(case["steps"], case["groups"], **kw)


@pytest.mark.parametrize("case", PARITY, ids=["defaults", "mean_std_per_episode",
                                              "mean_std_defaults", "similarity", "penalty"])
def test_parity_with_verl_agent(case):
    np.testing.assert_allclose(_ours_for(case), case["want"], atol=2e-5)
    # The written-out algorithm below gives what verl-agent's code gave.
    np.testing.assert_allclose(verl_agent_gigpo(
        case["steps"], case["groups"], case["gamma"], case["weight"], case["norm_by_std"],
        case["stats"] == "turn", case.get("penalty", 0.0), similarity=case["similarity"]),
        case["want"], atol=2e-5)


def test_the_other_settings_differ_from_verl_agent():
    """Per-episode statistics with unequal turn counts, and the discounted penalty, are not
    what verl-agent computes (so the parity cases above test the options)."""
    per_episode = _ours_for(PARITY[2], episode_stats="episode")
    assert np.abs(per_episode - np.asarray(PARITY[2]["want"])).max() > 0.1
    discounted = _ours_for(PARITY[4], penalty="discounted")
    assert np.abs(discounted - np.asarray(PARITY[4]["want"])).max() > 0.01


def test_turn_statistics_weigh_episodes_by_their_turns():
    """Two 2-turn episodes scored 1 and 0: per turn the group's entries are 1, 1, 0, 0
    (std sqrt(1/3): +-0.866), per episode 1, 0 (std sqrt(1/2): +-0.707); scored 1 in 3 turns
    and 0 in 1: mean 3/4 per turn (+0.25, -0.75), 1/2 per episode. Step part off."""
    two = [[(0.0, "a"), (1.0, "b")], [(0.0, "c"), (0.0, "d")]]
    by = {stats: ours(two, [0, 0], 0.95, 0.0, True, stats) for stats in ("turn", "episode")}
    s3, s2 = 0.5 / (np.sqrt(1 / 3) + 1e-6), 0.5 / (np.sqrt(1 / 2) + 1e-6)
    np.testing.assert_allclose(by["turn"], [s3, s3, -s3, -s3], atol=1e-6)
    np.testing.assert_allclose(by["episode"], [s2, s2, -s2, -s2], atol=1e-6)
    uneven = [[(0.0, "a"), (0.0, "b"), (1.0, "c")], [(0.0, "d")]]
    np.testing.assert_allclose(ours(uneven, [0, 0], 0.95, 0.0, False, "turn"),
                               [0.25] * 3 + [-0.75], atol=1e-6)
    np.testing.assert_allclose(ours(uneven, [0, 0], 0.95, 0.0, False, "episode"),
                               [0.5] * 3 + [-0.5], atol=1e-6)


RANDOM_CASES = 25


def _random_case(rng: np.random.Generator) -> dict:
    """Two groups of four episodes of 1-4 turns from a group's reset state ("start"), then
    states from a few shared texts (equal texts in different groups are never compared);
    rewards exact in binary (so that groups equal in exact arithmetic stay equal in float32)."""
    steps = []
    for _ in range(8):
        k = int(rng.integers(1, 5))
        texts = ["start"] + list(rng.choice(["a", "b", "c"], k - 1))
        steps.append([(float(rng.choice([0.0, 0.0, 0.0, 0.5, 1.0, -0.25, 2.0])), str(text),
                       bool(rng.random() < 0.3)) for text in texts])
    return dict(steps=steps, groups=[0] * 4 + [1] * 4, gamma=float(rng.uniform(0.0, 1.0)),
                weight=float(rng.choice([0.5, 1.0, 2.0])),
                eps=float(rng.choice([1e-6, 1e-6, 0.125])))


@pytest.mark.parametrize("penalty", ["discounted", "own_turn"])
@pytest.mark.parametrize("norm_by_std", [False, True], ids=["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("stats", ["turn", "episode"])
def test_random_cases_match_verl_agent(stats, norm_by_std, penalty):
    """Random episodes against the written-out verl-agent: ``gigpo_episode_stats`` ``turn``
    is its default ``compute_mean_std_cross_steps=True``, ``episode`` its ``False``; its
    penalty (coef 0.25 here) with ``gigpo_penalty=own_turn``; with ``discounted`` the two
    agree without penalties. Step grouping, discount, eps and unbiased std vary."""
    rng = np.random.default_rng([7, stats == "turn", norm_by_std, penalty == "own_turn"])
    coef = 0.25 if penalty == "own_turn" else 0.0
    for _ in range(RANDOM_CASES):
        c = _random_case(rng)
        want = verl_agent_gigpo(c["steps"], c["groups"], c["gamma"], c["weight"], norm_by_std,
                                stats == "turn", coef, c["eps"])
        got = ours(c["steps"], c["groups"], c["gamma"], c["weight"], norm_by_std, stats,
                   penalty, coef, c["eps"])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_similarity_clusters_only_text_anchors_and_the_metric_counts_shared_turns():
    texts = [[(0.0, "room: #..P.#"), (0.0, "room: #.P..#")], [(0.0, "room: #..P.#")]]
    eps = _episodes(texts)
    exact = turn_table(eps, np.zeros(2, np.int32), 3)
    similar = turn_table(eps, np.zeros(2, np.int32), 3, similarity=0.8)
    # Exact: the two first turns share their text; the second turn is alone.
    assert anchored_turns(exact, np.zeros(2))["rollout/anchored_turns"] == pytest.approx(2 / 3)
    assert anchored_turns(similar, np.zeros(2))["rollout/anchored_turns"] == 1.0
    # A JAX env's episode keeps its exact ids whatever the threshold.
    state = [dataclasses.replace(ep, text_anchors=False) for ep in eps]
    np.testing.assert_array_equal(turn_table(state, np.zeros(2, np.int32), 3, 0.8).anchors,
                                  exact.anchors)
    # An env-error episode's turns are not counted.
    assert anchored_turns(exact, np.zeros(2), np.array([True, False]))[
        "rollout/anchored_turns"] == 0.0


# -- the rollout's anchors and the update's rows ------------------------------------------------

GROUPS, SIZE, TURNS = 2, 4, 3
MOVES = ["Up", "Down", "Left", "Right"]


def test_anchor_hash_ignores_the_step_counter_only():
    env, params = make("sokoban")
    _, state = env.reset_env(jax.random.key(3), params)
    same = levels.anchor_hash(env, state.replace(time=state.time + 5))
    moved = levels.anchor_hash(env, state.replace(player=state.player + 1))
    h = levels.anchor_hash(env, state)
    assert (np.asarray(same) == np.asarray(h)).all() and not (np.asarray(moved) == np.asarray(h)).all()


@pytest.fixture(scope="module")
def rollout():
    """Sokoban, full context, scripted moves that differ by row (a row repeats its move, so
    pushes into a wall keep the state): 3 turns, repeated and unique states."""
    tok = tk.load(None)
    env, params = make("sokoban")
    cfg = RolloutConfig(env_groups=GROUPS, group_size=SIZE, max_turn=TURNS, response_length=16)
    policy = ScriptedPolicy.from_texts(
        tok, lambda row, call: f"go</think><answer>{MOVES[row % 4]}</answer>")
    return AgentRollout(env, params, tok, cfg, record_anchors=True).collect(
        policy, [7, 8], jax.random.key(0))


def _settings():
    return AdvantageSettings(estimator="gigpo", gamma=1.0, lam=1.0, norm_adv_by_std=True,
                             bi_level_gae=False, high_level_gamma=0.95, num_groups=GROUPS,
                             step_gamma=0.95, step_weight=1.0,
                             episode_stats="episode", penalty="discounted")


def _rows(batch, table, unit, keep=None, valid=None):
    return build_step_batch(
        batch, np.ones(GROUPS, bool) if keep is None else keep,
        np.ones(GROUPS * SIZE, np.float32), RowSettings(1, pad_multiple=8, sample_unit=unit),
        group_buckets=np.zeros(GROUPS, np.int32), mesh=make_mesh((1, 1, 1)),
        rng=np.random.default_rng(0), valid=valid, turns=table)


def _expected(batch, table, valid=None):
    groups = batch.group_ids if valid is None else np.where(valid.reshape(-1), batch.group_ids, -1)
    return np.asarray(_gigpo(jnp.asarray(batch.scores), jnp.asarray(groups, np.int32), GROUPS,
                              jnp.asarray(table.rewards), jnp.asarray(table.anchors),
                              jnp.asarray(table.played), gamma=0.95))


def _check_rows(rows, want):
    """Every sampled token carries its episode's turn's advantage, nothing else any."""
    adv = np.asarray(jax.jit(step_advantages, static_argnums=0)(_settings(), rows)[0])
    mask = np.asarray(rows.loss_mask) > 0
    turn = np.asarray(rows.turn_ids)
    episode = np.asarray(rows.episode_index)
    row = np.nonzero(mask)[0]
    np.testing.assert_allclose(adv[mask], want[episode[row], turn[mask] - 1], atol=1e-5)
    assert not adv[~mask].any()
    return adv


def test_rollout_records_anchors_of_the_states_each_turn_acted_from(rollout):
    table = turn_table(rollout.episodes, rollout.group_ids, TURNS)
    np.testing.assert_array_equal(table.played.sum(1), rollout.num_turns)
    ids = levels.as_uint64(table.anchors)
    for g in range(GROUPS):  # a group's episodes start from one state
        assert np.unique(ids[rollout.group_ids == g, 0]).size == 1
    assert ids[0, 0] != ids[SIZE, 0]  # two levels
    stats = anchored_turns(table, rollout.group_ids)
    assert 0 < stats["rollout/anchored_later_turns"] < 1  # repeats and unique states both


@pytest.mark.parametrize("unit", ["trajectory", "turn"])
def test_rows_of_either_unit_carry_each_turns_advantage(rollout, unit):
    table = turn_table(rollout.episodes, rollout.group_ids, TURNS)
    want = _expected(rollout, table)
    assert np.abs(want - want[:, :1]).max() > 1e-3  # the turns of an episode differ
    _check_rows(_rows(rollout, table, unit), want)


def test_filtered_groups_and_env_error_episodes(rollout):
    """A filtered group's rows are gone and the kept group's advantages are unchanged; an
    env error's episode has no row and is in no group (not in its anchors' baselines)."""
    table = turn_table(rollout.episodes, rollout.group_ids, TURNS)
    keep = np.array([False, True])
    rows = _rows(rollout, table, "trajectory", keep=keep)
    assert set(np.asarray(rows.episode_index).tolist()) == set(range(SIZE, 2 * SIZE))
    _check_rows(rows, _expected(rollout, table))
    valid = np.ones((GROUPS, SIZE), bool)
    valid[0, 1] = False
    rows = _rows(rollout, table, "turn", valid=valid)
    assert 1 not in np.asarray(rows.episode_index)
    want = _expected(rollout, table, valid)
    assert not np.allclose(want[0], _expected(rollout, table)[0])  # the error's episode counted before
    _check_rows(rows, want)
