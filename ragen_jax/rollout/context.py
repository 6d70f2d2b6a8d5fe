"""RAGEN's context manager: prompt text, chat-template token pieces, and response parsing.

Three parts, all host side and all small string work (generation and env steps run on the
device):

* **Wording** (``ContextConfig``): RAGEN's system message (env instruction, symbol legend,
  available actions) and per-turn user block (turn number, state, optional warning, actions
  left, output-format instruction), with the previous turn's reward before the next state.
  Every string is a config field. One deliberate change: the system message states the true
  per-turn action limit (``max_actions_per_turn``); RAGEN's says ``max_actions_per_traj``
  (10) while it executes only 2 per turn.
* **Token pieces** (``ChatFormat``): the tokenizer's chat template is rendered once with
  sentinel strings and cut into the literal text pieces around each message. A trajectory is
  then built chunk by chunk as ONE token sequence (the one generation saw and training reads)::

      [first_chunk(system, user_1)] [generated 1] [next_chunk(user_2)] [generated 2] ...

  ``first_chunk`` is the template prefix, the system message, the first user message and the
  assistant header (plus the ``<think>`` / ``<answer>`` tag RAGEN appends to the generation
  prompt). ``next_chunk`` is the template text between an assistant message's end-of-turn
  token and the next assistant header, with the user message in it. The end-of-turn token
  (``<|im_end|>`` for ChatML) is normally *generated* by the model (so it is trained on); if
  the model stopped without it (token budget, or another stop id such as a Hugging Face
  folder's extra ``eos_token_id`` ``<|endoftext|>``), ``next_chunk`` starts with it as
  inserted template text, so the sequence stays a well-formed chat
  (``...<|endoftext|><|im_end|>\n<|im_start|>user...``). Only these inserted chunks are ever
  tokenised; generated tokens are kept as sampled and never re-tokenised from decoded text.
  **A turn ended by a stop string** (``rollout.sampling.stop_strings``, e.g. ``</answer>``) is the
  same case: the trajectory holds the sampled tokens up to and including the one that
  completed the string (loss mask 1; that token may carry text past the string, e.g.
  ``>\n\n``, which stays, as sampled), and the model did not emit its end-of-turn token, so
  ``next_chunk`` inserts it as template text (loss mask 0, never a sampled token). The
  trainer's recomputed log-probs see the same sequence the sampler's cache held (the inserted
  token is prefilled with the next chunk), so they stay aligned with the sampled tokens; a
  last turn has no next chunk and ends the sequence without it. The model is then never
  trained to emit the end-of-turn token after ``</answer>``, which it does not need (vLLM's
  ``stop`` behaves alike; RAGEN sets no stop strings).
* **Parsing** (``parse_response``): RAGEN's ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>``
  pattern (answer-only when thinking is off), actions split on ``||``, stripped, empty parts
  dropped, the first ``max_actions_per_turn`` kept, matched case-insensitively to the env's
  action names. Stricter than RAGEN in three named ways, each a format error: a tag of the
  pattern appearing more than once (nested/duplicated tags, which RAGEN's lazy regex can
  accept), a special token generated before the end of the turn (RAGEN silently strips them),
  and an answer longer than ``max_answer_chars``. With thinking off the think tags are not part
  of the pattern and may stand anywhere, as in RAGEN (a stray ``<think>`` after the answer). A
  turn ended by any stop id (the end-of-turn token, the tokenizer's eos token or one of
  ``ChatFormat``'s ``eos_ids``) parses the same way: the stop token is not part of the text; a
  turn ended by a stop string parses its whole text (the string included: ``</answer>`` closes
  the answer). Parsing never raises and never evaluates model text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

# ChatML as Qwen2/2.5 writes it; used when a tokenizer has no chat template.
_CHATML = {
    "prefix": "<|im_start|>system\n",
    "system_to_user": "<|im_end|>\n<|im_start|>user\n",
    "user_to_assistant": "<|im_end|>\n<|im_start|>assistant\n",
    "assistant_to_user": "<|im_end|>\n<|im_start|>user\n",
}

# Instructions for envs that carry none (``instruction``) of their own, by class name: our
# wording (RAGEN's Bandit prompt lives in the observation, which our Bandit's render_text also
# provides). Sokoban and FrozenLake carry RAGEN's per tag and format.
ENV_INSTRUCTIONS = {
    "Bandit": (
        "You are playing a bandit game. Infer the risk of each arm from its name and choose the "
        "arm with the higher expected reward. The answer should be the name of one arm, like "
        "<answer>arm name</answer>"
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextConfig:
    """Prompt wording and per-turn parsing budget (defaults: RAGEN's wording).

    The fields without a default are run settings: ``RolloutConfig.context`` fills them from
    the run config (``config.rollout``, whose defaults are RAGEN's budget), so each default
    is written once.

    ``env_instruction`` None means the env's own ``instruction``, else
    ``ENV_INSTRUCTIONS[type(env).__name__]`` (or empty).
    ``prefill_tag``: append ``<think>`` (``<answer>`` when thinking is off) to the generation
    prompt as RAGEN does; the parser then prefixes it to the generated text.
    ``max_tokens_hint`` is only the number written in the prompt ("Max response length"); a
    rollout sets it to its per-turn token budget (``RolloutConfig.response_length``, RAGEN's
    ``max_tokens``) unless configured otherwise.
    """

    enable_think: bool
    max_actions_per_turn: int
    format_penalty: float
    max_tokens_hint: int
    max_answer_chars: int
    system_template: str  # the whole system message ({instruction} {legend} {actions} {max_actions_per_turn}); "" = RAGEN's composition below
    prefill_tag: bool = True
    action_sep: str = "||"
    env_instruction: str | None = None
    system_prefix: str = "You're a helpful assistant. "
    legend_template: str = "\nThe meaning of each symbol in the state is:\n{legend}"
    actions_template: str = (
        "\nYour available actions are:\n{actions}\nYou can make up to {max_actions_per_turn} "
        "actions per turn, separated by the action separator \" || \"\n"
    )
    turn_template: str = (
        "\nTurn {turn}:\nState:\n{state}\n{warning}You have {actions_left} actions left. "
        "Always output: {format} with no extra text. Strictly follow this format. Max response "
        "length: {max_tokens} words (tokens).\n"
    )
    reward_template: str = "Reward:\n{reward}\n"
    warning: str = (
        "No valid action provided previously. Environment state remains the same. Please try "
        "again.\n"
    )
    think_format: str = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
    answer_format: str = "<answer> [your answer] </answer>"

    def __post_init__(self):
        if self.max_actions_per_turn < 1:
            raise ValueError("max_actions_per_turn must be >= 1")
        if not self.action_sep:
            raise ValueError("action_sep must be a non-empty string")

    @property
    def answer_prefix(self) -> str:
        """The tag appended to the generation prompt (empty when ``prefill_tag`` is off)."""
        if not self.prefill_tag:
            return ""
        return "<think>" if self.enable_think else "<answer>"


# ----------------------------------------------------------------------------------------------
# Prompt text
# ----------------------------------------------------------------------------------------------


def system_message(env: Any, action_names: Sequence[str], cfg: ContextConfig) -> str:
    """RAGEN's system message: prefix, env instruction (the config's, else the env's own
    ``instruction``, else ``ENV_INSTRUCTIONS``), the env's ``observation_note()`` (how to read
    its state, if it has one), symbol legend (``symbol_legend()``, for grid text), available
    actions (none listed for a free-text env, as RAGEN lists them only with an
    ``action_lookup``). A ``system_template`` replaces the composition with its own text,
    filled with the same parts.

    The parts are concatenated as RAGEN's ``_init_prefix_lookup`` does, so an instruction's own
    line breaks lay the message out: RAGEN's Sokoban instructions are YAML blocks of lines
    ending in a newline, so the legend follows a blank line. RAGEN appends the legend for every
    Sokoban and FrozenLake tag (it reads the top-level format, always "grid"); here it is left
    out of ``coord`` text, which has no symbols (RAGEN has no ``coord``-only tag)."""
    name = type(env).__name__
    instruction = cfg.env_instruction
    if instruction is None:
        instruction = getattr(env, "instruction", None) or ENV_INSTRUCTIONS.get(name, "")
    legend = None
    if getattr(env, "observation_format", "grid") in ("grid", "grid_coord"):
        legend_fn = getattr(env, "symbol_legend", None)
        legend = legend_fn() if callable(legend_fn) else None
    if cfg.system_template:
        return cfg.system_template.format(instruction=instruction, legend=legend or "",
                                          actions=", ".join(action_names),
                                          max_actions_per_turn=cfg.max_actions_per_turn)
    text = cfg.system_prefix + instruction
    note = getattr(env, "observation_note", None)
    if callable(note) and note():
        text += "\n" + note()
    if legend:
        text += cfg.legend_template.format(legend=legend)
    if action_names:
        text += cfg.actions_template.format(actions=", ".join(action_names),
                                            max_actions_per_turn=cfg.max_actions_per_turn)
    return text


def format_reward(reward: float) -> str:
    """A turn reward as the prompt shows it (4 decimals at most, no float noise)."""
    r = round(float(reward), 4)
    return str(int(r)) if r == int(r) and abs(r) < 1e15 else repr(r)


def user_message(cfg: ContextConfig, *, turn: int, state: str, actions_left: int,
                 warning: bool = False, prev_reward: float | None = None) -> str:
    """One turn's user block; ``prev_reward`` (the previous turn's reward) goes first."""
    text = "" if prev_reward is None else cfg.reward_template.format(reward=format_reward(prev_reward))
    text += cfg.turn_template.format(
        turn=turn,
        state=state,
        warning=cfg.warning if warning else "",
        actions_left=actions_left,
        format=cfg.think_format if cfg.enable_think else cfg.answer_format,
        max_tokens=cfg.max_tokens_hint,
    )
    return text


# ----------------------------------------------------------------------------------------------
# Chat-template pieces and tokenisation
# ----------------------------------------------------------------------------------------------

# Not whitespace (templates that strip contents keep them) and lower case (so a template that
# rewrites contents is detected).
_SENTINELS = ("@@sys-7f3a@@", "@@user1-7f3a@@", "@@assistant1-7f3a@@", "@@user2-7f3a@@")


class ChatFormat:
    """The tokenizer's chat template cut into literal pieces, and chunk tokenisation.

    The template is rendered once for ``[system, user, assistant, user]`` with sentinel
    contents and generation prompt on; the text around the sentinels gives ``prefix``,
    ``system_to_user``, ``user_to_assistant`` (the assistant header), ``assistant_end`` (the
    end-of-turn token text the model should emit) and ``assistant_to_user``. Templates that
    drop or rewrite message contents are not supported (checked: every sentinel must appear
    once and the two assistant headers must agree); a tokenizer without a template gets
    ChatML.

    ``eos_ids``: further ids that end a generation, such as the ``eos_token_id`` list of a
    Hugging Face folder's ``generation_config.json`` (Qwen2.5-Instruct adds
    ``<|endoftext|>``), on which vLLM and ``transformers.generate`` stop too.
    ``stop_strings``: the rollout's stop strings; a turn whose text contains one ended on it
    (``GeneratedText.stopped``; the sampler stops at the first completion).

    Attributes: ``eot_id`` (end-of-turn token id), ``stop_ids`` (ids that end a generation:
    the end-of-turn token first, then the tokenizer's eos token and ``eos_ids``, without
    repeats), ``special_ids`` (ids of every special token and stop id; a generated one before
    the final stop token is a format error), ``pad_id``.
    """

    def __init__(self, tokenizer: Any, cfg: ContextConfig, *, eos_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.stop_strings = tuple(stop_strings)
        pieces = _template_pieces(tokenizer)
        self.prefix = pieces["prefix"]
        self.system_to_user = pieces["system_to_user"]
        self.user_to_assistant = pieces["user_to_assistant"]
        after = pieces["assistant_to_user"]
        self.eot_text = _leading_special(tokenizer, after)
        if not self.eot_text:
            raise ValueError(f"chat template: no end-of-turn special token after an assistant "
                             f"message (got {after[:40]!r})")
        self.assistant_to_user = after[len(self.eot_text):]
        self.eot_id = int(tokenizer.convert_tokens_to_ids(self.eot_text))
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        stops = list(dict.fromkeys(int(i) for i in [self.eot_id, *eos, *eos_ids]))
        self.stop_ids = np.asarray(stops, np.int32)
        specials = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special]
        self.special_ids = np.asarray(sorted(set(specials) | set(stops)), np.int32)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)

    # -- chunk text ----------------------------------------------------------------------------

    def first_chunk(self, system: str, user: str) -> str:
        """Template prefix + system + first user message + assistant header (+ tag)."""
        return (self.prefix + system + self.system_to_user + user + self.user_to_assistant
                + self.cfg.answer_prefix)

    def next_chunk(self, user: str, *, emitted_eot: bool) -> str:
        """Text inserted after a generated turn: [end-of-turn if the model did not emit it],
        the glue to the next user message, the message, and the next assistant header."""
        eot = "" if emitted_eot else self.eot_text
        return (eot + self.assistant_to_user + user + self.user_to_assistant
                + self.cfg.answer_prefix)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenises inserted (template/env) text, one list of ids per string, batched."""
        if not texts:
            return []
        out = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [list(map(int, ids)) for ids in out]

    # -- generated text ------------------------------------------------------------------------

    def generated_text(self, ids: Sequence[int] | np.ndarray) -> GeneratedText:
        """Decodes one turn's generated ids for parsing (see ``GeneratedText``); every stop
        id ends a turn the same way, and a stop string in the text means the turn ended on it."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        stopped = bool(ids.size) and bool(np.isin(ids[-1], self.stop_ids))
        body = ids[:-1] if stopped else ids
        special_inside = bool(np.isin(body, self.special_ids).any())
        text = self.tokenizer.decode(body.tolist(), skip_special_tokens=False)
        stopped = stopped or any(s in text for s in self.stop_strings)
        return GeneratedText(text, stopped, special_inside)

    def emitted_eot(self, ids: Sequence[int] | np.ndarray) -> bool:
        """Whether a turn's generated ids end with the end-of-turn token itself; otherwise
        (token budget, another stop id, or a stop string) ``next_chunk`` must insert it."""
        ids = np.asarray(ids).reshape(-1)
        return bool(ids.size) and int(ids[-1]) == self.eot_id


class GeneratedText(NamedTuple):
    """One turn's generated ids, decoded: ``text`` without the final stop token, ``stopped``
    (the turn ended with a stop id or a stop string rather than at the token budget) and
    ``special_inside`` (a special token was generated before the end: a format error)."""

    text: str
    stopped: bool
    special_inside: bool


def _template_pieces(tokenizer: Any) -> dict[str, str]:
    if not getattr(tokenizer, "chat_template", None):
        return dict(_CHATML)
    s, u1, a1, u2 = _SENTINELS
    msgs = [{"role": "system", "content": s}, {"role": "user", "content": u1},
            {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if any(text.count(x) != 1 for x in _SENTINELS):
        raise ValueError("chat template does not render message contents verbatim; "
                         "ChatFormat cannot cut it into pieces")
    i_s, i_u1, i_a1, i_u2 = (text.index(x) for x in _SENTINELS)
    pieces = {
        "prefix": text[:i_s],
        "system_to_user": text[i_s + len(s):i_u1],
        "user_to_assistant": text[i_u1 + len(u1):i_a1],
        "assistant_to_user": text[i_a1 + len(a1):i_u2],
    }
    tail = text[i_u2 + len(u2):]
    if tail != pieces["user_to_assistant"]:
        raise ValueError(f"chat template: inconsistent assistant headers {tail!r} vs "
                         f"{pieces['user_to_assistant']!r}")
    return pieces


def _leading_special(tokenizer: Any, text: str) -> str:
    """The longest special token string that ``text`` starts with ('' if none)."""
    best = ""
    for tok in tokenizer.added_tokens_decoder.values():
        if tok.special and text.startswith(tok.content) and len(tok.content) > len(best):
            best = tok.content
    return best


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------

_THINK_RE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@dataclasses.dataclass
class ParsedTurn:
    """One parsed response.

    ``actions``: the kept action strings (first ``max_actions_per_turn`` parts);
    ``action_ids``: the ids of the valid ones, in order (what the env executes): indices into
    the action names, or for a free-text env (no action names) into ``actions`` (all valid);
    ``format_error``: the turn earns the format penalty (no match, a malformed answer, an
    unknown action name, or no valid action); ``reason`` says which, for the viewer/metrics.
    """

    think: str
    answer: str
    actions: list[str]
    action_ids: list[int]
    format_error: bool
    reason: str

    @property
    def num_invalid(self) -> int:
        return len(self.actions) - len(self.action_ids)


def parse_response(text: str, action_names: Sequence[str], cfg: ContextConfig, *,
                   special_inside: bool = False) -> ParsedTurn:
    """Parses one generated response (``text`` already prefixed with the prefilled tag).

    Empty ``action_names`` means a free-text env (a host env such as Countdown): every kept
    part is an action, passed to the env as written. Never raises for any string; model text
    is only matched, split and compared.
    """
    if not isinstance(text, str):
        text = str(text)
    if special_inside:
        return ParsedTurn("", "", [], [], True, "special token")
    # Thinking off: the think tags are not part of the pattern, so (as RAGEN's search and its
    # tag stripping) they may stand anywhere, e.g. a stray <think> after the answer.
    pattern_tags = _TAGS if cfg.enable_think else _TAGS[2:]
    if any(text.count(t) != 1 for t in pattern_tags):
        return ParsedTurn("", "", [], [], True, "tags")
    if cfg.enable_think:
        m = _THINK_RE.search(text)
        think, answer = (m.group(1), m.group(2)) if m else ("", "")
    else:
        m = _ANSWER_RE.search(text)
        think, answer = "", (m.group(1) if m else "")
        answer = answer.replace("<think>", "").replace("</think>", "")
    if m is None:
        return ParsedTurn("", "", [], [], True, "pattern")
    if len(answer) > cfg.max_answer_chars:
        return ParsedTurn(think, answer, [], [], True, "answer too long")
    parts = [p.strip() for p in answer.split(cfg.action_sep)]
    actions = [p for p in parts if p][: cfg.max_actions_per_turn]
    if not action_names:
        ids = list(range(len(actions)))
    else:
        lookup = {str(n).strip().lower(): i for i, n in enumerate(action_names)}
        ids = [lookup[a.lower()] for a in actions if a.lower() in lookup]
    if not ids:
        return ParsedTurn(think, answer, actions, [], True, "no valid action")
    if len(ids) != len(actions):
        return ParsedTurn(think, answer, actions, ids, True, "unknown action")
    return ParsedTurn(think, answer, actions, ids, False, "")
