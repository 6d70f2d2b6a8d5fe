"""Context manager: prompt wording, chat-template pieces, and the never-raising parser."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import make
from ragen_jax.models import tokenizer as tk
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.context import (
    ChatFormat,
    parse_response,
    system_message,
    user_message,
)

CFG = RolloutConfig().context
NAMES = ("Up", "Down", "Left", "Right")


@pytest.fixture(scope="module")
def chat(tok):
    return ChatFormat(tok, CFG)


# ---------------------------------------------------------------------------------- wording


def test_system_message_states_true_per_turn_limit():
    env, _ = make("sokoban")
    text = system_message(env, env.action_names, dataclasses.replace(RolloutConfig().context, max_actions_per_turn=3))
    assert text.startswith("You're a helpful assistant. You are solving the Sokoban puzzle.")
    assert "\nThe meaning of each symbol in the state is:\n#: wall, _: empty" in text
    assert "Your available actions are:\nUp, Down, Left, Right\n" in text
    assert "up to 3 actions per turn" in text and "10" not in text
    coord, _ = make("sokoban", observation_format="coord")
    assert "meaning of each symbol" not in system_message(coord, coord.action_names, CFG)
    fl, _ = make("frozenlake")
    assert "O: hole, G: goal" in system_message(fl, fl.action_names, CFG)
    fl_coord, _ = make("frozenlake", observation_format="coord")  # the board is said once
    text = system_message(fl_coord, fl_coord.action_names, CFG)
    assert "like <answer>Left || Up</answer>\nBoard size: 4 rows x 4 cols;" in text
    assert "O: hole" not in text and "Board size" not in system_message(fl, fl.action_names, CFG)
    custom = system_message(env, env.action_names, dataclasses.replace(RolloutConfig().context, env_instruction='Push.'))
    assert custom.startswith("You're a helpful assistant. Push.\n")


def test_system_template_replaces_the_system_message():
    env, _ = make("sokoban")
    cfg = dataclasses.replace(RolloutConfig().context, max_actions_per_turn=3, system_template='{instruction}@{legend}@{actions}@{max_actions_per_turn}')
    parts = system_message(env, env.action_names, cfg).split("@")
    assert parts[0].startswith("You are solving the Sokoban puzzle.") and parts[1].startswith("#: wall, _: empty")
    assert parts[2:] == ["Up, Down, Left, Right", "3"]
    coord, _ = make("sokoban", observation_format="coord")  # no grid: no legend
    assert system_message(coord, coord.action_names, dataclasses.replace(RolloutConfig().context, system_template='[{legend}]')) == "[]"
    with pytest.raises(ValueError, match="rollout.prompt.system_template"):
        RolloutConfig(prompt=PromptConfig(system_template='{board}'))


def test_user_message_layout():
    first = user_message(CFG, turn=1, state="#P#", actions_left=10)
    assert first == (
        "\nTurn 1:\nState:\n#P#\nYou have 10 actions left. Always output: <think> [Your "
        "thoughts] </think> <answer> [your answer] </answer> with no extra text. Strictly "
        "follow this format. Max response length: 400 words (tokens).\n")
    later = user_message(CFG, turn=3, state="#P#", actions_left=7, warning=True,
                         prev_reward=-0.1)
    assert later.startswith("Reward:\n-0.1\n\nTurn 3:\nState:\n#P#\nNo valid action provided "
                            "previously. Environment state remains the same. Please try "
                            "again.\nYou have 7 actions left.")
    assert "Reward:\n10\n" in user_message(CFG, turn=2, state="", actions_left=1,
                                           prev_reward=10.0)
    nothink = user_message(dataclasses.replace(RolloutConfig().context, enable_think=False), turn=1, state="", actions_left=1)
    assert "Always output: <answer> [your answer] </answer> with" in nothink


# ---------------------------------------------------------------------------------- pieces


def test_chunks_reproduce_the_chat_template(tok, chat):
    system, u1, u2 = "SYS text", "\nTurn 1:\nState:\nP_\n", "Reward:\n0\n\nTurn 2:\nState:\n_P\n"
    gen = tok("I go right</think><answer>Right</answer>", add_special_tokens=False)["input_ids"]
    gen = gen + [tok.eos_token_id]  # the model ends its turn
    c1, c2 = chat.encode([chat.first_chunk(system, u1), chat.next_chunk(u2, emitted_eot=True)])
    whole = tok.decode(c1 + gen + c2)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": u1},
            {"role": "assistant", "content": "<think>I go right</think><answer>Right</answer>"},
            {"role": "user", "content": u2}]
    assert whole == tok.apply_chat_template(msgs, tokenize=False,
                                            add_generation_prompt=True) + "<think>"
    # Inserted chunks never start with the end-of-turn token when the model emitted it ...
    assert c2[0] != chat.eot_id
    # ... and do when it did not (budget-truncated answer).
    assert chat.encode([chat.next_chunk(u2, emitted_eot=False)])[0][0] == chat.eot_id
    assert chat.eot_id == tok.eos_token_id and list(chat.stop_ids) == [tok.eos_token_id]


def test_generated_text_flags(tok, chat):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    body = tok("<answer>Up</answer>", add_special_tokens=False)["input_ids"]
    text, stopped, special = chat.generated_text(body + [chat.eot_id])
    assert (text, stopped, special) == ("<answer>Up</answer>", True, False)
    text, stopped, special = chat.generated_text(body)
    assert (text, stopped, special) == ("<answer>Up</answer>", False, False)  # budget cut
    assert chat.generated_text(body[:1] + [im_start] + body[1:] + [chat.eot_id])[2]
    assert chat.generated_text([])[:2] == ("", False)


# ---------------------------------------------------------------------------------- parsing


def test_parse_valid_and_budget():
    p = parse_response("<think>plan</think>\n <answer> up || LEFT ||  right </answer>", NAMES, CFG)
    assert (p.think, p.actions, p.action_ids, p.format_error) == (
        "plan", ["up", "LEFT"], [0, 2], False)
    p = parse_response("<think></think><answer>Down||||</answer>", NAMES, CFG)
    assert p.action_ids == [1] and not p.format_error
    # Text after the answer is tolerated, as RAGEN's search does.
    assert not parse_response("<think>a</think><answer>Up</answer> ok", NAMES, CFG).format_error
    nothink = dataclasses.replace(RolloutConfig().context, enable_think=False)
    p = parse_response("<answer>Right</answer>", NAMES, nothink)
    assert p.action_ids == [3] and not p.format_error


@pytest.mark.parametrize("text,reason", [
    ("", "tags"),
    ("Up", "tags"),
    ("<think>a</think>Up", "tags"),
    ("<answer>Up</answer>", "tags"),  # thinking on: the think block is required
    ("<think>a</think><answer>Up", "tags"),
    ("<think><think>a</think></think><answer>Up</answer>", "tags"),  # nested
    ("<think>a</think><answer><answer>Up</answer></answer>", "tags"),
    ("<think>a</think><answer>Up</answer><answer>Down</answer>", "tags"),
    ("<answer>Up</answer><think>a</think>", "pattern"),  # wrong order
    ("<think>a</think> x <answer>Up</answer>", "pattern"),  # text between the blocks
    ("<think>a</think><answer></answer>", "no valid action"),
    ("<think>a</think><answer> || </answer>", "no valid action"),
    ("<think>a</think><answer>Jump</answer>", "no valid action"),
    ("<think>a</think><answer>Up || Jump</answer>", "unknown action"),
    ("<think>a</think><answer>" + "Up || " * 200 + "</answer>", "answer too long"),
    ("<think>a</think><answer>__import__('os').system('x')</answer>", "no valid action"),
])
def test_parse_malformed_gets_penalty(text, reason):
    p = parse_response(text, NAMES, CFG)
    assert p.format_error and p.reason == reason, p
    if reason == "unknown action":
        assert p.action_ids == [0]  # the valid action still runs, penalty once
    else:
        assert p.action_ids == []


def test_parse_special_token_inside():
    p = parse_response("<think>a</think><answer>Up</answer>", NAMES, CFG, special_inside=True)
    assert p.format_error and p.action_ids == []


def test_first_actions_kept_only():
    p = parse_response("<think>a</think><answer>Up || Down || Jump</answer>", NAMES, CFG)
    assert p.actions == ["Up", "Down"] and p.action_ids == [0, 1] and not p.format_error


_TOKENS = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "||", "Up", "down",
                           "LEFT", " ", "\n", "<|im_end|>", "<", ">", "/", "Jump", "😀", "\x00"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(_TOKENS, max_size=40).map("".join)))
def test_parse_never_raises(text):
    p = parse_response(text, NAMES, CFG)
    assert isinstance(p.format_error, bool)
    assert len(p.action_ids) <= CFG.max_actions_per_turn
    assert all(0 <= a < len(NAMES) for a in p.action_ids)
    # No penalty implies a well-formed answer whose every kept action is a known name.
    if not p.format_error:
        assert text.count("<think>") == 1 and text.count("</answer>") == 1
        assert p.actions and len(p.action_ids) == len(p.actions)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_parse_unstructured_text_is_penalised(text):
    """Text without the four tags (whatever else it holds) always gets the penalty."""
    text = text.replace("<think>", "").replace("<answer>", "")
    assert parse_response(text, NAMES, CFG).format_error


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1023), max_size=60))
def test_generated_ids_never_raise(chat, ids):
    text, _, special = chat.generated_text(np.asarray(ids))
    p = parse_response("<think>" + text, NAMES, CFG, special_inside=special)
    if special:
        assert p.format_error


def test_template_fallback_and_rejection():
    plain = tk.load(None)
    plain.chat_template = None  # no template: ChatML pieces
    chat = ChatFormat(plain, CFG)
    assert chat.first_chunk("S", "U") == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n<think>")
    assert dataclasses.replace(RolloutConfig().context, prefill_tag=False).answer_prefix == ""
    assert dataclasses.replace(RolloutConfig().context, enable_think=False).answer_prefix == "<answer>"
    rewriting = tk.load(None)
    rewriting.chat_template = rewriting.chat_template.replace(
        "message['content']", "(message['content'] | upper)")
    with pytest.raises(ValueError, match="verbatim"):
        ChatFormat(rewriting, CFG)
