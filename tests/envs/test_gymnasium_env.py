"""The Gymnasium adapter on tiny gymnasium envs defined here: discrete and text actions,
rendering, seeding, success, and a whole rollout through ``make``."""

import gymnasium
import jax
import numpy as np
import pytest
from gymnasium import spaces

from ragen_jax.envs import GymnasiumEnv, make, register
from ragen_jax.envs.registry import REGISTRY
from ragen_jax.models import tokenizer as tk
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.scripted import RandomActionPolicy, answer_text


class Corridor(gymnasium.Env):
    """Walk from a seeded start to cell 4 of a 5-cell corridor: actions 0 = left, 1 = right;
    reward 1 at the goal; truncated after 6 steps. Observation: the position (an int)."""

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, render_mode=None):
        self.observation_space = spaces.Discrete(5)
        self.action_space = spaces.Discrete(2)
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = int(self.np_random.integers(0, 3)), 0
        return self.pos, {}

    def step(self, action):
        self.pos = max(0, min(4, self.pos + (1 if action == 1 else -1)))
        self.t += 1
        won = self.pos == 4
        return self.pos, float(won), won, self.t >= 6 and not won, {}

    def render(self):
        return "".join("P" if i == self.pos else "_" for i in range(5)) + "G"


class Echo(gymnasium.Env):
    """A text action space: the episode is won by saying the observation back."""

    def __init__(self):
        self.observation_space = spaces.Text(8)
        self.action_space = spaces.Text(8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = "abcdefgh"[int(self.np_random.integers(0, 8)):][:3]
        return self.word, {}

    def step(self, action):
        won = action == self.word
        return "done", float(won), True, False, {"is_success": won}


def corridor(**kw):
    return GymnasiumEnv(lambda: Corridor(render_mode="ansi"), action_names=("Left", "Right"), **kw)


def test_discrete_actions_by_name_and_ansi_rendering():
    env = corridor()
    text = env.reset(0)
    assert text.endswith("G") and text.count("P") == 1 and env.action_names == ("Left", "Right")
    assert env.reset(0) == text  # gymnasium seeding: the same seed, the same start
    assert len({corridor().reset(s) for s in range(20)}) == 3
    steps = [env.step("right") for _ in range(6)]  # names are case-insensitive
    assert steps[-1][2] and steps[-1][3]["success"] and steps[-1][1] == 1.0
    text, reward, done, info = env.step("Jump")
    assert not done and not info["action_is_valid"] and text.startswith("Invalid action")


def test_default_names_truncation_and_a_render_function():
    env = GymnasiumEnv(Corridor, render=lambda obs, e: f"at {obs}")
    assert env.action_names == ("0", "1") and env.reset(1).startswith("at ")
    for _ in range(5):
        _, _, done, info = env.step("0")
    _, _, done, info = env.step("0")
    assert done and info["truncated"] and not info["success"]


def test_text_action_space_and_is_success():
    env = GymnasiumEnv(Echo)
    word = env.reset(3)
    assert env.action_names == ()
    assert env.step(word)[3]["success"]
    env.reset(3)
    assert env.step("nope")[3]["success"] is False


def test_other_spaces_need_a_parser():
    class Box(Corridor):
        def __init__(self):
            super().__init__()
            self.action_space = spaces.Box(-1, 1, (1,))

    with pytest.raises(ValueError, match="parse_action"):
        GymnasiumEnv(Box)
    env = GymnasiumEnv(Box, parse_action=lambda text: 1 if float(text) > 0 else 0)
    start = int(env.reset(0))  # no renderer: str(obs)
    assert env.step("0.5")[0] == str(start + 1)
    assert not env.step("x")[3]["action_is_valid"]  # float("x") raises ValueError


def test_a_registered_gymnasium_env_plays_through_the_rollout():
    register("corridor-test", lambda **kw: corridor(**kw))
    try:
        env, params = make("corridor-test", instruction="Reach G.")
        tok = tk.load(None)
        cfg = RolloutConfig(env_groups=2, group_size=2, max_turn=3, max_actions_per_traj=6, max_actions_per_turn=2, response_length=32, prompt=PromptConfig(enable_think=False))
        rollout = AgentRollout(env, params, tok, cfg)
        assert rollout.tag == "Corridor"
        policy = ScriptedPolicy.from_texts(
            tok, lambda row, call: answer_text(["Right", "Right"], cfg.context))
        batch = rollout.collect(policy, np.array([0, 1]), jax.random.key(0))
        assert batch.success.all() and batch.metrics["rollout/env_errors"] == 0.0
        system = batch.trajectories[0]["messages"][0]["content"]
        assert "Reach G." in system and "Left, Right" in system  # discrete: names listed
        warm = RandomActionPolicy(env, params, tok, cfg.context, seed=0)
        assert rollout.collect(warm, np.array([0]), jax.random.key(0)).metrics[
            "Corridor/format_error_rate"] == 0.0
    finally:
        REGISTRY.pop("corridor-test")
