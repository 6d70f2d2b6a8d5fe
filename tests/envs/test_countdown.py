"""Countdown: generated puzzles are solvable (brute force), the puzzles played are those
RAGEN's filter picks, RAGEN's rewards on hand-written answers, determinism per seed,
file-backed puzzles."""

import itertools
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.envs.arithmetic import parse
from ragen_jax.envs.countdown import Countdown, Puzzle, generate, load_puzzles, score_answer

RAGEN_MAX_INSTANCES = 20_000  # RAGEN's CountdownEnvConfig.max_instances


def solvable(numbers, target) -> bool:
    """Brute force: combine any two remaining values with + - * / (both orders) until one is
    left, every number used once."""
    def search(values):
        if len(values) == 1:
            return values[0] == target
        for i, j in itertools.permutations(range(len(values)), 2):
            a, b = values[i], values[j]
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            results = [a + b, a - b, a * b] + ([a / b] if b else [])
            if any(search(rest + [r]) for r in results):
                return True
        return False
    return search([Fraction(n) for n in numbers])


def test_generated_puzzles_are_solvable_and_in_range():
    for seed in range(60):
        p = generate(seed)
        assert 3 <= len(p.numbers) <= 4 and all(1 <= n <= 99 for n in p.numbers)
        assert 1 <= p.target <= 100
        assert solvable(p.numbers, p.target), p
        expr = parse(p.solution)  # the construction's own expression reaches it too
        assert sorted(expr.numbers) == sorted(p.numbers) and expr.value == p.target


def ragen_has_solution(nums, target) -> bool:
    """RAGEN's ``has_solution``, written out: the numbers padded to four with zeros, then every
    choice of signs in ``+-n1 +-n2 +-n3 +-n4`` (only + and -)."""
    nums = list(nums) + [0] * (4 - len(nums))
    return any(sum(c[i] * nums[i] for i in range(4)) == target
               for c in itertools.product([1, -1], repeat=4))


def test_generated_puzzles_are_the_ones_ragens_filter_keeps():
    """Unfiltered, the generator makes puzzles that need * or / (about one in six); the env
    never plays one: every puzzle it picks passes RAGEN's filter."""
    raw = [generate(seed) for seed in range(200)]
    needs_more = [p for p in raw if not ragen_has_solution(p.numbers, p.target)]
    assert 10 < len(needs_more) < 100 and all(solvable(p.numbers, p.target) for p in needs_more)
    env = Countdown()
    picked = [env.puzzle_for(seed) for seed in range(200)]
    assert all(ragen_has_solution(p.numbers, p.target) for p in picked)
    kept = [s for s, p in enumerate(raw) if ragen_has_solution(p.numbers, p.target)]
    assert all(picked[s] == raw[s] for s in kept)  # a puzzle that passes is not redrawn
    assert Countdown(plus_minus_only=False).puzzle_for(7) == generate(7)


def test_file_puzzles_are_picked_as_ragen_picks_them(tmp_path):
    """RAGEN: the first 20,000 rows, those its ``has_solution`` keeps, then ``seed mod len``.
    The file has 20,050 rows: a third of the first 20,000 need * (``a * b + c``), and the 50
    after them are all +/- solvable (a reader past row 20,000 would play them)."""
    rows = []
    for i in range(RAGEN_MAX_INSTANCES + 50):
        a, b, c = 2 + i % 7, 3 + i % 5, 1 + i % 11
        if i >= RAGEN_MAX_INSTANCES:
            rows.append({"target": 1000 + i, "nums": [1000 + i, a, a]})
        elif i % 3 == 0:
            rows.append({"target": a * b + c, "nums": [a, b, c]})
        elif i % 2:
            rows.append({"target": a + b - c, "nums": [a, b, c]})
        else:
            rows.append({"target": a + b - c + i % 13, "nums": [a, b, c, i % 13]})
    path = tmp_path / "puzzles.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pool = [r for r in rows[:RAGEN_MAX_INSTANCES] if ragen_has_solution(r["nums"], r["target"])]
    assert 0 < len(pool) < RAGEN_MAX_INSTANCES
    assert any(not ragen_has_solution(r["nums"], r["target"]) and solvable(r["nums"], r["target"])
               for r in rows[:RAGEN_MAX_INSTANCES])  # the filter has something to drop
    env = Countdown(data_path=str(path))
    for seed in [*range(0, 3 * len(pool), 7), 10**9 + 3]:
        r = pool[seed % len(pool)]
        assert env.puzzle_for(seed) == Puzzle(r["target"], tuple(r["nums"])), seed
    assert len(set(map(env.puzzle_for, range(len(pool))))) == len({json.dumps(r) for r in pool})
    everything = Countdown(data_path=str(path), plus_minus_only=False, max_instances=0)
    assert everything.puzzle_for(RAGEN_MAX_INSTANCES + 1).target == 1000 + RAGEN_MAX_INSTANCES + 1
    short = tmp_path / "short.jsonl"  # fewer rows than 20,000: all of them, filtered
    short.write_text(json.dumps({"target": 7, "nums": [2, 3]}) + "\n"
                     + json.dumps({"target": 1, "nums": [2, 3]}) + "\n")
    assert [Countdown(data_path=str(short)).puzzle_for(s).target for s in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="solvable with \\+ and - alone"):
        Countdown(data_path=str(short), max_instances=1)


