"""MetaMathQA as a host env against plain-Python references of RAGEN's ``metamathqa`` logic:
label extraction, answer check, the row each seed plays, retries with halving rewards; data
files and their errors; level identity."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import make
from ragen_jax.envs.datafile import row_for_seed
from ragen_jax.envs.metamathqa import MetaMathQA, check_answer, extract_answer, load_problems

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "metamathqa_sample.jsonl"


def ragen_extract(response: str) -> str | None:
    """RAGEN's _extract_answer, by string search rather than its regex: everything after the
    first "The answer is: ", stripped."""
    at = response.find("The answer is: ")
    return None if at < 0 else response[at + len("The answer is: "):].strip()


def ragen_check(answer: str, label: str | None) -> tuple[bool, bool]:
    """RAGEN's _check_answer."""
    given = "".join(answer.strip().lower().split())
    correct = bool(label) and given == "".join(label.lower().split())
    return correct, given != ""


def ragen_row(seed: int, rows: int) -> int:
    """RAGEN's reset: all_seed(seed) seeds Python's global random, then random.randint."""
    state = random.getstate()
    try:
        random.seed(seed)
        return random.randint(0, rows - 1)
    finally:
        random.setstate(state)


_TEXT = st.lists(st.sampled_from(list("ab 1\n\t:$\\{}") + ["The answer is: ", "The answer is:", "A"]),
                max_size=20).map("".join)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
def test_label_extraction_matches_ragen(response):
    assert extract_answer(response) == ragen_extract(response)


@settings(max_examples=300, deadline=None)
@given(_TEXT, st.one_of(st.none(), _TEXT))
def test_answer_check_matches_ragen(answer, label):
    assert check_answer(answer, label) == ragen_check(answer, label)


def test_examples_of_the_comparison():
    assert check_answer(" 19 ", "19") == (True, True)
    assert check_answer("\\frac{3}{4}", "\\frac{3} {4}") == (True, True)
    assert check_answer("(2,\\INFTY)", "(2, \\infty)") == (True, True)
    assert check_answer("0.5", "1/2") == (False, True)  # no arithmetic: strings only
    assert check_answer("", "19") == (False, False)
    assert check_answer("19", None) == (False, True)
    assert extract_answer("So 3 + 4 = 7.\nThe answer is: 7\n") == "7"
    assert extract_answer("The answer is: 7. The answer is: 8") == "7. The answer is: 8"  # the first
    assert extract_answer("The answer is 7") is None


@pytest.mark.parametrize("rows", [1, 2, 26, 395_000])
def test_each_seed_plays_ragens_row(rows):
    for seed in [0, 1, 2, 7, 123, 10_000, 2**31 - 1]:
        assert row_for_seed(seed, rows) == ragen_row(seed, rows)


def test_retries_halve_the_reward_until_correct():
    env = MetaMathQA(str(SAMPLE))
    question = env.reset(5)
    problem = env.problems[ragen_row(5, len(env.problems))]
    assert question == problem.query and env.level_key() == problem.query
    text, reward, done, info = env.step("-1")
    assert (text, reward, done, info["success"]) == ("Incorrect. Please think again.", 0.0, False, False)
    assert info["action_is_valid"]
    _, reward, done, _ = env.step("0")
    assert (reward, done) == (0.0, False)
    text, reward, done, info = env.step(f"  {problem.label} ")
    assert (text, reward, done, info["success"]) == ("Correct!", 0.25, True, True)
    env.reset(5)  # a new episode starts with the full reward again
    assert env.step(problem.label)[1] == 1.0


def test_data_files_and_their_errors(tmp_path):
    problems = load_problems(SAMPLE)
    assert len(problems) == 26 and problems[0].label == "19"
    assert problems[-2].label == "\\frac{3}{4}"

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    path = tmp_path / "mm.parquet"
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("query", "response", "type")}), path)
    assert load_problems(path) == problems

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "response": "The answer is: 1"}) + "\n"
                   + json.dumps({"query": "q2"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{bad} row 2: no 'response'")):
        load_problems(bad)
    bad.write_text(json.dumps({"query": 3, "response": "x"}) + "\n")
    with pytest.raises(ValueError, match="must be strings"):
        load_problems(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1: not JSON"):
        load_problems(bad)
    with pytest.raises(ValueError, match="needs data_path"):
        MetaMathQA()


def test_registered_host_env_and_level_identity():
    family, params = make("metamathqa", data_path=str(SAMPLE))
    assert params is None and family.parallel_friendly
    env = family.factory()
    env.reset(3)
    key = env.level_key()
    other = next(s for s in range(100) if env.problem_for(s).query != key)
    env.reset(other)
    assert env.level_key() != key
    env.reset(3)
    assert env.level_key() == key  # the question identifies the level
