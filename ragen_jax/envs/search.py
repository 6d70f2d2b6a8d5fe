"""Search QA (RAGEN's ``search`` env, tags SearchQA / HotpotQA) as a host environment.

An episode is one question. Each action is ``search[query]`` (the retriever's top ``topk``
passages for the query come back as the next observation; reward 0) or ``finish[answer]``
(ends the episode, scored against the gold answers). Any other action is malformed: it earns
``invalid_penalty`` (-0.1, the size of RAGEN's format penalty), changes nothing, and the
episode goes on. After ``max_steps`` actions without ``finish`` the episode ends unanswered.

Reward of ``finish[answer]`` (SQuAD's answer normalisation: lower case, punctuation and the
articles a/an/the removed, whitespace collapsed; the best over the gold answers): 1 for an
exact match; otherwise the token F1 when it reaches ``f1_threshold`` (0.3), else 0.
``info["success"]``: exact match or F1 >= ``f1_threshold``.

Data, all local (nothing is downloaded):

* questions: a JSONL or parquet file (``data_path``) of ``{"question": str, "golden_answers":
  [str, ...]}`` rows (Search-R1 / FlashRAG's QA format; ``answer`` as a string or a list is
  accepted for ``golden_answers``), row ``seed mod len`` per episode;
* retriever: BM25 (the ``bm25s`` library, ``pip install 'ragen_jax[search]'``) over a corpus
  JSONL/parquet file (``corpus_path``) of ``{"contents": str}`` rows (FlashRAG's
  ``"Title"\\ntext`` form) or ``{"title": str, "text": str}`` rows, indexed once per version
  of the file; or any HTTP search server (``server_url``) speaking the Search-R1 retrieval
  server's protocol: ``POST {"queries": [q], "topk": k, "return_scores": false}`` answered by
  ``{"result": [[{"contents": ...} or {"document": {"contents": ...}}, ...]]}``.

Level identity (held-out validation): the question text.

Differences from RAGEN (deliberate): RAGEN's search env talks only to a retrieval server
(dense retrieval in its setup); here a local BM25 index needs no server; passages are cut to
``passage_chars`` characters so that a turn's observation stays within the prompt budget.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import string
import urllib.request
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ragen_jax.envs.datafile import read_rows, require
from ragen_jax.envs.host.env import HostEnv

INSTRUCTION = (
    "You are answering a question with the help of a search engine. Each action is either "
    "search[<query>], which returns the top passages for the query, or finish[<answer>], which "
    "submits a short final answer and ends the episode.\n"
    "Example: <answer>search[capital of France]</answer> then <answer>finish[Paris]</answer>"
)

_ACTION = re.compile(r"\s*(search|finish)\[(.*)\]\s*", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


# -- answers -----------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD's normal form: lower case, punctuation and articles removed, whitespace collapsed."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether the prediction's normal form equals one gold answer's."""
    given = normalize_answer(prediction)
    return any(given == normalize_answer(g) for g in golds)


def f1(prediction: str, golds: Sequence[str]) -> float:
    """The best token F1 of the prediction's normal form against the gold answers'."""
    tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((collections.Counter(tokens) & collections.Counter(ref)).values())
        if common:
            precision, recall = common / len(tokens), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def score_answer(prediction: str, golds: Sequence[str], f1_threshold: float = 0.3) -> tuple[float, bool]:
    """``(reward, success)`` of a final answer (see the module docstring)."""
    if exact_match(prediction, golds):
        return 1.0, True
    value = f1(prediction, golds)
    return (value, True) if value >= f1_threshold else (0.0, False)


def parse_action(action: str) -> tuple[str, str] | None:
    """``("search" | "finish", argument)`` of a well-formed action (argument stripped and not
    empty), else None."""
    match = _ACTION.fullmatch(action)
    if match is None or not match.group(2).strip():
        return None
    return match.group(1).lower(), match.group(2).strip()


# -- data --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Question:
    """One question and its gold answers."""

    question: str
    golds: tuple[str, ...]


def load_questions(path: str | os.PathLike) -> tuple[Question, ...]:
    """The questions of a JSONL or parquet file (see the module docstring)."""
    out = []
    for n, row in enumerate(read_rows(path), 1):
        where = f"{os.fspath(path)} row {n}"
        row = require(row, ("question",), where)
        golds = row.get("golden_answers", row.get("answer"))
        golds = [golds] if isinstance(golds, str) else golds
        if not isinstance(row["question"], str) or not golds or not all(isinstance(g, str) for g in golds):
            raise ValueError(f"{where}: need a 'question' string and 'golden_answers' (or 'answer'): "
                             f"a string or a non-empty list of strings")
        out.append(Question(row["question"], tuple(golds)))
    return tuple(out)


def passage_text(row: Any, where: str) -> str:
    """A corpus row as one passage: ``contents``, or ``(Title: t) text``."""
    if isinstance(row, dict) and isinstance(row.get("contents"), str):
        return row["contents"]
    row = require(row, ("text",), where)
    title = row.get("title")
    return f"(Title: {title}) {row['text']}" if title else str(row["text"])


# -- retrievers --------------------------------------------------------------------------------


class Retriever(Protocol):
    """Anything that returns the top passages of a query."""

    def search(self, query: str, k: int) -> list[str]: ...


