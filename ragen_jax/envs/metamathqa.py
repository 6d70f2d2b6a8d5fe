"""MetaMathQA (RAGEN's ``metamathqa`` env, tag ``MetamathQA``) as a host environment.

An episode is one math question; each turn the model answers, and the answer is compared with
the label by RAGEN's normalisation (lower case, every whitespace character removed, then string
equality: no arithmetic, no symbolic equivalence, so ``0.5`` and ``1/2`` differ). A correct
answer ends the episode with reward ``1 / 2**k`` where ``k`` is the number of wrong answers
before it (RAGEN's retries: 1, 0.5, 0.25, ...); a wrong one earns 0, keeps the episode going
and reads "Incorrect. Please think again."; the rollout's ``max_turn`` bounds the attempts.

Data: a JSONL or parquet file the user has (``data_path``; nothing is downloaded) in
MetaMathQA's fields: ``query`` (the question, shown as is) and ``response`` (the worked
solution, whose label is what follows the first ``The answer is: `` to the end, stripped:
RAGEN's ``_extract_answer``); other fields are ignored. A row whose response has no such line
has no label, and no answer is ever correct on it (as in RAGEN).

The row of seed ``s`` is RAGEN's: Python's ``random`` seeded with ``s`` draws
``randint(0, len - 1)`` (RAGEN's ``all_seed`` then ``random.randint``), so a file in the same
row order gives the same question per seed as RAGEN's env on that split.

Level identity (held-out validation): the question text, so two rows asking the same question
are one level.

Differences from RAGEN (deliberate): the data comes from a local file, not ``load_dataset``
(one file is one split); an empty answer is the rollout's format error (penalty -0.1) rather
than an invalid action that still costs an attempt.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np

from ragen_jax.envs.datafile import read_rows, require, row_for_seed
from ragen_jax.envs.host.env import HostEnv

INSTRUCTION = "You are solving Math problems. "  # RAGEN's env_instruction of the MetamathQA tag

_LABEL = re.compile(r"The answer is: (.*?)$", re.DOTALL)  # RAGEN's _extract_answer
_SPACE = re.compile(r"\s+")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One question and its label (None when the response states no answer)."""

    query: str
    label: str | None


def extract_answer(response: str) -> str | None:
    """The label of a worked solution: the text after the first ``The answer is: ``, stripped
    (RAGEN's ``_extract_answer``); None without that phrase."""
    match = _LABEL.search(response)
    return match.group(1).strip() if match else None


def normalise(text: str) -> str:
    """RAGEN's comparison form: lower case, all whitespace removed."""
    return _SPACE.sub("", text.strip().lower())


def check_answer(answer: str, label: str | None) -> tuple[bool, bool]:
    """``(is_correct, is_valid)`` of one answer (RAGEN's ``_check_answer``): correct when its
    normal form equals the label's (never for a missing or empty label), valid when its normal
    form is not empty."""
    given = normalise(answer)
    return bool(label) and given == normalise(label), given != ""


def load_problems(path: str | os.PathLike) -> tuple[Problem, ...]:
    """The problems of a JSONL or parquet file with ``query`` and ``response`` fields."""
    problems = []
    for n, row in enumerate(read_rows(path), 1):
        row = require(row, ("query", "response"), f"{os.fspath(path)} row {n}")
        if not isinstance(row["query"], str) or not isinstance(row["response"], str):
            raise ValueError(f"{os.fspath(path)} row {n}: 'query' and 'response' must be strings")
        problems.append(Problem(row["query"], extract_answer(row["response"])))
    return tuple(problems)


class MetaMathQA(HostEnv):
    """One question per episode, answered until correct (see the module docstring)."""

    instruction = INSTRUCTION
    parallel_friendly = True  # pure Python on immutable data: instances share nothing

    def __init__(self, data_path: str = ""):
        if not data_path:
            raise ValueError("metamathqa needs data_path: a JSONL or parquet file with 'query' and "
                             "'response' fields (MetaMathQA's), e.g. "
                             "--config.env.params.data_path=MetaMathQA-395K.jsonl")
        self.problems = load_problems(data_path)
        self.problem: Problem | None = None
        self.attempts = 0

    def problem_for(self, seed: int) -> Problem:
        """The problem an episode of ``seed`` plays."""
        return self.problems[row_for_seed(seed, len(self.problems))]

    def reset(self, seed: int) -> str:
        self.problem = self.problem_for(seed)
        self.attempts = 0
        return self.problem.query

    def level_key(self) -> str | None:
        return None if self.problem is None else self.problem.query

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("step before reset")
        correct, valid = check_answer(action, self.problem.label)
        reward = 1.0 / 2 ** self.attempts if correct else 0.0
        self.attempts += 1
        text = "Correct!" if correct else "Incorrect. Please think again."
        return text, reward, correct, {"success": correct, "action_is_valid": valid,
                                       "action_is_effective": valid}

    def random_action(self, rng: np.random.Generator) -> str:
        """A small integer (the answer format, not the answer)."""
        return str(int(rng.integers(0, 100)))
