"""Search QA as a host env: BM25 retrieval against a plain-Python BM25, the HTTP retriever
against a loopback server, SQuAD-style EM/F1 against a plain-Python reference, rewards on
exact, partial and wrong answers, the penalty of malformed actions, the step budget, data
errors and level identity."""

from __future__ import annotations

import collections
import json
import math
import re
import string
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import make
from ragen_jax.envs.search import (
    BM25Retriever,
    HTTPRetriever,
    Search,
    exact_match,
    f1,
    load_questions,
    parse_action,
    score_answer,
)

DATA = Path(__file__).resolve().parents[1] / "data"
QUESTIONS, CORPUS = DATA / "search_questions.jsonl", DATA / "search_corpus.jsonl"

pytest.importorskip("bm25s")


def squad_normalise(s: str) -> str:
    """The SQuAD v1.1 evaluation script's normalize_answer, step by step."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def squad_f1(prediction: str, gold: str) -> float:
    p, g = squad_normalise(prediction).split(), squad_normalise(gold).split()
    same = sum((collections.Counter(p) & collections.Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


_WORDS = st.lists(st.sampled_from(["the", "A", "an", "Paris", "paris,", "France", "of", "x!", "  ", "Snowy"]),
                  max_size=6).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(_WORDS, st.lists(_WORDS, min_size=1, max_size=3))
def test_em_and_f1_match_the_squad_reference(prediction, golds):
    assert exact_match(prediction, golds) == any(squad_normalise(prediction) == squad_normalise(g) for g in golds)
    assert f1(prediction, golds) == pytest.approx(max(squad_f1(prediction, g) for g in golds))


def bm25_reference(passages: list[str], query: str, k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """Lucene's BM25 (bm25s' default) by its formula: idf = ln(1 + (N - df + .5) / (df + .5)),
    term weight tf / (tf + k1 (1 - b + b dl / avgdl)) (Lucene drops the (k1 + 1) factor),
    tokens = lower-case words of 2+ word characters minus English stopwords."""
    from bm25s.stopwords import STOPWORDS_EN

    def tokens(text: str) -> list[str]:
        return [w for w in re.findall(r"(?u)\b\w\w+\b", text.lower()) if w not in set(STOPWORDS_EN)]

    docs = [tokens(p) for p in passages]
    avg = sum(map(len, docs)) / len(docs)
    scores = np.zeros(len(docs))
    for term in set(tokens(query)):
        df = sum(term in d for d in docs)
        if df == 0:
            continue
        idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
        for i, d in enumerate(docs):
            tf = d.count(term)
            scores[i] += idf * tf / (tf + k1 * (1 - b + b * len(d) / avg))
    return scores


def test_bm25_scores_and_ranking_match_the_formula():
    passages = [json.loads(line)["contents"] for line in CORPUS.read_text().splitlines()]
    retriever = BM25Retriever(passages)
    for query in ["Vostok subglacial lake", "highest mountain Australia", "who wrote the algorithm",
                  "copper tin bronze alloy", "nothing matches xyzzy"]:
        ref = bm25_reference(passages, query)
        np.testing.assert_allclose(retriever.scores(query), ref, rtol=1e-5, atol=1e-6)
        expected = [passages[i] for i in np.argsort(-ref, kind="stable")[:3] if ref[i] > 0]
        assert retriever.search(query, 3) == expected
    assert retriever.search("nothing matches xyzzy", 3) == []


def test_search_and_finish_rewards_and_the_format_penalty():
    env = Search(str(QUESTIONS), corpus_path=str(CORPUS), topk=2, max_steps=10)
    text = env.reset(1)  # row 1: Ada Lovelace's machine
    assert "Who designed the machine" in text and env.level_key() == env.questions[1].question
    obs, reward, done, info = env.step("search[Ada Lovelace algorithm engine]")
    assert (reward, done, info["action_is_valid"]) == (0.0, False, True)
    assert obs.startswith("Results for [Ada Lovelace algorithm engine]:\nDoc 1 \"Ada Lovelace\"")
    assert obs.count("\nDoc ") == 2 and "Analytical Engine" in obs
    for bad in ["search[]", "look[Babbage]", "Charles Babbage", "finish Charles Babbage", "search[x"]:
        obs, reward, done, info = env.step(bad)
        assert (reward, done, info["action_is_valid"]) == (-0.1, False, False), bad
        assert obs == "Invalid action. Use search[<query>] or finish[<answer>]."
    obs, reward, done, info = env.step("FINISH[ charles babbage. ]")  # case, spaces, punctuation
    assert (obs, reward, done, info["success"]) == ("Your answer gets 1 points.", 1.0, True, True)

    env.reset(2)  # gold: "the Snowy Mountains"
    _, reward, done, info = env.step("finish[Snowy Mountains of New South Wales]")
    assert reward == pytest.approx(f1("Snowy Mountains of New South Wales", ["the Snowy Mountains"]))
    assert 0.3 <= reward < 1 and done and info["success"]  # partial credit above the threshold
    env.reset(0)  # gold: "Vostok Station", "Vostok"
    wrong = "the Russian research station near the big lake in Antarctica"
    _, reward, done, info = env.step(f"finish[{wrong}]")
    assert 0 < f1(wrong, ["Vostok Station", "Vostok"]) < 0.3  # one shared word: below the threshold
    assert (reward, done, info["success"]) == (0.0, True, False)
    assert score_answer("fifty", ["50", "fifty"]) == (1.0, True)


def test_the_step_budget_ends_an_unanswered_episode():
    env = Search(str(QUESTIONS), corpus_path=str(CORPUS), max_steps=3)
    env.reset(0)
    assert not env.step("search[Vostok]")[2] and not env.step("bogus")[2]
    obs, reward, done, info = env.step("search[Vostok Station founded]")
    assert done and info["truncated"] and not info["success"] and reward == 0.0


def test_parse_action():
    assert parse_action("search[capital of France]") == ("search", "capital of France")
    assert parse_action("  Finish[ Paris ] ") == ("finish", "Paris")
    assert parse_action("finish[a [b] c]") == ("finish", "a [b] c")
    for bad in ["search[ ]", "search(x)", "x search[y]", "finish[y] z", "", "search"]:
        assert parse_action(bad) is None, bad


class _Handler(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - the http.server hook's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.requests.append(body)
        docs = [{"document": {"id": str(i), "contents": f"passage {i} about {body['queries'][0]}"}}
                for i in range(body["topk"])]
        payload = json.dumps({"result": [docs]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_http_retriever_speaks_the_retrieval_server_protocol():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
        assert HTTPRetriever(url, timeout=5).search("bronze", 2) == [
            "passage 0 about bronze", "passage 1 about bronze"]
        assert _Handler.requests[-1] == {"queries": ["bronze"], "topk": 2, "return_scores": False}
        family, _ = make("search", data_path=str(QUESTIONS), server_url=url, topk=1)
        assert family.parallel_friendly  # a server call waits on the network
        env = family.factory()
        env.reset(3)
        assert env.step("search[copper alloy]")[0] == "Results for [copper alloy]:\nDoc 1 passage 0 about copper alloy"
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="http"):
        HTTPRetriever("file:///etc/passwd")


def test_data_errors_and_retriever_choice(tmp_path):
    assert [q.golds for q in load_questions(QUESTIONS)][3] == ("50", "fifty")
    single = tmp_path / "q.jsonl"
    single.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n")
    assert load_questions(single)[0].golds == ("a",)
    single.write_text(json.dumps({"question": "q?", "golden_answers": []}) + "\n")
    with pytest.raises(ValueError, match="row 1: need a 'question' string"):
        load_questions(single)
    with pytest.raises(ValueError, match="exactly one retriever"):
        Search(str(QUESTIONS))
    with pytest.raises(ValueError, match="exactly one retriever"):
        Search(str(QUESTIONS), corpus_path=str(CORPUS), server_url="http://127.0.0.1:1")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"title": "T", "body": "no text field"}) + "\n")
    with pytest.raises(ValueError, match="row 1: no 'text'"):
        Search(str(QUESTIONS), corpus_path=str(corpus))


def test_level_identity_is_the_question():
    family, _ = make("search", data_path=str(QUESTIONS), corpus_path=str(CORPUS))
    env = family.factory()
    keys = set()
    for seed in range(12):
        env.reset(seed)
        keys.add(env.level_key())
    assert keys == {q.question for q in env.questions}  # seed mod len: every row, by its question
