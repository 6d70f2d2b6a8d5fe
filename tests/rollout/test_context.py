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
    fl_coord, _ = make("frozenlake", observation_format="coord")  # which way coordinates run
    text = system_message(fl_coord, fl_coord.action_names, CFG)
    assert "like <answer>Left || Up</answer>\nCoordinates are (row, col), from (0, 0)" in text
    assert "O: hole" not in text and "Coordinates are" not in system_message(fl, fl.action_names, CFG)
    custom = system_message(env, env.action_names, dataclasses.replace(RolloutConfig().context, env_instruction='Push.'))
    assert custom.startswith("You're a helpful assistant. Push.\n")


# RAGEN V2's config/envs.yaml env_instruction blocks (mll-lab-nu/RAGEN 20daedc), line by line
# as the YAML holds them, trailing spaces included.
RAGEN_INSTRUCTION_LINES = {
    "SimpleSokoban": [
        "You are solving the Sokoban puzzle. ",
        "You are the player and you need to push all boxes to targets. ",
        "When you are right next to a box, you can push it by moving in the same direction. ",
        "You cannot push a box through a wall, and you cannot pull a box. ",
        "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>",
    ],
    "CoordSokoban": [
        "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.",
        "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. ",
        "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). ",
        "When you are exactly next to a box, you can push it by moving in the same direction. ",
        "You cannot push a box through a wall, and you cannot pull a box.",
        "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.",
    ],
    "CoordFrozenLake": [
        "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed coordinates for the start, goal, player, and any holes.",
        "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).",
        "Beware that the ice is slippery, so the agent might slide and end up in an unintended tile.",
        "Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.",
    ],
}
# The env config dataclasses' defaults RAGEN's system message reads (grid_vocab, action_lookup).
RAGEN_VOCAB = {
    "sokoban": ({"#": "wall", "_": "empty", "O": "target", "√": "box on target", "X": "box",
                 "P": "player", "S": "player on target"}, ["Up", "Down", "Left", "Right"]),
    "frozenlake": ({"P": "player", "_": "empty", "O": "hole", "G": "goal",
                    "X": "player in hole", "√": "player on goal"}, ["Left", "Down", "Right", "Up"]),
}


def ragen_system_message(tag: str, env: str, max_actions_per_traj: int = 10) -> str:
    """RAGEN's ContextManager._init_prefix_lookup and _build_system_content: the instruction (a
    YAML literal block: its lines joined by newlines, one final newline), the legend (the
    top-level observation_format it checks is the dataclass default "grid"), the actions."""
    vocab, actions = RAGEN_VOCAB[env]
    text = "\n".join(RAGEN_INSTRUCTION_LINES[tag]) + "\n"
    text += "\nThe meaning of each symbol in the state is:\n" + ", ".join(f"{k}: {v}" for k, v in vocab.items())
    text += "\nYour available actions are:\n" + ", ".join(actions)
    text += f"\nYou can make up to {max_actions_per_traj} actions, separated by the action separator \" || \"\n"
    return "You're a helpful assistant. " + text


@pytest.mark.parametrize("tag,env,kwargs,corner", [
    ("SimpleSokoban", "sokoban", {}, None),
    ("SimpleSokoban", "sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}, None),  # LargerSokoban
    ("CoordSokoban", "sokoban", {"observation_format": "grid_coord"}, None),
    ("CoordSokoban", "sokoban", {"observation_format": "grid_coord", "dim_room": (7, 8)}, "(6, 7)"),
    ("CoordFrozenLake", "frozenlake", {"observation_format": "grid_coord"}, "(3, 3)"),
    ("CoordFrozenLake", "frozenlake", {"observation_format": "grid_coord", "size": 6}, None),
])
def test_system_message_is_ragens(tag, env, kwargs, corner):
    """RAGEN's system message, but for the two documented differences: the true per-turn action
    limit, and the Coord instructions' corner (RAGEN's (5, 5)) where the board is not 6x6."""
    e, _ = make(env, **kwargs)
    ragen = ragen_system_message(tag, env)
    ours = ragen.replace("up to 10 actions,", "up to 2 actions per turn,")
    if corner:
        ours = ours.replace("corner (5, 5)", f"corner {corner}")
    assert system_message(e, e.action_names, CFG) == ours


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


def ragen_parse_think_off(text: str, max_actions: int = 2) -> list[str]:
    """RAGEN's ContextManager._parse_response with enable_think=False: the first
    <answer>..</answer> anywhere, its special tags stripped, split on "||"."""
    import re

    match = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if not match:
        return []
    content = match.group(1)
    for tag in ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]:
        content = content.replace(tag, "").strip()
    return [a.strip() for a in content.split("||") if a.strip()][:max_actions]


@pytest.mark.parametrize("text", [
    "<answer>Up</answer><think>",  # a stray think tag after the answer
    "<answer>Up || Left</answer>\n<think>next I will go down</think>",
    "<think>plan</think><answer>Down</answer>",  # a think block before (no prefilled tag)
    "<answer>Up<think></answer>",  # RAGEN strips tags inside the answer
    "<answer> Right </answer></think>",
])
def test_think_off_accepts_think_tags_as_ragen_does(text):
    nothink = dataclasses.replace(RolloutConfig().context, enable_think=False)
    p = parse_response(text, NAMES, nothink)
    assert not p.format_error, p
    assert p.actions == ragen_parse_think_off(text)
    # The answer's own tags stay strict (RAGEN takes the first of two answers).
    assert parse_response(text + "<answer>Up</answer>", NAMES, nothink).reason == "tags"


def test_think_on_keeps_think_tags_in_the_pattern():
    p = parse_response("<think>a</think><answer>Up</answer><think>", NAMES, CFG)
    assert p.format_error and p.reason == "tags"


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
