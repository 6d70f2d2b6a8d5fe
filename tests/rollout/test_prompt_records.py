"""What a trajectory record says about the prompt: the length hint follows the token budget,
each turn records the text inserted before it, and the viewer shows that text escaped."""

import html

import jax
import pytest

from ragen_jax.envs import make
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.viewer import render_html

ANSWER = "x</think><answer>Up</answer>"


def _cfg(**kw) -> RolloutConfig:
    """Two rows of one level in every test: the rollout's programs compile for one batch size."""
    return RolloutConfig(env_groups=1, group_size=2, **kw)


# One env object for every test: the rollout's jitted env functions are cached per env object.
# FrozenLake: its programs compile in a fraction of Sokoban's.
ENV, PARAMS = make("frozenlake")


def _play(tok, cfg):
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: ANSWER)
    batch = AgentRollout(ENV, PARAMS, tok, cfg).collect(policy, [3], jax.random.key(0))
    return batch, policy


def test_length_hint_follows_response_length_unless_set():
    assert RolloutConfig(response_length=37).context.max_tokens_hint == 37
    assert RolloutConfig().context.max_tokens_hint == 400  # RAGEN's response_length
    assert RolloutConfig(response_length=37, prompt=PromptConfig(max_tokens_hint=50)).context.max_tokens_hint == 50
    with pytest.raises(ValueError, match="rollout.prompt.max_tokens_hint must be >= 0"):
        RolloutConfig(prompt=PromptConfig(max_tokens_hint=-1))


def test_prompt_states_the_response_length(tok):
    cfg = _cfg(max_turn=1, response_length=37)
    _, policy = _play(tok, cfg)
    assert "Max response length: 37 words (tokens)." in tok.decode(policy.calls[0][0])
    custom = _cfg(max_turn=1, response_length=37, prompt=PromptConfig(max_tokens_hint=120, turn_template='T{turn} {state} at most {max_tokens}\n'))
    _, policy = _play(tok, custom)
    text = tok.decode(policy.calls[0][0])
    assert "at most 120\n" in text and "37" not in text


def test_turn_records_hold_the_inserted_prompt(tok):
    cfg = _cfg(max_turn=2, response_length=16)
    batch, policy = _play(tok, cfg)
    for b, traj in enumerate(batch.trajectories):
        assert len(traj["turns"]) == 2
        for call, turn in enumerate(traj["turns"]):
            assert turn["prompt"] == tok.decode(policy.calls[call][b])
        first, second = (t["prompt"] for t in traj["turns"])
        assert first.startswith("<|im_start|>system\nYou're a helpful assistant.")
        assert traj["messages"][1]["content"] in first  # the first user message
        assert second.startswith("\n<|im_start|>user\nReward:\n")  # the model ended its turn
        assert traj["turns"][1]["state"] in second


def test_viewer_shows_each_turns_prompt_escaped(tok):
    cfg = _cfg(max_turn=2, response_length=16)
    batch, _ = _play(tok, cfg)
    page = render_html(batch.trajectories, {"model": "m", "env": "frozenlake", "metrics": {}})
    for turn in batch.trajectories[0]["turns"]:
        assert f"<details><summary>prompt</summary><pre>{html.escape(turn['prompt'])}</pre>" in page
    assert "You&#x27;re a helpful assistant." in page and "&lt;|im_start|&gt;system" in page
    evil = {"turns": [{"turn": 1, "prompt": "<script>alert(1)</script>", "state": "s"}]}
    page = render_html([evil], {})
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
