"""Host envs in the multi-turn rollout, on threads (``isolation="thread"``): failures cost one
episode (raise, hang past the timeout, malformed returns), the same seed plays the same
episode, free-text parsing, and parallel-friendly envs step in threads. The same faults and
worse ones in worker processes: ``test_env_processes.py``."""

import dataclasses
import threading

import jax
import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.envs.host.env import HostEnv
from ragen_jax.envs.host.family import HostEnvFamily
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.scripted import RandomActionPolicy, answer_text

_release = [threading.Event()]


def _hang() -> None:
    """Blocks until the running test has ended (a minute at most): a call the runner must
    abandon at its timeout, whatever the machine's load, since nothing ends it sooner."""
    _release[0].wait(60)


@pytest.fixture(autouse=True)
def _release_hung_calls():
    _release[0] = threading.Event()
    yield
    _release[0].set()


CFG = RolloutConfig(env_groups=2, group_size=2, max_turn=2, max_actions_per_traj=4, max_actions_per_turn=2, response_length=32, prompt=PromptConfig(enable_think=False))


class Moody(HostEnv):
    """Echoes the seed; an action ``boom`` raises, ``hang`` hangs until the test ends,
    ``junk`` returns a malformed step, ``win`` ends the episode won, anything else pays 1."""

    instruction = "Say win."

    def reset(self, seed):
        self.seed = seed
        return f"seed {seed}"

    def step(self, action):
        if action == "boom":
            raise ValueError(f"boom on seed {self.seed}")
        if action == "hang":
            _hang()
        if action == "junk":
            return "only two", 1.0
        done = action == "win"
        return f"seed {self.seed} after {action}", 1.0, done, {"success": done}


def _play(tok, answers, *, timeout=10.0, seeds=(11, 12), cfg=CFG, **kw):
    family = HostEnvFamily(Moody, step_timeout=timeout, isolation="thread", **kw)
    rollout = AgentRollout(family, None, tok, cfg)
    policy = ScriptedPolicy.from_texts(
        tok, lambda row, call: answer_text(answers(row, call), cfg.context))
    return rollout.collect(policy, np.array(seeds), jax.random.key(0))


def test_an_env_that_raises_costs_only_its_episode(tok):
    batch = _play(tok, lambda row, call: ["boom"] if row == 1 else ["go", "win"])
    t = batch.trajectories
    assert t[1]["env_error"] == "ValueError: boom on seed 11"
    assert t[1]["turns"][-1]["env_error"] == t[1]["env_error"] and not t[1]["success"]
    assert t[1]["truncated"] and batch.episodic_return[1] == 0.0
    for b in (0, 2, 3):  # the others play on: "go" then "win" in one turn
        assert t[b]["success"] and t[b]["env_error"] == "" and batch.episodic_return[b] == 2.0
    assert batch.metrics["rollout/env_errors"] == 1.0


def test_rewards_before_a_failing_step_are_kept(tok):
    batch = _play(tok, lambda row, call: ["go", "boom"])
    assert (batch.episodic_return == 1.0).all() and batch.metrics["rollout/env_errors"] == 4.0
    assert all(t["turns"][0]["executed"] == ["go"] for t in batch.trajectories)


def test_a_hanging_step_times_out(tok):
    # The hang ends with the test: a rollout that waited for it would not have returned yet.
    batch = _play(tok, lambda row, call: ["hang"] if row == 2 else ["win"], timeout=0.3)
    assert batch.trajectories[2]["env_error"].startswith("timed out: an env call took over 0.3 s")
    assert [t["success"] for t in batch.trajectories] == [True, True, False, True]


def test_a_hang_does_not_block_the_next_rollout(tok):
    """The hung thread is retired and replaced: a single-worker env keeps working."""
    family = HostEnvFamily(Moody, step_timeout=0.2, isolation="thread")
    rollout = AgentRollout(family, None, tok, CFG)
    for answer in (["hang"], ["win"]):
        policy = ScriptedPolicy.from_texts(
            tok, lambda row, call, a=answer: answer_text(a, CFG.context))
        batch = rollout.collect(policy, np.array([1]), jax.random.key(0), group_size=1)
    assert batch.trajectories[0]["success"] and batch.trajectories[0]["env_error"] == ""


