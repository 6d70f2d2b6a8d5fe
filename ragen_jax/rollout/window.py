"""Context windows: what each turn's prompt shows of the episode (``rollout.window.mode``).

RAGEN's ``context_window_mode``, three ways to build the prompt of turn t:

* ``full`` (the default): the whole episode so far as ONE token sequence,
  ``[system + user 1][answer 1][user 2][answer 2] ... [user t]``. **KV cache:** turn t
  prefills only its new chunk (``[user t]``) into the cache the previous turn left; the
  trajectory is never re-encoded. The transcript is the training row
  (``algorithm.sample_unit=trajectory``), or each turn's prefix of it is (``turn``).
* ``limited`` (RAGEN's ``limited_multi_turn``) with ``window_turns = k``: the system message
  and the last k turns, the current one included (k = 1: the current state only; RAGEN's
  ``max_context_window``; 0 = every turn). The oldest turn shown keeps its true turn number
  and loses its ``Reward:`` line (that reward belongs to the turn before it, which is not
  shown), as RAGEN's prompt does. **KV cache:** while no turn has been dropped (t <= k) the
  prompt extends the previous turn's sequence and the cache is continued as in ``full``; once
  the window slides, every turn's prompt is a new sequence (its first tokens changed), so the
  whole prompt is prefilled into a fresh cache: a window that drops turns cannot reuse the
  cache (``experiments/benchmarks/bench_rollout.py --windows`` measures what that costs).
* ``single_turn`` (RAGEN's ``single_turn`` with its ``SimpleMemory``): the system message and
  ONE user message in which the last k - 1 turns are summarised
  (``Summary: N step(s) completed so far. Showing the last K turn(s) ... Turn i State: ...
  Turn i Action: ... Turn i Reward: ...``, then ``Current Turn (Turn t):`` and the turn's
  state block; ``(Turn 1):`` with no history, as RAGEN writes it). **KV cache:** none across
  turns: every turn's prompt is prefilled into a fresh cache.

Every mode keeps generation jitted with bucketed shapes: a prompt is either a new chunk
continuing the cache or a whole prompt prefilled into a fresh cache, each left-padded to the
sampler's bucket. The prompts of ``limited`` and ``single_turn`` are rebuilt on the host each
turn from token pieces: only inserted text (template glue, the system message, turn blocks,
summary lines) is tokenised, once per piece; the answers are the sampled token ids, spliced
in as they were generated and never re-tokenised from decoded text (RAGEN re-tokenises its
re-serialised ``<think>..</think><answer>..</answer>`` text; a ``single_turn`` summary here
shows the sampled answer itself, with the prefilled ``<think>`` tag before it and without its
stop token).

**Over-long prompts** (``rollout.window.overlong``): a turn whose prompt plus a full answer
(``response_length``) would exceed ``max_model_len`` either ends the episode (``end``, the
default: truncated, counted in ``rollout/length_truncated``) or drops the oldest turns shown,
the system message kept, until it fits (``truncate``: RAGEN's ``_apply_max_length``, which
drops whole user/assistant turns from the left; a ``single_turn`` summary loses its oldest
entries, RAGEN's ``_fit_single_turn_history_start_to_max_len``). A turn that does not fit
even alone ends the episode. In ``full`` mode a truncated window makes the prompt a new
sequence, prefilled afresh; the next turns continue its cache until the next cut. Cutting
makes the transcript no longer the sequence each turn saw, so ``truncate`` trains turn-wise
(``algorithm.sample_unit=turn``; the config checks it).

Each played turn records the prompt it was given (``Episode.turn_prompts``): turn-wise
training rows are that prompt followed by the turn's answer (``batch.TurnSamples``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ragen_jax.rollout.context import ChatFormat, format_reward

if TYPE_CHECKING:
    from ragen_jax.rollout.batch import Episode

MODES = ("full", "limited", "single_turn")
OVERLONG = ("end", "truncate")

# RAGEN's SimpleMemory wording (ragen/llm_agent/memory/simple_memory.py).
SUMMARY = ("Summary: {steps} step(s) completed so far. Showing the last {shown} turn(s) with "
           "state/action/reward details. Recent turns:\n---\n")
MEMORY_STATE = "Turn {turn} State:\n{state}\nTurn {turn} Action: "
MEMORY_REWARD = "\nTurn {turn} Reward: {reward}\n---\n"
CURRENT = "(Turn {turn}):\n"
CURRENT_AFTER_HISTORY = "\nCurrent Turn (Turn {turn}):\n"
TURN_HEADER = "\nTurn {turn}:\n"  # the start of the turn template a summary's current turn drops


class WindowPrompt(NamedTuple):
    """One row's prompt for a turn."""

    ids: list[int]  # the whole prompt, as the model reads it
    start: int  # the first turn it shows (1 unless the window slid or was cut)
    continues: bool  # it extends the row's previous sequence (prompt + answer): the cache holds that


def turn_body(block: str, turn: int) -> str:
    """A turn block (``user_message`` without its reward line) without its ``\\nTurn t:\\n``
    header: the state part a ``single_turn`` summary puts after ``(Turn t):``."""
    header = TURN_HEADER.format(turn=turn)
    return block[len(header):] if block.startswith(header) else block


