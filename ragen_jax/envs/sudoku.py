"""Sudoku (RAGEN's SimpleSudoku / MediumSudoku) as a host environment.

The agent fills a ``size x size`` grid (4 or 9) one placement at a time, in free text:
``place 5 at row 2 col 3`` (``column`` also reads) or ``2,3,5`` (row, col, value; 1-based).

Rewards per placement (RAGEN's scheme): +1 when the value is the solution's, +0.5 when it is
legal (no repeat in its row, column or box) but not the solution's, -0.1 when it is invalid
(unparsable, off the board, on a given or already filled cell, or breaking a rule; nothing is
placed), and +10 more for the placement that completes the grid. Filled cells are final (no
overwriting: a legal but wrong placement cannot be taken back, so repeated placements cannot
farm reward). The episode ends solved (``info["success"]``), stuck (an empty cell has no
legal value left: a wrong placement made the grid unsolvable), or after ``max_steps``
placements (``info["truncated"]``).

Puzzles come from the seed: a full grid (the base pattern ``(r*b + r//b + c) mod n`` with
bands, stacks, rows in bands, columns in stacks and digits shuffled, as RAGEN builds it), then
cells emptied in a random order, each only if the puzzle keeps a unique solution (a
backtracking solution counter), until ``removed`` cells are empty (difficulty) or no further
cell can go. ``difficulty`` sets ``removed`` as RAGEN's clue table: 4x4 easy / medium / hard
keep 10 / 9 / 6 givens, 9x9 36 / 30 / 24.

The observation: a feedback line after a step, then one line per row, cells separated by
spaces: a given in brackets (``[5]``), a placed value bare, an empty cell ``.``.

**Host-side, not pure JAX**, for two reasons: the actions are free text in two formats (as
action names, a 9x9 board would need its 729 placements listed in the system message), and
generating a unique-solution puzzle runs a backtracking solution count for each emptied cell,
a data-dependent search that ``vmap`` would pad to its worst case; on the host a 9x9 puzzle
takes milliseconds (``experiments/benchmarks/bench_envs.py``).

Differences from RAGEN: RAGEN's versions differ among themselves (one rewards 1 only for a
solved board, one uses the +1 / 0.5 / -0.1 / +10 scheme above with overwriting); here filled
cells are final and a stuck grid ends the episode.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ragen_jax.envs.host.env import HostEnv

INSTRUCTION = (
    "You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and box "
    "contains each number once. Initial cells are shown in [brackets] and cannot be modified. "
    "Empty cells are shown as dots (.). Place numbers one at a time using the format: "
    "<answer>place 3 at row 2 col 1</answer> or <answer>2,1,3</answer>"
)  # RAGEN's env_instruction, with the box and digit range left to the board size

# Givens kept by difficulty (RAGEN's table); removed = size * size - givens.
GIVENS = {4: {"easy": 10, "medium": 9, "hard": 6}, 9: {"easy": 36, "medium": 30, "hard": 24}}

_PLACE = re.compile(r"place\s+([0-9])\s+at\s+row\s+([0-9])\s*,?\s*col(?:umn)?\s+([0-9])",
                    re.IGNORECASE)
_TRIPLE = re.compile(r"([0-9])\s*,\s*([0-9])\s*,\s*([0-9])")


def full_grid(rng: np.random.Generator, size: int) -> np.ndarray:
    """A random complete grid (``[size, size]`` int8, values 1..size)."""
    b = math.isqrt(size)
    base = (np.arange(size)[:, None] * b + np.arange(size)[:, None] // b
            + np.arange(size)[None, :]) % size
    rows = np.concatenate([g * b + rng.permutation(b) for g in rng.permutation(b)])
    cols = np.concatenate([g * b + rng.permutation(b) for g in rng.permutation(b)])
    digits = rng.permutation(size) + 1
    return digits[base[rows][:, cols]].astype(np.int8)


def solutions(board: np.ndarray, limit: int = 2) -> list[np.ndarray]:
    """Up to ``limit`` completions of ``board`` (0 = empty), by backtracking on the cell with
    the fewest candidates; ``[]`` if it has none or breaks a rule already."""
    n = board.shape[0]
    b = math.isqrt(n)
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    grid = board.astype(int).copy()
    empty = []
    for r in range(n):
        for c in range(n):
            v, k = int(grid[r, c]), (r // b) * b + c // b
            if not v:
                empty.append((r, c, k))
                continue
            bit = 1 << v
            if (rows[r] | cols[c] | boxes[k]) & bit:
                return []
            rows[r] |= bit
            cols[c] |= bit
            boxes[k] |= bit
    every = sum(1 << v for v in range(1, n + 1))
    found: list[np.ndarray] = []

    def search(todo: list[tuple[int, int, int]]) -> None:
        if not todo:
            found.append(grid.copy())
            return
        best, best_opts, best_count = 0, 0, n + 1
        for i, (r, c, k) in enumerate(todo):
            opts = every & ~(rows[r] | cols[c] | boxes[k])
            count = bin(opts).count("1")
            if count < best_count:
                best, best_opts, best_count = i, opts, count
                if count <= 1:
                    break
        r, c, k = todo[best]
        rest = todo[:best] + todo[best + 1:]
        for v in range(1, n + 1):
            bit = 1 << v
            if best_opts & bit:
                grid[r, c] = v
                rows[r] |= bit
                cols[c] |= bit
                boxes[k] |= bit
                search(rest)
                rows[r] &= ~bit
                cols[c] &= ~bit
                boxes[k] &= ~bit
                grid[r, c] = 0
                if len(found) >= limit:
                    return

    search(empty)
    return found


def generate(seed: int, size: int = 4, removed: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """``(puzzle, solution)`` of ``seed``: up to ``removed`` cells emptied, the solution unique."""
    rng = np.random.default_rng(seed)
    solution = full_grid(rng, size)
    puzzle = solution.copy()
    emptied = 0
    for cell in rng.permutation(size * size):
        if emptied >= removed:
            break
        r, c = divmod(int(cell), size)
        keep, puzzle[r, c] = puzzle[r, c], 0
        if len(solutions(puzzle, limit=2)) == 1:
            emptied += 1
        else:
            puzzle[r, c] = keep
    return puzzle, solution


def parse_placement(action: str) -> tuple[int, int, int] | None:
    """``(row, col, value)`` (row and col 0-based) of ``place V at row R col C`` or ``R,C,V``;
    None when the text is neither (ASCII digits only)."""
    if not isinstance(action, str):
        return None
    text = action.strip()
    m = _PLACE.fullmatch(text)
    if m:
        value, row, col = (int(g) for g in m.groups())
        return row - 1, col - 1, value
    m = _TRIPLE.fullmatch(text)
    if m:
        row, col, value = (int(g) for g in m.groups())
        return row - 1, col - 1, value
    return None


class Sudoku(HostEnv):
    """One unique-solution Sudoku per episode (see the module docstring)."""

    instruction = INSTRUCTION

    def __init__(self, size: int = 4, difficulty: str = "easy", removed: int = -1,
                 max_steps: int = 100, correct_reward: float = 1.0, legal_reward: float = 0.5,
                 invalid_reward: float = -0.1, solved_reward: float = 10.0):
        if size not in GIVENS:
            raise ValueError(f"size must be 4 or 9, got {size}")
        if difficulty not in GIVENS[size]:
            raise ValueError(f"difficulty must be one of {sorted(GIVENS[size])}, got {difficulty!r}")
        self.size = size
        self.removed = size * size - GIVENS[size][difficulty] if removed < 0 else int(removed)
        self.max_steps = int(max_steps)
        self.rewards = (float(correct_reward), float(legal_reward), float(invalid_reward),
                        float(solved_reward))
        self.box = math.isqrt(size)
        self.puzzle = self.solution = self.board = None
        self.steps = 0

    def reset(self, seed: int) -> str:
        self.puzzle, self.solution = generate(seed, self.size, self.removed)
        self.board, self.steps = self.puzzle.copy(), 0
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.board is None:
            raise RuntimeError("step before reset")
        correct, legal, invalid, solved = self.rewards
        self.steps += 1
        move = parse_placement(action)
        problem = self.problem(move)
        if problem:
            reward, feedback = invalid, f"Invalid move: {problem}."
        else:
            r, c, v = move
            self.board[r, c] = v
            reward = correct if v == self.solution[r, c] else legal
            feedback = f"Placed {v} at row {r + 1} col {c + 1}."
        won = bool((self.board == self.solution).all())
        stuck = not won and self.stuck()
        truncated = not (won or stuck) and self.steps >= self.max_steps
        reward += solved if won else 0.0
        info = {"success": won, "truncated": truncated, "action_is_effective": not problem,
                "action_is_valid": not problem}
        return self.render(feedback), reward, won or stuck or truncated, info

    def problem(self, move: tuple[int, int, int] | None) -> str:
        """Why ``move`` is invalid ("" when it is legal)."""
        if move is None:
            return "write place V at row R col C"
        r, c, v = move
        n = self.size
        if not (0 <= r < n and 0 <= c < n and 1 <= v <= n):
            return f"rows, columns and values go from 1 to {n}"
        if self.board[r, c]:
            return "that cell is already filled"
        br, bc = r - r % self.box, c - c % self.box
        if v in self.board[r] or v in self.board[:, c] or v in self.board[br:br + self.box, bc:bc + self.box]:
            return f"{v} is already in that row, column or box"
        return ""

    def stuck(self) -> bool:
        """Some empty cell has no legal value left."""
        for r, c in zip(*np.nonzero(self.board == 0), strict=True):
            br, bc = r - r % self.box, c - c % self.box
            used = set(self.board[r]) | set(self.board[:, c]) | set(
                self.board[br:br + self.box, bc:bc + self.box].ravel())
            if all(v in used for v in range(1, self.size + 1)):
                return True
        return False

    def render(self, feedback: str = "") -> str:
        """The board (givens in brackets, ``.`` empty), after the step's feedback line."""
        lines = [feedback] if feedback else []
        for r in range(self.size):
            lines.append(" ".join(
                f"[{v}]" if self.puzzle[r, c] else (str(v) if v else ".")
                for c, v in enumerate(self.board[r])))
        return "\n".join(lines)

    def random_action(self, rng: np.random.Generator) -> str:
        """A placement on a random empty cell with a random value (format only)."""
        empty = np.argwhere(self.board == 0)
        r, c = empty[int(rng.integers(len(empty)))] if len(empty) else (0, 0)
        return f"place {int(rng.integers(1, self.size + 1))} at row {r + 1} col {c + 1}"