def test_a_malformed_step_is_a_recorded_failure(tok):
    batch = _play(tok, lambda row, call: ["junk"] if row == 0 else ["win"])
    assert batch.trajectories[0]["env_error"].startswith("TypeError: step must return")
    assert batch.success.tolist() == [False, True, True, True]


def test_a_failed_reset_ends_the_episode_before_it_starts(tok):
    class BadSeed(Moody):
        def reset(self, seed):
            if seed == 12:
                raise RuntimeError("no level 12")
            return super().reset(seed)

    rollout = AgentRollout(HostEnvFamily(BadSeed, isolation="thread"), None, tok, CFG)
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(["win"], CFG.context))
    batch = rollout.collect(policy, np.array([11, 12]), jax.random.key(0))
    assert [t["env_error"] for t in batch.trajectories] == ["", "", "reset: RuntimeError: no level 12",
                                                          "reset: RuntimeError: no level 12"]
    assert batch.num_turns.tolist() == [1, 1, 0, 0] and batch.success.tolist() == [True, True, False, False]


def test_a_reset_that_hangs_past_the_timeout_costs_its_episodes(tok):
    """A reset is under the step timeout: its episodes are recorded failures, the others and
    the next rollout play on (the hung instances are dropped, fresh ones replace them)."""
    class SlowSeed(Moody):
        def reset(self, seed):
            if seed == 12:
                _hang()
            return super().reset(seed)

    rollout = AgentRollout(HostEnvFamily(SlowSeed, step_timeout=0.3, isolation="thread"), None, tok, CFG)
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(["win"], CFG.context))
    batch = rollout.collect(policy, np.array([11, 12]), jax.random.key(0))  # not waiting for the hangs
    errors = [t["env_error"] for t in batch.trajectories]
    assert errors[:2] == ["", ""] and all(e.startswith("reset: timed out: an env call took over 0.3 s")
                                          for e in errors[2:])
    assert batch.success.tolist() == [True, True, False, False]
    assert batch.metrics["rollout/env_errors"] == 2.0
    batch = rollout.collect(policy, np.array([13, 14]), jax.random.key(1))
    assert batch.success.all() and batch.metrics["rollout/env_errors"] == 0.0


def test_building_an_instance_is_under_the_timeout_too(tok):
    """A row's instance is built inside its reset call: a factory that raises or hangs costs
    that row's episode, not the run, and the row gets a fresh instance next time."""
    built = []

    def factory():
        built.append(len(built))
        if len(built) == 3:  # the prototype, row 0, then row 1's instance
            raise RuntimeError("no licence left")
        if len(built) == 4:  # row 2's
            _hang()
        return Moody()

    rollout = AgentRollout(HostEnvFamily(factory, step_timeout=0.3, isolation="thread"), None, tok, CFG)
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(["win"], CFG.context))
    batch = rollout.collect(policy, np.array([11, 12]), jax.random.key(0))  # not waiting for the hang
    errors = [t["env_error"] for t in batch.trajectories]
    assert errors[0] == errors[3] == ""
    assert errors[1] == "reset: RuntimeError: no licence left"
    assert errors[2].startswith("reset: timed out: an env call took over 0.3 s")
    assert batch.success.tolist() == [True, False, False, True]
    batch = rollout.collect(policy, np.array([11, 12]), jax.random.key(0))
    assert batch.success.all() and len(built) == 7  # rows 1 and 2 rebuilt, rows 0 and 3 kept


