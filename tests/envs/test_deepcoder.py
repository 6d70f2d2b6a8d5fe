"""DeepCoder as a host env: RAGEN's program assembly and test reading against plain-Python
copies of its code, our sample's problems solved by reference programs, partial credit,
retries with feedback, data errors, level identity; every sandbox escape costs one episode
and the next episode plays normally."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import make
from ragen_jax.envs.datafile import row_for_seed
from ragen_jax.envs.deepcoder import DeepCoder, assemble, extract_program, load_problems
from ragen_jax.envs.host.code_sandbox import confinement_problem

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "deepcoder_sample.jsonl"
needs_sandbox = pytest.mark.skipif(confinement_problem() is not None,
                                   reason=str(confinement_problem()))

# A reference program for each sample problem, in file order.
SOLUTIONS = [
    "a, b = map(int, input().split())\nprint(a + b)",
    "n = int(input())\nprint(n * n)",
    "print(input()[::-1])",
    "import math\nprint(math.factorial(int(input())))",
    "input()\nprint(max(map(int, input().split())))",
    "w = input().strip()\nprint('YES' if w == w[::-1] else 'NO')",
    "for i in range(1, int(input()) + 1):\n    print(i)",
    "print(sum(c in 'aeiou' for c in input().lower()))",
    "```python\ndef add(a, b):\n    return a + b\n```",  # a fenced answer
    "def is_even(n):\n    return n % 2 == 0",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "def sum_list(xs):\n    return sum(xs)",
    "def count_char(s, c):\n    return s.count(c)",
    "def sortList(self, nums):\n    return sorted(nums)",  # a bare method under the starter class
    "class Solution:\n    def maxOfThree(self, a, b, c):\n        return max(a, b, c)",
    "import math\ndef gcd(a, b):\n    return math.gcd(a, b)",
]


def ragen_assemble(code: str, starter_code: str) -> str:
    """RAGEN's run_deepcoder_sandbox code assembly, copied."""
    header = (starter_code or "").strip("\n")
    body = (code or "").strip("\n")
    if "class Solution" in body:
        header = ""
    elif "class Solution" in header and body.startswith("def "):
        body = "\n".join([("    " + line) if line.strip() else "" for line in body.splitlines()])
    if header and body:
        return f"{header}\n\n{body}"
    return header or body


_CODE = st.lists(st.sampled_from(["def f(x):", "    return x", "class Solution:", "", "  ", "\n",
                                  "print(1)", "class Solution: pass"]), max_size=6).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(_CODE, _CODE)
def test_program_assembly_matches_ragen(code, starter):
    ours, theirs = assemble(code, starter), ragen_assemble(code, starter)
    repaired = ("class Solution" in starter and "class Solution" not in code.strip("\n")
                and code.strip("\n").startswith("def ") and starter.strip("\n").rstrip().endswith(":"))
    if not repaired:
        assert ours == theirs
    else:  # the same indented method after the starter cut after its class line
        header = starter.strip("\n")
        method = theirs[len(header) + 2:]
        cut = ours[:len(ours) - len(method) - 2]
        assert ours == f"{cut}\n\n{method}" and header.startswith(cut)
        assert "class Solution" in cut.splitlines()[-1]


def test_a_bare_method_under_leetcodes_starter_compiles():
    starter = "class Solution:\n    def f(self, x: int) -> int:\n        "
    method = "def f(self, x):\n    return x + 1"
    with pytest.raises(SyntaxError):  # RAGEN's assembly
        compile(ragen_assemble(method, starter), "<s>", "exec")
    scope = {}
    exec(compile(assemble(method, starter), "<s>", "exec"), scope)
    assert scope["Solution"]().f(1) == 2


def test_fences_are_removed_and_bare_programs_kept():
    assert extract_program("```python\nprint(1)\n```") == "print(1)"
    assert extract_program("Here:\n```py\nx = 1\nprint(x)\n```\ntext") == "x = 1\nprint(x)"
    assert extract_program("```\nprint(2)") == "print(2)"  # an unclosed fence
    assert extract_program("\nprint(3)\n") == "print(3)"


def test_function_test_arguments_are_literals_never_code():
    problem = load_problems(SAMPLE)[12]  # count_char
    assert problem.func_name == "count_char" and problem.tests[0].args == ("banana", "a")
    from ragen_jax.envs.deepcoder import _args
    assert _args("[1, 2]\n3") == ([1, 2], 3)
    assert _args("(1, 'a')\nTrue") == ((1, "a"), True)  # Python literals too
    assert _args("__import__('os').system('x')") == ("__import__('os').system('x')",)  # kept as text