class BM25Retriever:
    """BM25 (``bm25s``: Lucene's scoring, k1 1.5, b 0.75) over a list of passages; English
    stopwords removed, no stemming. Passages that share no term with the query are not returned."""

    def __init__(self, passages: Sequence[str]):
        try:
            import bm25s
        except ImportError:
            raise ImportError("the BM25 retriever needs bm25s: pip install 'ragen_jax[search]'") from None
        self._bm25s = bm25s
        self.passages = list(passages)
        self.index = bm25s.BM25()
        self.index.index(self._tokens(self.passages), show_progress=False)

    def _tokens(self, texts: Sequence[str]) -> list[list[str]]:
        # Strings, not ids: ids from a second tokenize call would not match the index's vocabulary.
        return self._bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """``[len(passages)]`` BM25 scores of the query."""
        return np.asarray(self.index.get_scores(self._tokens([query])[0]))

    def search(self, query: str, k: int) -> list[str]:
        scores = self.scores(query)
        order = np.argsort(-scores, kind="stable")[:k]
        return [self.passages[i] for i in order if scores[i] > 0]


@functools.lru_cache(maxsize=4)
def _bm25(path: str, mtime: float) -> BM25Retriever:
    del mtime  # part of the cache key only: an edited corpus is indexed again
    return BM25Retriever([passage_text(row, f"{path} row {n}") for n, row in enumerate(read_rows(path), 1)])


def bm25_for(path: str | os.PathLike) -> BM25Retriever:
    """The BM25 index of a corpus file, built once per version of the file."""
    path = os.fspath(path)
    return _bm25(path, os.path.getmtime(path))


class HTTPRetriever:
    """A search server (the Search-R1 retrieval server's protocol; see the module docstring)."""

    def __init__(self, url: str, timeout: float = 10.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server_url must be an http(s) URL, got {url!r}")
        self.url, self.timeout = url, float(timeout)

    def search(self, query: str, k: int) -> list[str]:
        body = json.dumps({"queries": [query], "topk": int(k), "return_scores": False}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - http(s) only, checked above
            results = json.loads(response.read())["result"][0]
        out = []
        for item in results[:k]:
            doc = item.get("document", item) if isinstance(item, dict) else item
            out.append(doc["contents"] if isinstance(doc, dict) else str(doc))
        return out


# -- the env -----------------------------------------------------------------------------------


class Search(HostEnv):
    """One question per episode, searched and answered (see the module docstring)."""

    instruction = INSTRUCTION

    def __init__(self, data_path: str = "", corpus_path: str = "", server_url: str = "",
                 topk: int = 3, max_steps: int = 10, passage_chars: int = 500,
                 f1_threshold: float = 0.3, invalid_penalty: float = -0.1,
                 server_timeout: float = 10.0):
        if not data_path:
            raise ValueError("search needs data_path: a JSONL or parquet file of 'question' and "
                             "'golden_answers' rows")
        if bool(corpus_path) == bool(server_url):
            raise ValueError("search needs exactly one retriever: corpus_path (a JSONL or parquet "
                             "corpus for BM25) or server_url (an HTTP search server)")
        if topk < 1 or max_steps < 1 or passage_chars < 1:
            raise ValueError(f"search: topk, max_steps and passage_chars must be >= 1, got "
                             f"{topk}, {max_steps}, {passage_chars}")
        self.questions = load_questions(data_path)
        self.retriever: Retriever = (bm25_for(corpus_path) if corpus_path
                                     else HTTPRetriever(server_url, server_timeout))
        # A server call waits on the network: instances may step in parallel threads then.
        self.parallel_friendly = bool(server_url)
        self.topk, self.max_steps, self.passage_chars = int(topk), int(max_steps), int(passage_chars)
        self.f1_threshold, self.invalid_penalty = float(f1_threshold), float(invalid_penalty)
        self.question: Question | None = None
        self.steps = 0

    def question_for(self, seed: int) -> Question:
        """The question an episode of ``seed`` plays."""
        return self.questions[seed % len(self.questions)]

    def reset(self, seed: int) -> str:
        self.question = self.question_for(seed)
        self.steps = 0
        return f"Question: {self.question.question}\nAvailable actions: search[<query>], finish[<answer>]"

    def level_key(self) -> str | None:
        return None if self.question is None else self.question.question

    def results_text(self, query: str) -> str:
        """The observation after ``search[query]``."""
        passages = self.retriever.search(query, self.topk)
        if not passages:
            return f"No results for [{query}]."
        lines = [f"Doc {i} {p[:self.passage_chars]}" for i, p in enumerate(passages, 1)]
        return f"Results for [{query}]:\n" + "\n".join(lines)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.question is None:
            raise RuntimeError("step before reset")
        self.steps += 1
        parsed = parse_action(action)
        out_of_steps = self.steps >= self.max_steps
        info: dict[str, Any] = {"success": False, "action_is_valid": parsed is not None,
                                "action_is_effective": parsed is not None}
        if parsed is None:
            text = "Invalid action. Use search[<query>] or finish[<answer>]."
            return text, self.invalid_penalty, out_of_steps, dict(info, truncated=out_of_steps)
        verb, argument = parsed
        if verb == "finish":
            reward, success = score_answer(argument, self.question.golds, self.f1_threshold)
            return f"Your answer gets {reward:g} points.", reward, True, dict(info, success=success)
        return self.results_text(argument), 0.0, out_of_steps, dict(info, truncated=out_of_steps)

    def random_action(self, rng: np.random.Generator) -> str:
        """``search[`` a few words of the question ``]`` or ``finish[`` one of them ``]``
        (the format, not an answer)."""
        words = self.question.question.split() or ["?"]
        picked = [words[int(i)] for i in rng.integers(len(words), size=min(3, len(words)))]
        if rng.random() < 0.5:
            return f"search[{' '.join(picked)}]"
        return f"finish[{picked[0]}]"
