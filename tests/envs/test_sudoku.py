"""Sudoku: unique-solution puzzles from the seed, difficulty by givens, RAGEN's rewards on
hand-written placements, the free-text formats."""

import numpy as np
import pytest

from ragen_jax.envs.sudoku import GIVENS, Sudoku, full_grid, generate, parse_placement, solutions


def valid_grid(grid: np.ndarray) -> bool:
    n = grid.shape[0]
    b = int(n ** 0.5)
    want = set(range(1, n + 1))
    boxes = [grid[r:r + b, c:c + b].ravel() for r in range(0, n, b) for c in range(0, n, b)]
    return all(set(line) == want for line in [*grid, *grid.T, *boxes])


@pytest.mark.parametrize("size", [4, 9])
def test_full_grids_are_valid(size):
    rng = np.random.default_rng(0)
    assert all(valid_grid(full_grid(rng, size)) for _ in range(20))


@pytest.mark.parametrize("size, difficulty, seeds", [(4, "easy", 20), (4, "hard", 20),
                                                     (9, "easy", 4), (9, "medium", 4)])
def test_generated_puzzles_have_one_solution(size, difficulty, seeds):
    removed = size * size - GIVENS[size][difficulty]
    for seed in range(seeds):
        puzzle, solution = generate(seed, size, removed)
        found = solutions(puzzle, limit=2)
        assert len(found) == 1 and (found[0] == solution).all() and valid_grid(solution)
        assert ((puzzle == 0) | (puzzle == solution)).all()
        # difficulty = cells removed; uniqueness may stop a hard 4x4 a cell or two short
        assert removed - 2 <= int((puzzle == 0).sum()) <= removed


def test_the_solver_sees_several_solutions_and_none():
    assert len(solutions(np.zeros((4, 4), np.int8), limit=5)) == 5
    broken = np.zeros((4, 4), np.int8)
    broken[0, :2] = 1
    assert solutions(broken) == []


def test_same_seed_same_puzzle():
    a, b = Sudoku(size=9, difficulty="medium"), Sudoku(size=9, difficulty="medium")
    assert a.reset(42) == b.reset(42) and a.reset(42) != a.reset(43)


@pytest.mark.parametrize("text, move", [
    ("place 5 at row 2 col 3", (1, 2, 5)),
    ("Place 5 at Row 2, column 3", (1, 2, 5)),
    ("2,3,5", (1, 2, 5)),
    (" 2 , 3 , 5 ", (1, 2, 5)),
    ("place 5 at row 2", None),
    ("place ５ at row 2 col 3", None),  # full-width digit
    ("place 55 at row 2 col 3", None),
    ("2,3", None),
    ("", None),
])
def test_parse_placement(text, move):
    assert parse_placement(text) == move


def _empty_cell(env):
    r, c = (int(x) for x in np.argwhere(env.board == 0)[0])
    return r, c


def test_rewards_on_hand_written_placements():
    env = Sudoku(size=4, difficulty="easy")
    env.reset(0)
    r, c = _empty_cell(env)
    right = int(env.solution[r, c])
    # invalid: unparsable, off the board, a given cell, a value breaking a rule
    given = [int(x) for x in np.argwhere(env.puzzle != 0)[0]]
    row_value = int(next(v for v in env.board[r] if v))
    for action in ["put it somewhere", "place 1 at row 9 col 1",
                   f"place 1 at row {given[0] + 1} col {given[1] + 1}",
                   f"place {row_value} at row {r + 1} col {c + 1}"]:
        text, reward, done, info = env.step(action)
        assert reward == pytest.approx(-0.1) and not info["action_is_effective"], action
        assert text.startswith("Invalid move") and not done
    _, reward, _, info = env.step(f"{r + 1},{c + 1},{right}")
    assert reward == 1.0 and info["action_is_effective"] and env.board[r, c] == right
    _, reward, _, _ = env.step(f"{r + 1},{c + 1},{right}")  # filled cells are final
    assert reward == pytest.approx(-0.1)


def test_legal_but_wrong_placement_earns_half():
    for seed in range(50):  # find an empty cell with a legal value other than the solution's
        env = Sudoku(size=4, difficulty="hard")
        env.reset(seed)
        for r, c in np.argwhere(env.board == 0):
            for v in range(1, 5):
                if v != env.solution[r, c] and not env.problem((r, c, v)):
                    _, reward, _, info = env.step(f"place {v} at row {r + 1} col {c + 1}")
                    assert reward == 0.5 and info["action_is_valid"] and not info["success"]
                    return
    pytest.fail("no legal wrong placement found")


def test_solving_pays_the_bonus_and_ends():
    env = Sudoku(size=4, difficulty="easy")
    env.reset(5)
    cells = [tuple(int(x) for x in rc) for rc in np.argwhere(env.board == 0)]
    rewards = []
    for r, c in cells:
        _, reward, done, info = env.step(f"place {env.solution[r, c]} at row {r + 1} col {c + 1}")
        rewards.append(reward)
    assert rewards == [1.0] * (len(cells) - 1) + [11.0] and done and info["success"]


def test_step_limit_truncates():
    env = Sudoku(size=4, max_steps=2)
    env.reset(0)
    assert env.step("nonsense")[2] is False
    _, _, done, info = env.step("nonsense")
    assert done and info["truncated"] and not info["success"]