def test_free_text_turns_and_prompts(tok):
    batch = _play(tok, lambda row, call: ["go"])
    t = batch.trajectories[0]
    assert t["messages"][0]["content"].endswith("Say win.")  # its instruction, no action list
    assert "available actions" not in t["messages"][0]["content"]
    assert [turn["state"] for turn in t["turns"]] == ["seed 11", "seed 11 after go"]
    assert t["turns"][0]["executed"] == ["go"] and t["final_state"] == "seed 11 after go"
    assert batch.metrics["Moody/format_error_rate"] == 0.0


class Sticky(HostEnv):
    """Never ends; ``stay`` is not effective (``info["action_is_effective"]`` False), anything
    else is."""

    instruction = "Move."

    def reset(self, seed):
        return f"seed {seed}"

    def step(self, action):
        return f"after {action}", 0.0, False, {"success": False, "action_is_effective": action != "stay"}


def test_host_turns_record_their_last_actions_effectiveness(tok):
    """RAGEN's ``action_is_valid`` / ``action_is_effective`` (a turn keeps its last executed
    action's info; one that ran nothing keeps none; summed, over the turns played), written
    out over the scripted actions, against the rollout's metrics from a host env."""
    plays = {0: [["go", "stay"], ["go", "go"]], 2: [None, ["stay", "go"]]}  # None: no tags
    plays[1], plays[3] = plays[0], plays[2]

    def answer(row, call):
        actions = plays[row][call]
        return "nonsense" if actions is None else answer_text(actions, CFG.context)

    rollout = AgentRollout(HostEnvFamily(Sticky, isolation="thread"), None, tok, CFG)
    batch = rollout.collect(ScriptedPolicy.from_texts(tok, answer), np.array([1, 2]),
                            jax.random.key(0))
    valid, effective, rate = [], [], []
    for row in range(4):
        turns = [a or [] for a in plays[row]]
        valid.append(np.mean([len(a) > 0 for a in turns]))
        effective.append(np.mean([bool(a) and a[-1] != "stay" for a in turns]))
        ran = [x for a in turns for x in a]
        rate.append(np.mean([x != "stay" for x in ran]))
    assert batch.trajectories[2]["turns"][0]["format_error"]
    m = batch.metrics
    assert m["Sticky/action_is_valid"] == pytest.approx(np.mean(valid))
    assert m["Sticky/action_is_effective"] == pytest.approx(np.mean(effective)) == 0.5
    assert m["Sticky/effective_action_rate"] == pytest.approx(np.mean(rate)) == 0.625


def test_same_seed_same_episode(tok):
    env, _ = make("countdown")
    cfg = dataclasses.replace(CFG, max_turn=1, max_actions_per_turn=1, max_actions_per_traj=1)
    rollout = AgentRollout(env, None, tok, cfg)

    def play():
        policy = RandomActionPolicy(env, None, tok, cfg.context, seed=0)
        return rollout.collect(policy, np.array([5, 6]), jax.random.key(1))

    a, b = play(), play()
    assert [t["turns"][0]["state"] for t in a.trajectories] == [t["turns"][0]["state"] for t in b.trajectories]
    assert a.trajectories[0]["turns"][0]["state"] == a.trajectories[1]["turns"][0]["state"]  # one group
    assert a.trajectories[0]["turns"][0]["state"] != a.trajectories[2]["turns"][0]["state"]
    assert (a.scores == b.scores).all() and (a.input_ids == b.input_ids).all()


def test_parallel_friendly_envs_step_in_threads(tok):
    """The four rows' steps run at once: each waits at a barrier until all four are in step
    (stepped one at a time, the first would wait past its timeout and fail its episode)."""
    seen, lock = set(), threading.Lock()
    together = threading.Barrier(4, timeout=60)

    class Slow(Moody):
        parallel_friendly = True

        def step(self, action):
            with lock:
                seen.add(threading.get_ident())
            together.wait()
            return super().step(action)

    cfg = dataclasses.replace(CFG, max_turn=1)
    rollout = AgentRollout(HostEnvFamily(Slow, max_workers=4, step_timeout=30, isolation="thread"),
                           None, tok, cfg)
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(["win"], cfg.context))
    batch = rollout.collect(policy, np.array([1, 2]), jax.random.key(0))
    assert [t["env_error"] for t in batch.trajectories] == [""] * 4
    assert batch.success.all() and len(seen) == 4