def test_same_seed_same_puzzle():
    assert generate(7) == generate(7)
    assert len({generate(s).numbers for s in range(20)}) > 15
    env_a, env_b = Countdown(), Countdown()
    assert env_a.reset(12345) == env_b.reset(12345)
    assert env_a.reset(12345).startswith("Target: ")


PUZZLE = Puzzle(24, (3, 5, 2, 8))


@pytest.mark.parametrize("answer, reward", [
    ("(3 + 5) * 2 + 8", 1.0),
    (" 8 + 2 * (5 + 3) ", 1.0),  # any order, spaces
    ("3 * 8 + 5 - 2", 0.1),  # right numbers, 27
    ("8 / 2 * (5 - 3)", 0.1),  # right numbers, 8
    ("(5 - 2) * 8", 0.0),  # 3 unused
    ("(3 + 5) * 2 + 8 + 0", 0.0),  # an extra number
    ("(3 + 3) * 2 + 8 + 5", 0.0),  # 3 twice
    ("(3 + 5) * 2 + 8 = 24", 0.0),  # not an expression
    ("", 0.0),
    ("three plus five", 0.0),
    ("(3 + 5 * 2 + 8", 0.0),
    ("3 ** 5 ** 2 ** 8", 0.0),  # a huge power: no value is computed
    ("9**9**9", 0.0),
    ("(３ + 5) * 2 + 8", 0.0),  # full-width digit
    ("(٣ + 5) * 2 + 8", 0.0),  # Arabic-Indic digit
    ("(" * 5000 + "3 + 5) * 2 + 8", 0.0),  # deep parentheses
    ("__import__('os').system('true')", 0.0),
])
def test_rewards_on_hand_written_answers(answer, reward):
    assert score_answer(answer, PUZZLE) == reward


def test_division_by_zero_with_the_right_numbers_is_a_wrong_value():
    """RAGEN checks the numbers first, then the value (its eval raising counts as wrong)."""
    assert score_answer("5 / (2 - 2)", Puzzle(10, (2, 2, 5))) == 0.1
    assert score_answer(None, PUZZLE) == 0.0  # type: ignore[arg-type]


def test_step_is_one_move_and_reports_success():
    env = Countdown()
    text = env.reset(3)
    p = env.puzzle
    assert text == f"Target: {p.target}, nums: {list(p.numbers)}"
    obs, reward, done, info = env.step(p.solution)
    assert (reward, done, info["success"]) == (1.0, True, True) and "1 points" in obs
    env.reset(3)
    _, reward, done, info = env.step("1 +")
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_random_actions_use_the_puzzles_numbers():
    env, rng = Countdown(), np.random.default_rng(0)
    for seed in range(20):
        env.reset(seed)
        action = env.random_action(rng)
        assert score_answer(action, env.puzzle) in (0.1, 1.0)


