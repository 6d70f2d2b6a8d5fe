"""GEM's envs through the host-env adapter (gem-llm, offline game suites): a GuessTheNumber
game played to a win and a loss, answers wrapped into GEM's \\boxed{} format, the same seed
giving the same level, level identity seeing the hidden number that the first observation
hides, and the refusal of seed-less reasoning-gym envs."""

from __future__ import annotations

import pytest

from ragen_jax.envs import make

pytest.importorskip("gem")

from ragen_jax.envs.gem_env import GemEnv  # noqa: E402 - after the skip

GUESS = "game:GuessTheNumber-v0-easy"  # a number in 1..10, 4 guesses


def hidden(env: GemEnv) -> int:
    return env.env.unwrapped.game_number


def test_a_game_is_won_by_bisection_and_lost_by_an_invalid_guess():
    family, params = make("gem", env_id=GUESS)
    assert params is None
    env = family.factory()
    text = env.reset(7)
    assert "guess the number between 1 and 10" in text and text.endswith("Enter your next guess.")
    low, high = 1, 10
    for _ in range(4):
        guess = (low + high) // 2
        text, reward, done, info = env.step(str(guess))  # wrapped into \boxed{guess}
        if guess == hidden(env):
            assert (reward, done, info["success"]) == (1.0, True, True)
            break
        assert (reward, done, info["success"]) == (0.0, False, False)
        low, high = (guess + 1, high) if "higher" in text else (low, guess - 1)
    else:
        pytest.fail("bisection did not find the number in 4 guesses")

    env.reset(7)
    _, reward, done, info = env.step("\\boxed{eleven}")  # already boxed: passed as written
    assert done and reward < 0 and not info["success"]


def test_level_identity_sees_the_hidden_number():
    env = GemEnv(GUESS)
    seen = {}
    for seed in range(40):
        first = env.reset(seed)
        seen.setdefault(hidden(env), set()).add((first, env.level_key()))
    assert len(seen) >= 5  # several hidden numbers over 40 seeds
    by_text = {}
    for number, pairs in seen.items():
        for first, _ in pairs:
            by_text.setdefault(first, set()).add(number)
    assert any(len(numbers) > 1 for numbers in by_text.values())  # the text hides the number
    keys = {n: {k for _, k in pairs} for n, pairs in seen.items()}
    assert all(len(k) == 1 for k in keys.values())  # one level per hidden number...
    assert len({next(iter(k)) for k in keys.values()}) == len(keys)  # ...and a key of its own
    env.reset(3)
    a = env.level_key()
    env.step("1")
    env.reset(3)
    assert env.level_key() == a  # the same seed, the same level, after play


def test_reasoning_gym_envs_are_refused():
    with pytest.raises(ValueError, match="ignore the reset seed"):
        GemEnv("rg:basic_arithmetic")
