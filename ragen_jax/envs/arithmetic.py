"""A small, safe arithmetic parser for model-written expressions (Countdown's answers).

``parse(text) -> Expression | None``: ASCII integers, ``+ - * /``, unary ``-`` / ``+``,
parentheses and spaces, nothing else; the value is an exact ``Fraction``. Model text is never
given to ``eval``. Everything that could make it slow or raise is bounded and turned into
"not an expression" (``None``) or "no value":

* at most ``MAX_CHARS`` characters and ``MAX_DEPTH`` nested parentheses / unary signs (the
  recursive descent never nears Python's recursion limit);
* integer literals of at most ``MAX_DIGITS`` ASCII digits (``str.isdigit`` would accept
  ``"١٢"`` or ``"１２"``, and ``int()`` would read them: they are rejected, not read);
* ``**`` (and any other character: ``=``, ``^``, letters) is a syntax error, so ``9**9**9`` costs
  nothing; with at most ``MAX_CHARS // 2`` operands of ``MAX_DIGITS`` digits no product grows
  past a few thousand bits;
* division by zero leaves a parsed expression without a value (``value is None``).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

MAX_CHARS = 256  # longer text is not an expression
MAX_DEPTH = 32  # nested parentheses and unary signs
MAX_DIGITS = 12  # digits of one integer literal

_OPERATORS = "+-*/()"


@dataclasses.dataclass(frozen=True)
class Expression:
    """A parsed expression: its integer literals in order and its exact value (None where it
    divides by zero)."""

    numbers: tuple[int, ...]
    value: Fraction | None


class _SyntaxError(Exception):
    """Not an expression (internal; ``parse`` returns None)."""


def _tokens(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c in " \t\n":
            i += 1
        elif c in _OPERATORS:
            out.append(c)
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_DIGITS:
                raise _SyntaxError
            out.append(text[i:j])
            i = j
        else:
            raise _SyntaxError
    return out


class _Parser:
    """Recursive descent: expr = term (('+'|'-') term)*; term = unary (('*'|'/') unary)*;
    unary = ('+'|'-') unary | primary; primary = integer | '(' expr ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i, self.depth = tokens, 0, 0
        self.numbers: list[int] = []
        self.divided_by_zero = False

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _SyntaxError
        self.i += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.unary()  # '**', '//': the second sign is no operand
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                self.divided_by_zero = True  # keep parsing: the numbers still count
                value = Fraction(0)
            else:
                value = value / rhs
        return value

    def unary(self) -> Fraction:
        tok = self.peek()
        if tok in ("+", "-"):
            self.take()
            self.enter()
            value = self.unary()
            self.depth -= 1
            return -value if tok == "-" else value
        return self.primary()

    def primary(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            self.enter()
            value = self.expr()
            self.depth -= 1
            if self.take() != ")":
                raise _SyntaxError
            return value
        if not tok.isascii() or not tok.isdigit():
            raise _SyntaxError
        self.numbers.append(int(tok))
        return Fraction(int(tok))

    def enter(self) -> None:
        """One level deeper (a parenthesis or a unary sign); too deep is a syntax error."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _SyntaxError


def parse(text: str) -> Expression | None:
    """The expression ``text`` writes, or None if it is not one (never raises)."""
    if not isinstance(text, str) or len(text) > MAX_CHARS:
        return None
    try:
        parser = _Parser(_tokens(text))
        value = parser.expr()
        if parser.peek() is not None:
            raise _SyntaxError
    except _SyntaxError:
        return None
    return Expression(tuple(parser.numbers), None if parser.divided_by_zero else value)