def test_each_seed_plays_ragens_row():
    env = DeepCoder(data_path=str(SAMPLE), confine=False)
    problems = load_problems(SAMPLE)
    for seed in range(40):
        assert env.reset(seed) == problems[row_for_seed(seed, len(problems))].prompt


@needs_sandbox
def test_reference_programs_pass_every_sample_problem():
    env = DeepCoder(data_path=str(SAMPLE))
    for problem, solution in zip(env.problems, SOLUTIONS, strict=True):
        env.problem, env.steps = problem, 0
        text, reward, done, info = env.step(solution)
        assert (text, reward, done, info["success"]) == ("Correct!", 1.0, True, True), problem.prompt


@needs_sandbox
def test_partial_credit_feedback_and_retries():
    env = DeepCoder(data_path=str(SAMPLE), max_steps=2)
    env.problem, env.steps = env.problems[2], 0  # reverse a line; tests: hello, abc def, racecar, x
    text, reward, done, info = env.step("s = input()\nprint(s if s in ('racecar', 'x') else s)")
    assert reward == 0.5 and not done and info["passed_tests"] == 2 and info["total_tests"] == 4
    assert text.startswith(env.problem.prompt) and "Feedback: Passed 2/4 tests." in text
    assert "Wrong answer on test 0" in text
    text, reward, done, info = env.step(SOLUTIONS[2])
    assert (text, reward, done, info["success"]) == ("Correct!", 1.0, True, True)


@needs_sandbox
@pytest.mark.parametrize("escape", [
    "while True:\n    pass",
    "import os\nwhile True:\n    os.fork()",
    "print(open('/etc/passwd').read())",
    "import socket\nsocket.create_connection(('127.0.0.1', 80))",
    "import os\nwhile True:\n    os.write(1, b'x' * 65536)",
    "raise SystemExit(0)",
    "import os\nos._exit(0)",
    # endings that once became the caller's error (an env error, left out of the update)
    # instead of the answer's 0: a signal with no name, and its results channel misused
    "import os\nos.kill(os.getpid(), 40)",
    "import os, sys\nos.write(int(sys.argv[1]), b'[' * 100000 + b'\\n')",
    "import os, sys\nfor _ in range(40):\n    os.write(int(sys.argv[1]), b'12\\n' * (1 << 20))",
])
def test_every_escape_costs_one_episode(escape):
    env = DeepCoder(data_path=str(SAMPLE), time_limit=1.0)
    env.problem, env.steps = env.problems[0], 0
    text, reward, done, info = env.step(escape)
    assert (text, reward, done, info["success"]) == ("Incorrect.", 0.0, True, False)
    env.problem, env.steps = env.problems[0], 0  # the next episode plays normally
    assert env.step(SOLUTIONS[0])[1] == 1.0


def test_data_errors_and_options(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for row, message in [({"tests": "[]"}, "no 'problem'"),
                         ({"problem": "p", "tests": "[]"}, "non-empty list"),
                         ({"problem": "p", "tests": "not json"}, "'tests' is not JSON"),
                         ({"problem": "p", "tests": [{"input": "1"}]}, "test 0 needs"),
                         ({"problem": "p", "tests": {"inputs": ["1"], "outputs": []}},
                          "1 inputs but 0 outputs")]:
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=message):
            load_problems(bad)
    with pytest.raises(ValueError, match="deepcoder needs data_path"):
        DeepCoder()
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        DeepCoder(data_path=str(SAMPLE), max_steps=0)
    with pytest.raises(ValueError, match="time_limit must be > 0"):
        DeepCoder(data_path=str(SAMPLE), time_limit=0)
    # RAGEN's prepared rows and the {"inputs", "outputs"} test shape read the same.
    ragen_row = {"question": "Q", "ground_truth": json.dumps({"inputs": ["1\n"], "outputs": ["1"]}),
                 "starter_code": "", "metadata": "{}"}
    bad.write_text(json.dumps(ragen_row) + "\n")
    (problem,) = load_problems(bad)
    assert problem.prompt == "Q" and problem.tests[0].kind == "stdin" and problem.tests[0].stdin == "1\n"


def test_registered_host_env_level_identity_and_random_actions():
    family, params = make("deepcoder", data_path=str(SAMPLE), confine=False)
    assert params is None and family.parallel_friendly and family.step_timeout == 13.0
    env = family.factory()
    assert env.level_key() is None
    env.reset(3)
    assert env.level_key() == env.problem.prompt
    rng = np.random.default_rng(0)
    for seed in range(20):
        env.reset(seed)
        action = env.random_action(rng)
        if env.problem.func_name:
            assert action.startswith(f"def {env.problem.func_name}(")
        else:
            assert action.startswith("print(")
