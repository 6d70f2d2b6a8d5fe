"""Context windows: each mode's prompts token-exact against the chat template, cache reuse,
over-long prompts, and turn rows whose stored log-probs match a fresh forward pass."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, positions_from_mask
from ragen_jax.rollout import Sampler, ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import RolloutConfig, WindowConfig
from ragen_jax.rollout.context import format_reward
from ragen_jax.starpo.token_scores import token_logprobs

CFG = RolloutConfig(env_groups=2, group_size=2, response_length=32, max_turn=4)
SEEDS = np.array([3, 4])
# Turn 1 moves, turn 2 has no valid action (warning next turn), turns 3-4 move again.
ANSWERS = ["I go up</think><answer>Up</answer>", "hmm</think><answer>Jump</answer>",
           "left then right</think><answer>Left || Right</answer>",
           "down</think><answer>Down</answer>"]


def _play(sokoban, tok, **kw):
    """``kw``: rollout fields, a section's as a dict (``window={"mode": ...}``)."""
    env, params = sokoban
    ro = AgentRollout(env, params, tok, CFG.replace(kw))
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: ANSWERS[call % len(ANSWERS)])
    return ro.collect(policy, SEEDS, jax.random.key(0)), policy


def _blocks(traj):
    """Each turn's user block by hand (RAGEN's turn wording, no reward line): state,
    warning after a turn that executed nothing, actions left."""
    out, used = [], 0
    for k, t in enumerate(traj["turns"]):
        warning = ("No valid action provided previously. Environment state remains the same. "
                   "Please try again.\n") if k and not traj["turns"][k - 1]["executed"] else ""
        out.append(f"\nTurn {k + 1}:\nState:\n{t['state']}\n{warning}You have {10 - used} "
                   f"actions left. Always output: <think> [Your thoughts] </think> <answer> "
                   f"[your answer] </answer> with no extra text. Strictly follow this format. "
                   f"Max response length: 32 words (tokens).\n")
        used += len(t["executed"])
    return out


def _template_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text + "<think>", add_special_tokens=False)["input_ids"]


def _multi_turn_reference(tok, traj, turn, start):
    """RAGEN's limited_multi_turn / full prompt of ``turn`` showing turns ``start..turn``."""
    blocks, turns = _blocks(traj), traj["turns"]
    msgs = [traj["messages"][0], {"role": "user", "content": blocks[start - 1]}]
    for j in range(start, turn):
        reward = "Reward:\n" + format_reward(turns[j - 1]["reward"]) + "\n"
        msgs += [{"role": "assistant", "content": "<think>" + ANSWERS[j - 1]},
                 {"role": "user", "content": reward + blocks[j]}]
    return _template_ids(tok, msgs)


def _summary_reference(tok, traj, turn, start):
    """RAGEN's single_turn prompt (SimpleMemory wording, written out by hand)."""
    blocks, turns = _blocks(traj), traj["turns"]
    body = blocks[turn - 1][len(f"\nTurn {turn}:\n"):]
    if start == turn:
        content = f"(Turn {turn}):\n" + body
    else:
        content = (f"Summary: {turn - 1} step(s) completed so far. Showing the last "
                   f"{turn - start} turn(s) with state/action/reward details. Recent turns:\n---\n")
        for j in range(start, turn):
            t = turns[j - 1]
            content += (f"Turn {j} State:\n{t['state']}\nTurn {j} Action: <think>{ANSWERS[j - 1]}"
                        f"\nTurn {j} Reward: {format_reward(t['reward'])}\n---\n")
        content += f"\nCurrent Turn (Turn {turn}):\n" + body
    return _template_ids(tok, [traj["messages"][0], {"role": "user", "content": content}])


@pytest.mark.parametrize("mode,k", [("full", 0), ("limited", 1), ("limited", 2),
                                    ("limited", 0), ("single_turn", 0), ("single_turn", 2)])
def test_prompts_match_the_chat_template(sokoban, tok, mode, k):
    batch, policy = _play(sokoban, tok, window={"mode": mode, "turns": k})
    assert (batch.num_turns == 4).all()
    reference = _summary_reference if mode == "single_turn" else _multi_turn_reference
    for b, ep in enumerate(batch.episodes):
        traj = batch.trajectories[b]
        for turn in range(1, 5):
            start = 1 if not k else max(1, turn - k + 1)
            want = reference(tok, traj, turn, start)
            assert ep.turn_prompts[turn - 1].tolist() == want, (mode, k, b, turn)
            assert traj["turns"][turn - 1]["window_start"] == start
            # What the policy was sent: the new chunk when the prompt extends the previous
            # sequence (cache continued), else the whole prompt (fresh cache).
            sent = policy.calls[turn - 1][b]
            extends = mode != "single_turn" and (turn == 1 or not k or turn <= k)
            prev = [] if turn == 1 else (ep.turn_prompts[turn - 2].tolist()
                                         + ep.answer_ids(turn - 1).tolist())
            assert sent == (want[len(prev):] if extends else want)
            assert traj["turns"][turn - 1]["prefill_tokens"] == len(sent)
    # The transcript is the full-mode chat whatever the window.
    full, _ = _play(sokoban, tok)
    np.testing.assert_array_equal(batch.input_ids, full.input_ids)
    np.testing.assert_array_equal(batch.loss_mask, full.loss_mask)