class ContextWindow:
    """Builds each live row's prompt of a turn from its episode's recorded pieces (see the
    module docstring). ``window_turns`` 0 means every turn."""

    def __init__(self, chat: ChatFormat, *, mode: str = "full", window_turns: int = 0,
                 overlong: str = "end", max_model_len: int, response_length: int):
        if mode not in MODES:
            raise ValueError(f"rollout.window.mode must be one of {MODES}, got {mode!r}")
        if overlong not in OVERLONG:
            raise ValueError(f"rollout.window.overlong must be one of {OVERLONG}, got {overlong!r}")
        self.chat, self.mode, self.k, self.overlong = chat, mode, int(window_turns), overlong
        self.budget = int(max_model_len) - int(response_length)  # longest prompt that fits
        self._stops = set(int(i) for i in chat.stop_ids)

    def first_start(self, ep: Episode, turn: int) -> int:
        """The first turn the window shows before any cut (never before an earlier cut)."""
        start = 1 if self.mode == "full" or self.k <= 0 else max(1, turn - self.k + 1)
        return max(start, ep.window_start)

    def prompts(self, eps: Sequence[Episode], chunks: dict[int, list[int]],
                turn: int) -> dict[int, WindowPrompt]:
        """The prompt of every row in ``chunks`` (row -> its transcript chunk for ``turn``:
        ``ChatFormat.first_chunk`` / ``next_chunk`` ids); a row missing from the result does
        not fit ``max_model_len`` (its episode ends)."""
        starts = {i: self.first_start(eps[i], turn) for i in chunks}
        if self.mode == "single_turn":
            pieces = self._summaries(eps, starts, turn)
        else:
            self._heads(eps, {i: s for i, s in starts.items() if s > 1})
            pieces = {i: self._multi_turn(eps[i], turn, chunks[i], s) for i, s in starts.items()}
        out = {}
        for i, ids in pieces.items():
            start = starts[i]
            while len(ids) > self.budget and self.overlong == "truncate" and start < turn:
                start += 1  # drop the oldest turn shown
                if self.mode == "single_turn":
                    ids = self._summaries(eps, {i: start}, turn)[i]
                else:
                    self._heads(eps, {i: start})
                    ids = self._multi_turn(eps[i], turn, chunks[i], start)
            if len(ids) <= self.budget:
                out[i] = WindowPrompt(ids, start, self.mode != "single_turn"
                                      and start == eps[i].window_start)
        return out

    # -- full / limited ------------------------------------------------------------------------

    def _heads(self, eps: Sequence[Episode], starts: dict[int, int]) -> None:
        """Tokenises (once, batched) ``first_chunk(system, block of turn s)`` for the rows whose
        window starts at a turn ``s > 1`` without a cached head."""
        need = [(i, s) for i, s in starts.items() if s not in eps[i].heads]
        texts = [self.chat.first_chunk(eps[i].system, eps[i].blocks[s - 1]) for i, s in need]
        for (i, s), ids in zip(need, self.chat.encode(texts), strict=True):
            eps[i].heads[s] = ids

    def _multi_turn(self, ep: Episode, turn: int, chunk: list[int], start: int) -> list[int]:
        """``[head of turn start][answer][chunk][answer] ... [chunk of turn]``, the head being
        ``first_chunk(system, block)`` of turn ``start`` (from turn 1: the transcript so far
        plus the chunk)."""
        if start == turn:
            return list(chunk) if turn == 1 else list(ep.heads[turn])
        parts = [ep.chunk_ids(1) if start == 1 else ep.heads[start]]
        for j in range(start, turn):
            parts.append(ep.answer_ids(j))
            parts.append(ep.chunk_ids(j + 1) if j + 1 < turn else chunk)
        return np.concatenate([np.asarray(p, np.int64) for p in parts]).tolist()

    # -- single_turn ---------------------------------------------------------------------------

    def _summaries(self, eps: Sequence[Episode], starts: dict[int, int],
                   turn: int) -> dict[int, list[int]]:
        """The ``single_turn`` prompts: text segments (tokenised in one batched call) with the
        shown turns' sampled answers spliced between them."""
        chat, tag = self.chat, self.chat.cfg.answer_prefix
        segments = {}
        for i, start in starts.items():
            ep = eps[i]
            head = chat.prefix + ep.system + chat.system_to_user
            body = turn_body(ep.blocks[turn - 1], turn) + chat.user_to_assistant + tag
            if start >= turn:
                segments[i] = [head + CURRENT.format(turn=turn) + body]
                continue
            texts = [head + SUMMARY.format(steps=turn - 1, shown=turn - start)]
            for j in range(start, turn):
                texts[-1] += MEMORY_STATE.format(turn=j, state=ep.turns[j - 1]["state"]) + tag
                texts.append(MEMORY_REWARD.format(turn=j, reward=format_reward(
                    ep.turns[j - 1]["reward"])))
            texts[-1] += CURRENT_AFTER_HISTORY.format(turn=turn) + body
            segments[i] = texts
        flat = [t for texts in segments.values() for t in texts]
        encoded = iter(self.chat.encode(flat))
        out = {}
        for i, texts in segments.items():
            ids = list(next(encoded))
            for j in range(starts[i], starts[i] + len(texts) - 1):
                ids += self._answer_text_ids(eps[i], j) + list(next(encoded))
            out[i] = ids
        return out

    def _answer_text_ids(self, ep: Episode, turn: int) -> list[int]:
        """A turn's sampled ids as a summary shows them: without the final stop token."""
        ids = [int(t) for t in ep.answer_ids(turn)]
        return ids[:-1] if ids and ids[-1] in self._stops else ids


def prompt_lengths(eps: Sequence[Episode]) -> np.ndarray:
    """Per episode, the summed length of the prompts its turns were given."""
    return np.array([sum(len(p) for p in ep.turn_prompts) for ep in eps], np.int64)
