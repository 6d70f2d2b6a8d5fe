"""Countdown (RAGEN's ``countdown`` env) as a host environment.

Reach the target with the given numbers, each used exactly once, with ``+ - * /`` and
parentheses. One step: the answer is an expression; reward ``score`` (1) if it uses exactly the
given numbers and equals the target, ``format_score`` (0.1) if it uses exactly the given
numbers but misses (or divides by zero), 0 otherwise. ``info["success"]``: the reward is
``score``. The observation is RAGEN's: ``Target: 24, nums: [3, 5, 2, 8]``.

Puzzles come from the seed (``generate``: 3 to 4 numbers, a random expression tree over all
of them whose value, a positive integer up to ``max_target``, becomes the target, so every
puzzle is solvable by construction) or, with ``data_path``, from a JSONL or parquet file of
``{"target": int, "nums": [int, ...]}`` rows (``numbers`` is accepted for ``nums``; parquet
through pyarrow, ``pip install 'ragen_jax[parquet]'``); a malformed file is a one-line
``ValueError`` naming the file, the row and the field.

Which puzzles are played is RAGEN's choice (``plus_minus_only=True``, the default): RAGEN
keeps the first ``max_instances`` (20,000) rows of its file, then those whose target is
``±n1 ±n2 ±n3 ±n4`` (its ``has_solution``: only ``+`` and ``-``, every number once), and plays
filtered row ``seed mod len``; a file here is read the same way (a shorter file: all its
rows), and a generated puzzle that fails the filter is drawn again from the seed's stream, so
no puzzle needs ``*`` or ``/`` (the answer may still use them). ``plus_minus_only=False``
plays every row (``seed mod len`` of the first ``max_instances``) and every generated puzzle,
a harder task than RAGEN's. RAGEN's check reads only a row's first four numbers (its data has
3 or 4); here every number counts.

Host-side, not JAX: the step parses free text. Differences from RAGEN (deliberate):

* RAGEN reads a downloaded parquet file; the puzzles here are generated (a file is optional).
* RAGEN checks the numbers with a regex on the raw answer and its value with ``eval``; here the
  answer must parse as an arithmetic expression (``envs.arithmetic``: exact fractions, no
  ``eval``, bounded size) or it earns 0, so ``"1 2 3"`` gets 0 where RAGEN gives 0.1, and
  unicode digits are not numbers.
* An empty answer is the rollout's format error (penalty -0.1) rather than RAGEN's
  ``invalid_act_score``; the feedback text reads "Your answer gets ... points.".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from ragen_jax.envs.arithmetic import parse
from ragen_jax.envs.datafile import read_rows
from ragen_jax.envs.host.env import HostEnv

INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation "
    "that equals the target. Example answer format: <think> To find an equation using [3, 5, 2] "
    "to get 4. Let's check 2 + 5 = 7, 7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think>"
    "<answer>2 + 5 - 3</answer>"
)  # RAGEN's env_instruction for the Countdown tag

_OPS = "+-*/"


@dataclasses.dataclass(frozen=True)
class Puzzle:
    """A Countdown puzzle; ``solution`` is one expression reaching the target ("" if unknown)."""

    target: int
    numbers: tuple[int, ...]
    solution: str = ""


def has_plus_minus_solution(numbers: Sequence[int], target: int) -> bool:
    """RAGEN's ``has_solution``: ``target`` is a sum of ``numbers`` each with a sign of its
    own (only ``+`` and ``-``, every number once)."""
    return any(sum(s * n for s, n in zip(signs, numbers, strict=True)) == target
               for signs in itertools.product((1, -1), repeat=len(numbers)))


def generate(seed: int, *, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99,
             max_target: int = 100, plus_minus_only: bool = False) -> Puzzle:
    """The puzzle of ``seed``: ``min_numbers``..``max_numbers`` numbers in 1..``max_number``
    combined in a random order by random operations; the first draw whose value is an integer
    in 1..``max_target`` (and with ``plus_minus_only`` passes ``has_plus_minus_solution``) is
    the target (exact arithmetic; a division by zero is redrawn)."""
    rng = np.random.default_rng(seed)
    for _ in range(10_000):
        count = int(rng.integers(min_numbers, max_numbers + 1))
        numbers = tuple(int(n) for n in rng.integers(1, max_number + 1, size=count))
        value, text = _random_tree(rng, numbers)
        if (value is not None and value.denominator == 1 and 1 <= value <= max_target
                and (not plus_minus_only or has_plus_minus_solution(numbers, int(value)))):
            return Puzzle(int(value), numbers, text)
    raise RuntimeError(f"no Countdown puzzle found for seed {seed} (max_target too small?)")


def _random_tree(rng: np.random.Generator, numbers: tuple[int, ...]) -> tuple[Fraction | None, str]:
    """Combines every number once: two random items, a random operation, until one is left."""
    items = [(Fraction(n), str(n)) for n in numbers]
    while len(items) > 1:
        i, j = (int(k) for k in rng.choice(len(items), size=2, replace=False))
        (a, ta), (b, tb) = items[i], items[j]
        op = _OPS[int(rng.integers(4))]
        if op == "/" and b == 0:
            return None, ""
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(value, f"({ta} {op} {tb})")]
    value, text = items[0]
    return value, text[1:-1] if text.startswith("(") else text


def _integer(x: Any) -> int:
    """``x`` as an int when it is one (``6``, ``6.0``, a numpy integer); else ValueError."""
    if isinstance(x, (str, bytes, bool)) or int(x) != x:
        raise ValueError(x)
    return int(x)


@functools.lru_cache(maxsize=8)
def _read_puzzles(path: str, mtime: float) -> tuple[Puzzle, ...]:
    del mtime  # part of the cache key only: an edited file is read again
    rows = read_rows(path)
    puzzles = []
    for n, row in enumerate(rows, 1):
        where = f"{path} row {n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with 'target' and 'nums', got "
                             f"{type(row).__name__}")
        for field in ("target", "nums"):
            if row.get(field, row.get("numbers") if field == "nums" else None) is None:
                raise ValueError(f"{where}: no '{field}' (need 'target' and 'nums')")
        nums = row["nums"] if row.get("nums") is not None else row["numbers"]
        try:
            target = _integer(row["target"])
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{where}: 'target' must be an integer, got {row['target']!r}") from None
        try:
            numbers = tuple(_integer(x) for x in nums)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{where}: 'nums' must be a list of integers, got {nums!r}") from None
        puzzles.append(Puzzle(target, numbers))
    return tuple(puzzles)


def load_puzzles(path: str | os.PathLike) -> tuple[Puzzle, ...]:
    """The puzzles of a JSONL or parquet file (read once per version of the file)."""
    path = os.fspath(path)
    return _read_puzzles(path, os.path.getmtime(path))


def ragen_pool(puzzles: Sequence[Puzzle], *, max_instances: int = 20_000,
               plus_minus_only: bool = True) -> tuple[Puzzle, ...]:
    """The puzzles RAGEN's Countdown plays from a file's rows: the first ``max_instances`` (0:
    all; RAGEN: 20,000), then with ``plus_minus_only`` those ``has_plus_minus_solution``
    keeps; an episode plays ``pool[seed mod len(pool)]``."""
    rows = puzzles[:max_instances] if max_instances else puzzles
    return tuple(p for p in rows if not plus_minus_only
                 or has_plus_minus_solution(p.numbers, p.target))


def score_answer(answer: str, puzzle: Puzzle, *, format_score: float = 0.1,
                 score: float = 1.0) -> float:
    """RAGEN's Countdown reward of one answer (never raises; see the module docstring)."""
    expr = parse(answer.strip()) if isinstance(answer, str) else None
    if expr is None or sorted(expr.numbers) != sorted(puzzle.numbers):
        return 0.0
    return score if expr.value == puzzle.target else format_score