def test_summary_wording_by_hand(sokoban, tok):
    batch, policy = _play(sokoban, tok, window={"mode": "single_turn", "turns": 3})
    text = tok.decode(policy.calls[3][0])
    state2 = batch.trajectories[0]["turns"][1]["state"]
    assert ("<|im_start|>user\nSummary: 3 step(s) completed so far. Showing the last 2 turn(s) "
            "with state/action/reward details. Recent turns:\n---\nTurn 2 State:\n" + state2
            + "\nTurn 2 Action: <think>hmm</think><answer>Jump</answer>\nTurn 2 Reward: 0\n---\n"
            "Turn 3 State:\n") in text
    assert "Turn 1 State" not in text and "\n---\n\nCurrent Turn (Turn 4):\nState:\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    first = tok.decode(policy.calls[0][0])
    assert "<|im_start|>user\n(Turn 1):\nState:\n" in first and "Summary" not in first


def _lengths(batch):
    return [len(p) for p in batch.episodes[0].turn_prompts]


@pytest.mark.parametrize("mode", ["full", "limited", "single_turn"])
def test_overlong_prompts_truncate_or_end(sokoban, tok, mode):
    whole, _ = _play(sokoban, tok, window={"mode": mode})
    longest = max(max(_lengths(whole)), 1)
    first = _lengths(whole)[0]
    # Room for every prompt but the longest two (turns 3 and 4 need a cut).
    budget = sorted(max(len(ep.turn_prompts[t]) for ep in whole.episodes) for t in range(4))[1]
    assert first <= budget < longest
    cut, _ = _play(sokoban, tok, max_model_len=budget + 32, window={"mode": mode, "overlong": "truncate"})
    assert (cut.num_turns == 4).all() and cut.metrics["rollout/length_truncated"] == 0
    reference = _summary_reference if mode == "single_turn" else _multi_turn_reference
    for b, ep in enumerate(cut.episodes):
        traj = cut.trajectories[b]
        starts = [t["window_start"] for t in traj["turns"]]
        assert starts[0] == 1 and starts[-1] > 1 and starts == sorted(starts)
        for turn, start in enumerate(starts, 1):
            prompt = ep.turn_prompts[turn - 1].tolist()
            assert len(prompt) <= budget
            assert prompt == reference(tok, traj, turn, start)
            if start > 1:  # the oldest turn kept is the one that no longer fits without the cut
                assert len(reference(tok, traj, turn, start - 1)) > budget
    ended, _ = _play(sokoban, tok, max_model_len=budget + 32, window={"mode": mode})
    assert ended.metrics["rollout/length_truncated"] > 0 and (ended.num_turns < 4).any()


def test_window_config_checks():
    for bad, message in [({"mode": "sliding"}, "rollout.window.mode must be one of"),
                         ({"overlong": "drop"}, "rollout.window.overlong must be one of"),
                         ({"turns": -1}, "rollout.window.turns must be >= 0"),
                         ({"turns": 2}, "rollout.window.turns must be 0 with")]:
        with pytest.raises(ValueError) as err:
            WindowConfig(**bad)
        assert str(err.value).startswith(message)


# ---------------------------------------------------------------------------------- tiny model

TINY = QwenConfig.tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       tie_word_embeddings=False)


@jax.jit
def _full_logprobs(graphdef, state, tokens, mask):
    logp, _ = token_logprobs(nnx.merge(graphdef, state), tokens, mask, positions_from_mask(mask))
    return logp


@pytest.mark.parametrize("mode,k", [("full", 0), ("limited", 2), ("single_turn", 0)])
def test_turn_rows_logprobs_match_a_full_forward(sokoban, tok, mode, k):
    """Each turn row (its prompt, then its answer) scored by one fresh forward pass gives the
    sampler's log-probs: continued and fresh caches both prefilled exactly that prompt."""
    model = Qwen2ForCausalLM(TINY, rngs=nnx.Rngs(0))
    env, params = sokoban
    ro = AgentRollout(env, params, tok, CFG.replace(
        {"max_turn": 3, "response_length": 12, "window": {"mode": mode, "turns": k}}))
    batch = ro.collect(Sampler(model, pad_id=tok.pad_token_id), SEEDS, jax.random.key(9))
    rows = batch.turn_samples()
    assert rows.input_ids.shape[0] == int(batch.num_turns.sum()) == 12
    assert (rows.loss_mask.sum(1) == [len(ep.answer_ids(t)) for ep in batch.episodes
                                      for t in range(1, 4)]).all()
    full = np.asarray(_full_logprobs(*nnx.split(model), jnp.asarray(rows.input_ids),
                                     jnp.asarray(rows.attention_mask)))
    np.testing.assert_allclose(rows.model_logprobs[rows.loss_mask], full[rows.loss_mask],
                               atol=1e-4)
    # The score sits on each answer's last token.
    last = rows.loss_mask.shape[1] - 1 - np.argmax(rows.loss_mask[:, ::-1], 1)
    np.testing.assert_allclose(rows.token_rewards[np.arange(12), last], batch.scores[rows.episode])
