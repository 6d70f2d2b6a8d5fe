"""DeepCoder (RAGEN's ``deepcoder`` env, tag ``DeepCoder``) as a host environment: write a
Python program; it runs, confined, against the problem's tests; the reward is the fraction
of tests passed, success is passing all of them.

Data: a JSONL or parquet file the user has (``data_path``; nothing is downloaded), one
problem a row, in either of the shapes RAGEN reads:

- DeepCoder-Preview's own (``agentica-org/DeepCoder-Preview-Dataset``): ``problem``,
  ``tests`` (a JSON list of ``{"input", "output", "testtype"}`` or ``{"inputs": [...],
  "outputs": [...]}``: standard-input tests), ``starter_code``, ``metadata`` (``func_name``
  for function tests);
- RAGEN's prepared rows: ``question``, ``ground_truth`` (the JSON test list), ``starter_code``,
  ``metadata``.

A ``testtype: "functional"`` test calls ``func_name`` (a method of ``Solution`` when the
program defines that class) with the test's arguments (a list, or one literal per line of its
``input`` text: RAGEN ``eval``s them, here they are parsed as JSON or Python literals, never
run); any other test runs the program as ``__main__`` with ``input`` on its standard input.

The row of seed ``s`` is RAGEN's (``random.seed(s); randint``); the prompt is the problem
text, with ``"\\n\\nStarter code:\\n"`` and the starter code when there is one (RAGEN's
fallback for rllm's LiveCodeBench prompt). One answer per episode (``max_steps=1``, RAGEN's);
with more, a failed answer is shown the first failure ("Feedback: ...") and may try again.

Programs run through ``ragen_jax.envs.host.code_sandbox``: a fresh process per program, Landlock
and seccomp confinement (no files outside its directory, no network, no new processes),
CPU, memory, file-size and output limits, RAGEN's 3 s per program. The env itself runs in
the trainer's worker processes (``env.params.isolation="process"``), so even a sandbox
failure costs one episode.

Differences from RAGEN (deliberate): a ```` ```python ```` fence around the program is removed
(RAGEN runs the fence as code: a syntax error); a bare method under a starter whose method
body is empty replaces that method (``assemble``; RAGEN's program does not compile); stdout is compared line by line with trailing
spaces ignored (RAGEN: the whole text stripped), a function's value by ``str`` as RAGEN does
or by equal JSON; a program stopped by its time limit keeps the tests it passed before (RAGEN:
none); an empty answer is the rollout's format error.
Level identity (held-out validation): the problem text.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
from typing import Any

import numpy as np

from ragen_jax.envs.datafile import read_rows, row_for_seed
from ragen_jax.envs.host.code_sandbox import (
    SandboxLimits,
    TestRun,
    require_confinement,
    run_program,
)
from ragen_jax.envs.host.env import HostEnv

# RAGEN's env_instruction of the DeepCoder tag.
INSTRUCTION = ("You are solving a coding task. Provide a complete Python function solution only. "
               "Format: <answer>...</answer>")
FEEDBACK_CHARS = 400  # the longest failure text shown back to the model

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Test:
    """One test: ``function`` (``args``) or ``stdin`` (``stdin`` text), and its ``expected``
    output (kept here: the program never sees it)."""

    kind: str
    expected: Any
    stdin: str = ""
    args: tuple = ()


@dataclasses.dataclass(frozen=True)
class Problem:
    """One coding problem."""

    prompt: str
    tests: tuple[Test, ...]
    starter_code: str = ""
    func_name: str | None = None


def _literal(text: str) -> Any:
    """A test argument written as a JSON or Python literal (never evaluated as code)."""
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text.strip())


def _args(raw: Any) -> tuple:
    """A function test's arguments: a list as is; text as one literal per non-blank line
    (RAGEN's reading), or the whole text as one argument when a line is no literal."""
    if isinstance(raw, (list, tuple)):
        return tuple(raw)
    if not isinstance(raw, str):
        return (raw,)
    try:
        return tuple(_literal(line) for line in raw.strip().splitlines() if line.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return (raw,)


def _json_field(value: Any, where: str, field: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except ValueError:
            raise ValueError(f"{where}: '{field}' is not JSON") from None
    return value


def parse_problem(row: Any, where: str) -> Problem:
    """A ``Problem`` from one data row in DeepCoder's or RAGEN's fields (module docstring);
    a one-line ``ValueError`` naming ``where`` for a malformed row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
    text = row.get("problem", row.get("question"))
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: no 'problem' (or 'question') text")
    tests = _json_field(row.get("tests", row.get("ground_truth")), where, "tests")
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError(f"{where}: 'tests' has {len(tests['inputs'])} inputs but "
                             f"{len(tests['outputs'])} outputs")
        tests = [{"input": i, "output": o, "testtype": "stdin_stdout"}
                 for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{where}: 'tests' (or 'ground_truth') must be a non-empty list of tests")
    metadata = _json_field(row.get("metadata"), where, "metadata") or {}
    func_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    starter = row.get("starter_code") or ""
    parsed = []
    for n, test in enumerate(tests):
        if not isinstance(test, dict) or "output" not in test:
            raise ValueError(f"{where}: test {n} needs 'input' and 'output'")
        if test.get("testtype") == "functional" and func_name:
            parsed.append(Test("function", test["output"], args=_args(test.get("input", []))))
        else:
            parsed.append(Test("stdin", test["output"], stdin=str(test.get("input", ""))))
    prompt = f"{text}\n\nStarter code:\n{starter}" if starter else text
    return Problem(prompt, tuple(parsed), str(starter), None if func_name is None else str(func_name))


def load_problems(path: str | os.PathLike) -> tuple[Problem, ...]:
    """The problems of a JSONL or parquet file."""
    return tuple(parse_problem(row, f"{os.fspath(path)} row {n}")
                 for n, row in enumerate(read_rows(path), 1))


def extract_program(answer: str) -> str:
    """The program in an answer: the first fenced block's body when there is a fence, else
    the whole answer (surrounding blank lines dropped)."""
    m = _FENCE.search(answer)
    return (m.group(1) if m else answer).strip("\n")


def assemble(program: str, starter_code: str) -> str:
    """RAGEN's program assembly: a program defining ``class Solution`` stands alone; a bare
    ``def`` under a starter that defines the class is indented into it; else the starter
    code comes first. One repair: a starter whose last line opens a block it never fills
    (LeetCode's ``def f(self, ...):`` with an empty body, which RAGEN's assembly turns into an
    ``IndentationError`` under a bare method) is cut after its ``class Solution`` line."""
    header = starter_code.strip("\n")
    body = program.strip("\n")
    if "class Solution" in body:
        header = ""
    elif "class Solution" in header and body.startswith("def "):
        body = "\n".join(("    " + line) if line.strip() else "" for line in body.splitlines())
        if header.rstrip().endswith(":"):
            lines = header.splitlines()
            cut = next(i for i, line in enumerate(lines) if "class Solution" in line)
            header = "\n".join(lines[:cut + 1])
    return f"{header}\n\n{body}" if header and body else header or body


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in str(text).strip().splitlines()]


def passed(test: Test, run: TestRun) -> bool:
    """Whether one test's run produced its expected output (module docstring)."""
    if not run.ran:
        return False
    if test.kind == "stdin":
        return _lines(run.output) == _lines(test.expected)
    if run.output == str(test.expected):
        return True
    expected = test.expected
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except ValueError:
            return False
    return run.value is not None and run.value == expected


def _failure(i: int, test: Test, run: TestRun) -> str:
    if not run.ran:
        return f"Runtime error on test {i}: {run.error}"
    return f"Wrong answer on test {i}: got {run.output.strip()} expected {str(test.expected).strip()}"


class DeepCoder(HostEnv):
    """A coding problem per episode, judged by its tests in the sandbox (module docstring)."""

    instruction = INSTRUCTION
    parallel_friendly = True  # each step is a separate confined process

    def __init__(self, data_path: str = "", max_steps: int = 1, time_limit: float = 3.0,
                 memory_mb: int = 512, confine: bool = True):
        if not data_path:
            raise ValueError("deepcoder needs data_path: a JSONL or parquet file of problems in "
                             "DeepCoder's fields (problem, tests, starter_code, metadata), e.g. "
                             "--config.env.params.data_path=deepcoder_train.jsonl")
        if max_steps < 1:
            raise ValueError(f"deepcoder: max_steps must be >= 1, got {max_steps!r}")
        self.limits = SandboxLimits(time_limit=float(time_limit), memory_mb=int(memory_mb),
                                    confine=bool(confine))
        if self.limits.confine:
            require_confinement()
        self.problems = load_problems(data_path)
        self.max_steps = int(max_steps)
        self.step_timeout = self.limits.time_limit + 10.0  # the program's limit, start-up, judging
        self.problem: Problem | None = None
        self.steps = 0

    def reset(self, seed: int) -> str:
        self.problem = self.problems[row_for_seed(seed, len(self.problems))]
        self.steps = 0
        return self.problem.prompt

    def level_key(self) -> str | None:
        return None if self.problem is None else self.problem.prompt

    def judge(self, answer: str) -> tuple[int, str]:
        """(tests passed, feedback) of one answer on the current problem."""
        problem = self.problem
        code = assemble(extract_program(answer), problem.starter_code)
        tests = [{"kind": "function", "args": list(t.args)} if t.kind == "function"
                 else {"kind": "stdin", "stdin": t.stdin} for t in problem.tests]
        runs, stopped = run_program(code, tests, problem.func_name, self.limits)
        ok = [passed(t, r) for t, r in zip(problem.tests, runs, strict=True)]
        if all(ok):
            return len(ok), "All tests passed."
        first = ok.index(False)
        detail = f"Passed {sum(ok)}/{len(ok)} tests. {_failure(first, problem.tests[first], runs[first])}"
        if stopped:
            detail += f" (the program was stopped: {stopped})"
        return sum(ok), detail[:FEEDBACK_CHARS]

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("step before reset")
        total = len(self.problem.tests)
        count, detail = self.judge(action)
        correct = count == total
        self.steps += 1
        done = correct or self.steps >= self.max_steps
        text = ("Correct!" if correct else "Incorrect.") if done else \
            f"{self.problem.prompt}\n\nFeedback: {detail}"
        return text, count / total, done, {
            "success": correct, "action_is_valid": bool(action.strip()),
            "action_is_effective": correct, "passed_tests": count, "total_tests": total}

    def random_action(self, rng: np.random.Generator) -> str:
        """A well-formed program that solves nothing: the format, not the answer."""
        value = int(rng.integers(0, 10))
        if self.problem is not None and self.problem.func_name:
            return f"def {self.problem.func_name}(*args): return {value}"
        return f"print({value})"
