"""Tokenizers: a Hugging Face model folder's own, or the built-in one of the tiny preset.

The built-in tokenizer is a byte-level BPE trained in code, at first use, on a fixed corpus of
the text the RAGEN environments and prompts produce (action words, bandit arm names, the turn
template, grid symbols, numbers). Byte-level means any string round-trips, even text the
corpus never showed; the corpus only decides which strings are compact. It is deterministic
(same corpus, same trainer settings, no randomness) and needs no download.

Grid cells stay one token each: the corpus has no grid rows, so no merge joins ``#__`` or
``_#\n`` into one token. A 6x6 Sokoban row is then always 7 tokens (6 cells and the newline),
and "the cell below the player" is always 7 tokens later, a fixed offset that rotary attention
can learn; with merged runs the same cell sat at a different offset in every state.

Specials follow Qwen2.5's ChatML: ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>``
(end of turn, the eos token). ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` and
``||`` are single ordinary tokens (kept by ``decode(skip_special_tokens=True)``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from ragen_jax.models.hf_folder import (
    CheckpointError,
    check_tokenizer_files,
    describe_error,
    unreadable_file,
)

# The tiny preset's vocabulary size (the model's embedding rows); the BPE never exceeds it.
TINY_VOCAB_SIZE = 1024

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "||")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML, as Qwen2.5 writes it, without Qwen's default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load(path: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, or the built-in tiny one for ``None`` / ``"tiny"``.

    Folders load through ``transformers.AutoTokenizer`` without remote code, keeping the
    folder's chat template. A folder without tokenizer files, or whose files do not load, is
    a one-line ``CheckpointError``.
    """
    if path is None or str(path) == "tiny":
        return builtin()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer folder not found: {path}")
    check_tokenizer_files(path)
    # Imported here: AutoTokenizer's model registry imports torch wherever it is installed
    # (seconds at every start), and the built-in tokenizer needs none of it.
    from transformers import AutoTokenizer

    # transformers reads config.json here too and logs its own complaints about it (e.g. eos
    # ids past a too-small vocabulary); ragen_jax checks the folder and says it in one line.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers/tokenizers raise many types for a broken file
        bad = unreadable_file(path)  # their errors do not say which file
        raise CheckpointError(bad or f"{path}: cannot load its tokenizer ({describe_error(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    # Qwen2's own text pipeline (NFC, its split regex: single digits, then byte-level), so
    # that an exported folder, which transformers loads as ``Qwen2Tokenizer`` (it rebuilds
    # this pipeline from ``model_type``), tokenises exactly as we do.
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens(list(TAG_TOKENS))
    return tok.to_str()


def builtin() -> PreTrainedTokenizerFast:
    """The built-in tiny tokenizer (a fresh wrapper each call; training is cached)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    if len(tok) > TINY_VOCAB_SIZE:
        raise RuntimeError(f"built-in tokenizer has {len(tok)} > {TINY_VOCAB_SIZE} tokens")
    return tok


# ----------------------------------------------------------------------------------------------
# The fixed training corpus
# ----------------------------------------------------------------------------------------------

# Grid symbols, spaced, and "√" (3 bytes) alone between letters so that it becomes one token;
# no two cells ever meet, so none merge (see the module docstring).
_GRID_CELLS = " ".join("#_OX√PSG" * 4) + " " + "a√" * 8
_ARMS = ["Teacher", "Trader", "Librarian", "Investor", "Gardener", "Cryptominer", "Receptionist",
         "Explorer", "Cashier", "DataScientist", "phoenix", "dragon"]

_SOKOBAN_SYSTEM = (
    "You're a helpful assistant. You are solving the Sokoban puzzle. You are the player and you "
    "need to push all boxes to targets. When you are right next to a box, you can push it by "
    "moving in the same direction. You cannot push a box through a wall, and you cannot pull a "
    "box. The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>"
    "\nThe meaning of each symbol in the state is:\n#: wall, _: empty, O: target, √: box on "
    "target, X: box, P: player, S: player on target\nYour available actions are:\nUp, Down, "
    "Left, Right\nYou can make up to 10 actions, separated by the action separator \" || \"\n"
)
_FROZEN_SYSTEM = (
    "You're a helpful assistant. You are walking on a frozen lake. Reach the goal G without "
    "falling into a hole O. The ice is slippery, so you may move in a direction you did not "
    "choose.\nThe meaning of each symbol in the state is:\nP: player, _: empty, O: hole, "
    "G: goal, X: player in hole, √: player on goal\nYour available actions are:\nLeft, Down, "
    "Right, Up\n"
)
_BANDIT_PROMPT = (
    "You are playing a bandit game. There are two arms, {a} and {b}. Each arm gives points "
    "drawn from an unknown reward distribution. Infer the risk of each arm from its name and "
    "choose the arm with the higher expected reward. Answer with the name of one arm, like "
    "<answer> {a} </answer>."
)
_TURN = (
    "\nTurn {k}:\nState:\n{obs}\nYou have {left} actions left. Always output: <think> [Your "
    "thoughts] </think> <answer> [your answer] </answer> with no extra text. Strictly follow "
    "this format. Max response length: {mt} words (tokens).\n"
)
_WARNING = ("No valid action provided previously. Environment state remains the same. Please "
            "try again.\n")
_THOUGHTS = [
    "The box is to the left of the target, so I should push it right.",
    "I am above the box. I need to move down to push the box down onto the target.",
    "The goal is below and to the right. I will move right then down and avoid the hole.",
    "The player is next to a wall. Moving up is not possible, so I go left first.",
    "A teacher has a stable income with low risk, while a trader takes more risk for a higher "
    "reward. I choose the arm with the higher expected value.",
    "Let me think step by step about where the player is and where the box should go.",
    "The first action moves the player, the second action pushes the box onto the target.",
]
_ENGLISH = (
    "the a an is are was be to of and in on at for with by from as it this that these those "
    "I you we he she they my your our me us what which who when where why how if then else so "
    "not no yes can cannot should would will must may might do does did done have has had "
    "first second next last left right up down above below near far one two three four five "
    "move moves moving push pushes pushed pull go goes step steps turn turns action actions "
    "state reward rewards points score player box boxes target targets wall walls empty hole "
    "holes goal grid map row rows col cols column board position coordinates zero indexed "
    "answer think thought thoughts reason because therefore need want try again valid invalid "
    "correct wrong best better higher lower more less risk income expected value arm arms"
)


def _corpus() -> list[str]:
    """The fixed corpus: prompt templates filled with env-like values, plus plain words."""
    texts = [_SOKOBAN_SYSTEM, _FROZEN_SYSTEM, _WARNING, _ENGLISH, _ENGLISH.capitalize()]
    for k in range(1, 11):
        for i in range(8):
            texts.append(_TURN.format(k=k, obs=_GRID_CELLS, left=10 - k + i % 3, mt=100 + 20 * (i % 2)))
    for a, b in zip(_ARMS[::2], _ARMS[1::2], strict=True):
        texts.append(_BANDIT_PROMPT.format(a=a, b=b))
        texts.append(f"{a}: 0.1 points\n{b}: 1.0 points\n{b}: 0.0 points")
    moves = ["Up", "Down", "Left", "Right"]
    for i, thought in enumerate(_THOUGHTS * 3):
        acts = " || ".join(moves[(i + j) % 4] for j in range(1 + i % 3))
        texts.append(f"<think>{thought}</think><answer>{acts}</answer>")
        texts.append(f"<think> {thought} </think> <answer> {acts} </answer>")
    for r in range(10):
        texts.append(f"Reward:\n{-0.1 * r:.1f}\nReward:\n{r}\nReward:\n10.0\nReward:\n-1.0")
        texts.append(f"Board size: 6 rows x 6 cols (zero-indexed).\nTargets: ({r % 6}, {r // 2})"
                     f"\nBoxes: ({(r + 2) % 6}, {r % 4})\nPlayer: ({r % 5}, {(r + 3) % 6})")
    texts.append(" ".join(str(n) for n in range(200)))
    texts.append("system user assistant\nsystem\nuser\nassistant\n")
    return texts