def test_puzzles_from_a_jsonl_file(tmp_path):
    path = tmp_path / "puzzles.jsonl"
    rows = [{"target": 6, "nums": [1, 2, 3]}, {"target": 3, "numbers": [2, 5]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_puzzles(path) == (Puzzle(6, (1, 2, 3)), Puzzle(3, (2, 5)))
    family, params = make("countdown", data_path=str(path))
    env = family.factory()
    assert params is None and env.reset(0) == "Target: 6, nums: [1, 2, 3]"
    assert env.reset(3) == "Target: 3, nums: [2, 5]"  # row seed mod len, as RAGEN
    assert env.step("5 - 2")[1] == 1.0
    path.write_text('{"target": 6}\n')
    with pytest.raises(ValueError, match="row 1"):
        make("countdown", data_path=str(path))


def _write_parquet(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def test_puzzles_from_a_parquet_file(tmp_path):
    """RAGEN's Countdown data is parquet (``target``, ``nums`` columns; extra columns ignored):
    read through pyarrow (the ``parquet`` extra) and played row ``seed mod len``."""
    path = tmp_path / "puzzles.parquet"
    _write_parquet(path, {"target": [6, 3], "nums": [[1, 2, 3], [2, 5]], "id": ["a", "b"]})
    assert load_puzzles(path) == (Puzzle(6, (1, 2, 3)), Puzzle(3, (2, 5)))
    family, _ = make("countdown", data_path=str(path))
    env = family.factory()
    assert env.reset(1) == "Target: 3, nums: [2, 5]"
    assert env.step("5 - 2")[1:3] == (1.0, True)
    assert env.reset(2) == "Target: 6, nums: [1, 2, 3]"
    assert env.step("3 * 2 * 1")[1] == 1.0
    numbers = tmp_path / "numbers.parquet"  # float targets that are integers, 'numbers' column
    _write_parquet(numbers, {"target": [6.0], "numbers": [[1, 2, 3]]})
    assert load_puzzles(numbers) == (Puzzle(6, (1, 2, 3)),)


@pytest.mark.parametrize("columns, message", [
    ({"target": [6, 7]}, "row 1: no 'nums'"),
    ({"nums": [[1, 2]]}, "row 1: no 'target'"),
    ({"target": [6, None], "nums": [[1, 2, 3], [2, 5]]}, "row 2: no 'target'"),
    ({"target": [6.5], "nums": [[1, 2, 3]]}, "row 1: 'target' must be an integer, got 6.5"),
    ({"target": [6], "nums": [["1", "x"]]}, "row 1: 'nums' must be a list of integers"),
    ({"target": [6], "nums": [[1.0, 2.5]]}, "row 1: 'nums' must be a list of integers"),
])
def test_a_malformed_parquet_file_is_a_one_line_error(tmp_path, columns, message):
    from ragen_jax.config.fields import ConfigError
    from ragen_jax.config.loading import from_config_dict
    from ragen_jax.train import build_envs

    path = tmp_path / "bad.parquet"
    _write_parquet(path, columns)
    with pytest.raises(ValueError) as e:
        load_puzzles(path)
    assert str(e.value).startswith(f"{path} {message}") and "\n" not in str(e.value)
    # As a run reports it (launch.py prints a ConfigError as its one line).
    from ragen_jax.config.loading import load_config

    config = Path(__file__).resolve().parents[2] / "configs/countdown.py"
    run = from_config_dict(load_config(["--config", str(config),
                                        f"--config.env.params.data_path={path}"]))
    with pytest.raises(ConfigError) as e:
        build_envs(run)
    assert str(e.value).startswith(f"env: {path} {message}") and "\n" not in str(e.value)


def test_a_file_that_is_not_parquet_and_a_missing_reader(tmp_path, monkeypatch):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"not parquet at all\n" * 10)
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable parquet file \(") as e:
        load_puzzles(path)
    assert "\n" not in str(e.value)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"target": 6, "nums": [1, 2, 3]}\n{"target": 6,\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2: not JSON"):
        load_puzzles(bad_json)
    other = tmp_path / "other.parquet"  # not read before: not in the reader's cache
    _write_parquet(other, {"target": [6], "nums": [[1, 2, 3]]})
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # not installed
    with pytest.raises(ImportError, match=r"needs pyarrow: pip install 'ragen_jax\[parquet\]'"):
        load_puzzles(other)
