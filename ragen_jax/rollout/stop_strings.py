"""Stop strings (``rollout.sampling.stop_strings``): a turn ends right after the model has generated one
of them, as vLLM's ``stop`` ends a generation, exact at the character level even where a string
spans several tokens or begins inside one.

Why a per-token automaton: the decode loop is one jitted ``lax.while_loop`` with no host round
trip, so the check has to be an array lookup. The strings are compiled on the host, once per
tokenizer and set of strings, into a transition table ``[states, vocab]``:

1. An Aho-Corasick automaton over bytes (``byte_automaton``: a trie of the strings' UTF-8
   bytes, completed with failure links into a DFA ``[nodes, 256]``) tracks the longest suffix
   of the text so far that is a prefix of some stop string.
2. Every vocabulary token's bytes (``token_bytes``) are run through that DFA from every
   non-accepting node at once (numpy, vectorised over the vocabulary, one step per byte
   position): ``table[s, v]`` is the node after reading token ``v`` from node ``s``, or the
   absorbing state ``matched`` if a stop string was completed anywhere inside the token.

The sampler carries one state per row (0 at the start of each turn: text of the prompt never
stops a turn) and steps it with ``table[state, token]`` after each sampled token; a row that
reaches ``matched`` is done, its last token (the one completing the string) included.

Exactness: bytes are matched, not characters. For a byte-level BPE tokenizer (Qwen2/2.5,
Qwen3, Llama 3, SmolLM2: every token is a byte string) and a stop string of valid UTF-8, a byte
match is a character match in the decoded text: UTF-8 is self-synchronising, so the string's
bytes cannot straddle a character boundary, and a decoder that replaces invalid bytes never
swallows the bytes of a valid character after them. Added (special) tokens count as their text
(``decode(skip_special_tokens=False)``, what the parser reads). Tokenizers without a byte-level
decoder (SentencePiece with ``▁`` for spaces) are read token by token with ``decode``, which is
exact for their single-token pieces but may differ from the joined text around leading spaces.
Token ids past the tokenizer's vocabulary (a model's padded embedding rows) read as no text.

What the trajectory records when a turn stops on a string: see ``ChatFormat`` (the sampled
tokens up to the completing one, loss mask 1; the chat template's end-of-turn token inserted
as template text before the next user message, loss mask 0).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode


def byte_automaton(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The Aho-Corasick DFA of ``patterns`` (non-empty byte strings): ``(delta [N, 256]
    int32, accept [N] bool)``. Node 0 is the root; ``delta[n, b]`` is the node for the longest
    suffix of (text of ``n``) + ``b`` that is a prefix of a pattern; ``accept[n]``: some
    pattern ends at the end of node ``n``'s text (itself or through its failure links)."""
    if not patterns or any(not p for p in patterns):
        raise ValueError("stop strings must be non-empty")
    goto: list[dict[int, int]] = [{}]
    accept = [False]
    for p in patterns:
        node = 0
        for b in p:
            if b not in goto[node]:
                goto.append({})
                accept.append(False)
                goto[node][b] = len(goto) - 1
            node = goto[node][b]
        accept[node] = True
    delta = np.zeros((len(goto), 256), np.int32)
    fail = [0] * len(goto)  # depth-1 nodes fail to the root
    # Breadth-first, so a node's failure target (shorter text) is complete before the node.
    queue = list(goto[0].values())
    delta[0, list(goto[0])] = list(goto[0].values())
    for node in queue:  # the list grows while it is walked: a BFS queue
        accept[node] = accept[node] or accept[fail[node]]
        delta[node] = delta[fail[node]]
        for b, child in goto[node].items():
            delta[node, b] = child
            # The child's failure: where the parent's failure goes on the same byte.
            fail[child] = int(delta[fail[node], b])
            queue.append(child)
    return delta, np.asarray(accept, bool)


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder is byte-level (its vocabulary strings stand for bytes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in parts)


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each id's text as bytes, for ids ``0 .. vocab_size - 1``: added tokens as their UTF-8
    content, byte-level vocabulary strings mapped back to their bytes, other tokenizers'
    tokens decoded one by one; ids the tokenizer does not have read as ``b""``."""
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    n = min(vocab_size, len(tokenizer))
    ids = list(range(n))
    if _byte_level(tokenizer):
        # str.translate maps every character to the byte it stands for in one C loop.
        # (transformers' GPT-2 byte alphabet, byte -> the character standing for it, inverted)
        table = {ord(c): b for b, c in bytes_to_unicode().items()}

        def one(i: int, piece: str | None) -> bytes:
            if i in added:
                return added[i].encode()
            try:
                return (piece or "").translate(table).encode("latin-1")
            except UnicodeEncodeError:  # not a byte-level string after all: its decoded text
                return tokenizer.decode([i], skip_special_tokens=False).encode()

        out = [one(i, p) for i, p in enumerate(tokenizer.convert_ids_to_tokens(ids))]
    else:
        out = [added[i].encode() if i in added else
               tokenizer.decode([i], skip_special_tokens=False).encode() for i in ids]
    return out + [b""] * (vocab_size - n)


def token_table(delta: np.ndarray, accept: np.ndarray, tokens: Sequence[bytes]) -> np.ndarray:
    """The per-token automaton: ``[S + 1, V] int32`` over the ``S`` non-accepting nodes of
    the byte DFA (renumbered in order, the root stays 0) and the absorbing state ``S``
    (matched): entry ``[s, v]`` is the state after reading ``tokens[v]`` from state ``s``.
    Vectorised over the vocabulary: tokens sorted by length, so byte position ``j`` is read
    by a prefix of them (the tokens longer than ``j``), every start state at once."""
    live_nodes = np.flatnonzero(~accept)
    s, v = live_nodes.size, len(tokens)
    lengths = np.fromiter(map(len, tokens), np.int64, v)
    order = np.argsort(-lengths, kind="stable")
    longest = int(lengths.max(initial=0))
    padded = np.zeros((v, max(longest, 1)), np.uint8)
    row_lengths = lengths[order]
    filled = np.arange(padded.shape[1])[None, :] < row_lengths[:, None]
    padded[filled] = np.frombuffer(b"".join(tokens[i] for i in order), np.uint8)
    node = np.repeat(live_nodes[:, None], v, axis=1).astype(np.int32)  # [S, V], sorted order
    hit = np.zeros((s, v), bool)
    for j in range(longest):
        n = int(np.searchsorted(-row_lengths, -j, side="left"))  # tokens longer than j
        step = delta[node[:, :n], padded[None, :n, j]]
        hit[:, :n] |= accept[step]
        node[:, :n] = step
    renumber = np.full(delta.shape[0], -1, np.int32)
    renumber[live_nodes] = np.arange(s, dtype=np.int32)
    table = np.empty((s + 1, v), np.int32)
    table[:s, order] = np.where(hit, s, renumber[node])
    table[s] = s
    return table


@dataclasses.dataclass(frozen=True, eq=False)
class StopAutomaton:
    """Compiled stop strings (see the module docstring). ``table [S + 1, V]``: state after a
    token; ``matched`` (= S) is the absorbing state a completed string leads to; state 0 is
    the start of a turn."""

    strings: tuple[str, ...]
    table: np.ndarray
    _device: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def matched(self) -> int:
        return self.table.shape[0] - 1

    def first_stop(self, ids: Sequence[int]) -> int | None:
        """Host-side: the index of the token of ``ids`` that completes a stop string (the
        turn ends with it), or None. ``ScriptedPolicy`` and tests use it."""
        state, width = 0, self.table.shape[1]
        for j, t in enumerate(ids):
            if 0 <= int(t) < width:
                state = int(self.table[state, int(t)])
            if state == self.matched:
                return j
        return None

    def device_table(self, vocab_size: int) -> jax.Array:
        """The table as a device array ``[S + 1, vocab_size]`` for a model of that vocabulary
        (extra ids read as no text; ids it does not have are cut off), kept per size so a
        rollout uploads it once."""
        if vocab_size not in self._device:
            t = self.table[:, :vocab_size]
            if t.shape[1] < vocab_size:  # a column that keeps every state where it is
                keep = np.repeat(np.arange(t.shape[0], dtype=np.int32)[:, None],
                                 vocab_size - t.shape[1], axis=1)
                t = np.concatenate([t, keep], axis=1)
            self._device[vocab_size] = jnp.asarray(t)
        return self._device[vocab_size]


# Per tokenizer (weakly held): its token bytes and its compiled automata by strings.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stop_automaton(tokenizer: Any, strings: Sequence[str], vocab_size: int | None = None
                   ) -> StopAutomaton:
    """``strings`` compiled for ``tokenizer`` (cached per tokenizer and strings). The table
    covers ``vocab_size`` ids (default: the tokenizer's ``len``); ``StopAutomaton.
    device_table`` adapts it to a model's vocabulary."""
    strings = tuple(strings)
    if not strings or any(not isinstance(s, str) or not s for s in strings):
        raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
    vocab_size = len(tokenizer) if vocab_size is None else int(vocab_size)
    cache = _CACHE.setdefault(tokenizer, {})
    key = (strings, vocab_size)
    if key not in cache:
        if ("bytes", vocab_size) not in cache:
            cache[("bytes", vocab_size)] = token_bytes(tokenizer, vocab_size)
        delta, accept = byte_automaton([s.encode() for s in strings])
        cache[key] = StopAutomaton(strings, token_table(delta, accept, cache[("bytes", vocab_size)]))
    return cache[key]
