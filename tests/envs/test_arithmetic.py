"""The safe arithmetic parser: exact values, and every hostile string a value or None, fast."""

import time
from fractions import Fraction

import pytest

from ragen_jax.envs.arithmetic import MAX_CHARS, MAX_DEPTH, parse


@pytest.mark.parametrize("text, numbers, value", [
    ("1 + 2 * 3", (1, 2, 3), Fraction(7)),
    ("(1 + 2) * 3", (1, 2, 3), Fraction(9)),
    ("8 / 3 * 3", (8, 3, 3), Fraction(8)),  # exact: no float rounding
    ("7 / 2", (7, 2), Fraction(7, 2)),
    ("- 5 + 3", (5, 3), Fraction(-2)),  # unary minus, as RAGEN's eval accepts
    ("10 - 4 - 3", (10, 4, 3), Fraction(3)),  # left-associative
    ("24 / 4 / 2", (24, 4, 2), Fraction(3)),
    ("\t( 2 )\n", (2,), Fraction(2)),
])
def test_values(text, numbers, value):
    expr = parse(text)
    assert expr.numbers == numbers and expr.value == value


def test_division_by_zero_parses_without_a_value():
    expr = parse("8 / (3 - 3)")
    assert expr.numbers == (8, 3, 3) and expr.value is None


@pytest.mark.parametrize("text", [
    "9**9**9", "2 ** 100000", "9 // 2", "1 2", "2 + ", "(1 + 2", "1 + 2)", "()", "",
    "1 = 1", "2 ^ 3", "abs(-1)", "__import__('os')", "1e9", "0x10", "3.5 + 1",
    "１ + 2", "١٢ + 3", "²", "1" * 13, "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1),
    "-" * (MAX_DEPTH + 1) + "1", "1+" * MAX_CHARS + "1",
])
def test_not_expressions(text):
    assert parse(text) is None


def test_depth_at_the_limit_still_parses():
    expr = parse("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH)
    assert expr is not None and expr.value == 1


def test_hostile_inputs_are_fast():
    """Long operator chains, huge products within the size limit and deep nesting: each well
    under a millisecond's budget times a safety factor, never a hang."""
    texts = ["9" * 12 + " * " + " * ".join(["9" * 12] * 18), "(" * 10_000, "9**9**9" * 30,
             " - ".join(["1"] * 120), "1/" * 120 + "1"]
    t0 = time.perf_counter()
    for text in texts:
        parse(text)
    assert time.perf_counter() - t0 < 0.5