class Countdown(HostEnv):
    """One Countdown puzzle per episode, one step (see the module docstring)."""

    instruction = INSTRUCTION

    def __init__(self, data_path: str = "", min_numbers: int = 3, max_numbers: int = 4,
                 max_number: int = 99, max_target: int = 100, format_score: float = 0.1,
                 score: float = 1.0, plus_minus_only: bool = True, max_instances: int = 20_000):
        if not 1 <= min_numbers <= max_numbers:
            raise ValueError(f"need 1 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        if max_instances < 0:
            raise ValueError(f"need max_instances >= 0 (0: every row), got {max_instances}")
        self.puzzles = None
        if data_path:
            self.puzzles = ragen_pool(load_puzzles(data_path), max_instances=max_instances,
                                      plus_minus_only=plus_minus_only)
            if not self.puzzles:
                rows = f"its first {max_instances} rows" if max_instances else "its rows"
                raise ValueError(f"{data_path}: no puzzle in {rows} is solvable with + and - "
                                 f"alone (plus_minus_only=False plays every row)")
        self.sizes = dict(min_numbers=min_numbers, max_numbers=max_numbers,
                          max_number=max_number, max_target=max_target,
                          plus_minus_only=plus_minus_only)
        self.format_score, self.score = float(format_score), float(score)
        self.puzzle: Puzzle | None = None

    def puzzle_for(self, seed: int) -> Puzzle:
        """The puzzle an episode of ``seed`` plays."""
        if self.puzzles is not None:
            return self.puzzles[seed % len(self.puzzles)]
        return generate(seed, **self.sizes)

    def reset(self, seed: int) -> str:
        self.puzzle = self.puzzle_for(seed)
        return f"Target: {self.puzzle.target}, nums: {list(self.puzzle.numbers)}"

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.puzzle is None:
            raise RuntimeError("step before reset")
        reward = score_answer(action, self.puzzle, format_score=self.format_score, score=self.score)
        info = {"success": reward == self.score, "action_is_effective": reward > 0,
                "action_is_valid": reward > 0}
        return f"Your answer gets {reward:g} points.", reward, True, info

    def random_action(self, rng: np.random.Generator) -> str:
        """The numbers in a random order joined by random operations (format only)."""
        numbers = [self.puzzle.numbers[i] for i in rng.permutation(len(self.puzzle.numbers))]
        ops = [_OPS[int(k)] for k in rng.integers(4, size=len(numbers) - 1)]
        return " ".join([str(numbers[0])] + [f"{o} {n}" for o, n in zip(ops, numbers[1:], strict=True)])