def test_host_options_through_make():
    family, params = make("sudoku", size=4, step_timeout=5, max_workers=3, parallel_friendly=True)
    assert params is None and family.workers == 3 and family.step_timeout == 5.0
    assert family.name == "Sudoku" and make("sudoku")[0].workers == 1
    assert family.isolation == "process" and make("sudoku", isolation="thread")[0].isolation == "thread"
    with pytest.raises(ValueError, match="unknown parameter"):
        make("countdown", grid=3)
    with pytest.raises(ValueError, match=r"^env.params.isolation must be one of"):
        make("countdown", isolation="fork")
    with pytest.raises(ValueError, match=r"^env.params.memory_limit_mb .* needs isolation='process'"):
        make("countdown", isolation="thread", memory_limit_mb=100)


def test_threads_abandoned_by_timeouts_are_dropped_once_they_return(tok):
    """A retired thread leaves the runner's list when its call returns: repeated timeouts do
    not grow it without bound (each hang here is released once the runner has given up on
    it, and its thread has ended before the next)."""
    from ragen_jax.rollout.host_driver import CallRunner

    runner = CallRunner(1, 0.05)
    for _ in range(6):
        release = threading.Event()
        [(_, error)] = runner.run([lambda mark, r=release: (mark(), r.wait(60))])
        assert error.startswith("timed out"), error
        release.set()
        for worker in [w for w in runner._workers if w.retired]:
            worker.join(60)
            assert not worker.is_alive()
    assert len(runner._workers) <= 2



@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_held_out_resets_compare_the_holdout_key(tok, isolation):
    """``HostEnv.holdout_key`` (default: the level) is what held-out resets compare and redraw
    on, in threads and worker processes; the level ids stay the levels."""
    from ragen_jax.envs import levels
    from tests.rollout.faulty_envs import Rooms

    rollout = AgentRollout(HostEnvFamily(Rooms, isolation=isolation), None, tok, CFG)
    val = rollout.driver.reset(np.array([0, 5, 1]), held_out=False)  # rooms 0, 0, 1
    np.testing.assert_array_equal(val.levels, [levels.text_level_id(f"level {s}") for s in (0, 5, 1)])
    np.testing.assert_array_equal(val.holdout, [levels.text_level_id(f"room {r}") for r in (0, 0, 1)])
    rollout.hold_out(val.holdout)
    seeds = np.arange(100, 120)
    out = rollout.driver.reset(seeds, held_out=True)
    rooms = [int(s.text.split()[1]) % 5 for s in out.host]
    assert not {0, 1} & set(rooms) and out.redraws.max() > 0
    assert all(s.text == f"level {seed}" for s, seed, n in zip(out.host, seeds, out.redraws, strict=True) if n == 0)
    rollout.driver.close()


def test_a_served_sokoban_holds_out_its_room():
    """A JAX env behind the host contract (``JaxAsHost``, what ``envs.host.serve`` serves)
    holds out what the env holds out in-process: Sokoban's room (so no training reset of a
    served Sokoban starts in a validation room, by the test above); its level key stays the
    level's."""
    from ragen_jax.envs import levels
    from ragen_jax.envs.host.serve import JaxAsHost

    env, params = make("sokoban", dim_room=(6, 6), num_boxes=1, max_steps=10)
    served = JaxAsHost(env, params)
    hexed = lambda h: f"{int(levels.as_uint64(h)):016x}"  # noqa: E731
    for seed in (0, 1):
        served.reset(seed)
        _, state = env.reset_env(jax.random.key(seed), params)
        assert served.holdout_key() == hexed(levels.holdout_hash(env, state))
        assert served.level_key() == hexed(levels.level_hash(env, state))
        assert served.holdout_key() != served.level_key()
