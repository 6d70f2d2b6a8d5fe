"""TextWorld games through the host-env adapter (textworld, games generated and compiled
offline): a tw-simple game won by its walkthrough (the test's oracle, never the env's policy)
with the score's changes as rewards, the same seed giving the same game from separate caches,
level identity by the game's content, random actions drawn from the admissible commands,
interpreter commands refused and untypeable characters dropped, and one-line errors for bad
settings."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from ragen_jax.envs import make

pytest.importorskip("textworld", reason="needs textworld: pip install 'ragen_jax[textworld]'")

from textworld import Game  # noqa: E402 - after the skip

from ragen_jax.envs.textworld_env import TextWorldEnv, game_key  # noqa: E402

COINS = dict(challenge="tw-coin_collector", level=3)  # three rooms: go, go, take coin


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One game cache for the module: each game compiles once (a second or more)."""
    return str(tmp_path_factory.mktemp("textworld_games"))


def walkthrough(env: TextWorldEnv) -> list[str]:
    """The game's solution, read from its compiled ``.json`` (a test oracle only)."""
    return Game.load(os.path.splitext(env.game_file)[0] + ".json").walkthrough


def listed(text: str) -> list[str]:
    """The commands an observation lists as admissible."""
    match = re.search(r"Admissible actions: \[(.*)\]$", text)
    assert match, text
    return match.group(1).split(", ")


def test_a_simple_game_is_won_by_its_walkthrough_with_the_score_changes_as_rewards(cache):
    family, params = make("textworld", challenge="tw-simple", rewards="dense", goal="brief",
                          cache_dir=cache, isolation="thread")
    assert params is None and family.name == "TextWorld"
    env = family.factory()
    text = env.reset(11)
    assert text[0].isalpha() and "$$" not in text and ">" not in text  # no banner, prompt, status
    steps = walkthrough(env)
    max_score = Game.load(os.path.splitext(env.game_file)[0] + ".json").max_score
    assert len(steps) >= 5 and max_score >= 3  # dense rewards: points along the way
    rewards = []
    for n, command in enumerate(steps):
        text, reward, done, info = env.step(command)
        rewards.append(reward)
        assert info["action_is_valid"] and done == (n == len(steps) - 1), (n, command, text)
    assert info["success"] and sum(rewards) == max_score and sum(r > 0 for r in rewards) >= 3
    assert "Admissible actions" not in text and "RESTART" not in text

    env.reset(11)  # a fresh episode of the same game: the score starts again from 0
    _, reward, done, info = env.step(steps[0])
    assert reward == rewards[0] and not done and not info["success"]


def test_the_same_seed_gives_the_same_game_from_separate_caches(tmp_path):
    # Each constructor builds seed 0's game into its own cache (checking the settings).
    a = TextWorldEnv(**COINS, cache_dir=str(tmp_path / "a"))
    b = TextWorldEnv(**COINS, cache_dir=str(tmp_path / "b"))
    assert a.reset(0) == b.reset(0) and a.level_key() == b.level_key()
    assert walkthrough(a) == walkthrough(b)
    assert a.reset(1) != b.reset(0) and a.level_key() != b.level_key()
    # Built in private folders and moved in: nothing else is left in the cache.
    assert sorted(os.listdir(a.folder)) == ["seed-0.json", "seed-0.z8", "seed-1.json", "seed-1.z8"]


def test_level_identity_is_the_games_content(cache, tmp_path):
    env = TextWorldEnv(**COINS, num_games=4, cache_dir=cache)
    keys = {}
    for seed in range(8):
        first = env.reset(seed)
        keys.setdefault(seed % 4, set()).add((first, env.level_key()))
    assert all(len(pairs) == 1 for pairs in keys.values())  # seed s and s + 4: one game
    assert len({k for pairs in keys.values() for _, k in pairs}) == 4  # four games, four keys
    env.reset(2)
    key = env.level_key()
    env.step("go north")
    env.reset(2)
    assert env.level_key() == key  # after play, the same level

    # The seeds and settings in the game's metadata are not its identity; its content is.
    data = json.load(open(os.path.splitext(env.game_file)[0] + ".json"))
    data["metadata"] = {"seeds": "other"}
    (tmp_path / "m.json").write_text(json.dumps(data))
    assert game_key(str(tmp_path / "m.json")) == key
    data["objective"] = "Find the other coin."
    (tmp_path / "o.json").write_text(json.dumps(data))
    assert game_key(str(tmp_path / "o.json")) != key


def test_random_actions_are_admissible_commands(cache):
    env = TextWorldEnv(**COINS, num_games=4, cache_dir=cache)
    rng = np.random.default_rng(0)
    drawn = set()
    for seed in range(4):
        text = env.reset(seed)
        for _ in range(6):
            action = env.random_action(rng)
            assert action in listed(text)
            drawn.add(action.split()[0])
            text, _, done, info = env.step(action)
            assert info["action_is_valid"]
            if done:
                break
    assert {"go", "look", "inventory"} <= drawn  # drawn across the list, not one command


@pytest.mark.timeout(120)
def test_interpreter_commands_are_refused_and_untypeable_characters_dropped(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = TextWorldEnv(challenge="tw-coin_collector", level=1, num_games=4, cache_dir=cache)
    env.reset(0)
    for command in ("save", "look. save", "RESTART", "quit"):
        text, reward, done, info = env.step(command)
        assert "is not available in this game" in text and (reward, done) == (0.0, False)
        assert not info["action_is_valid"]
    assert os.listdir(tmp_path) == []  # ``save`` would have written a file here
    # A NUL hangs the interpreter, control characters are its hot keys, a backslash starts
    # its own commands: all become spaces (a hang fails this test by its timeout).
    for junk in ("\x00", "\x0e", "\x10", "\\help", "\u00e9"):
        text, _, done, _ = env.step(f"look{junk}")
        assert not done and "DUMB-FROTZ" not in text
    text, reward, done, info = env.step("take\x00\x0fcoin")  # read as "take coin"
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("params,message", [
    (dict(challenge="tw-nope"), "unknown challenge 'tw-nope'; one of tw-coin_collector"),
    (dict(challenge="tw-coin_collector"), "required: --level"),
    (dict(challenge="tw-coin_collector", level=0), r"level to be within \[1-300\]"),
    (dict(challenge="tw-coin_collector", level="abc"), "invalid int value: 'abc'"),
    (dict(challenge="tw-coin_collector", level=1, colour=2), "unrecognized arguments: --colour 2"),
    (dict(challenge="tw-simple", rewards="lots", goal="brief"), "invalid choice: 'lots'"),
    (dict(challenge="tw-coin_collector", level=1, num_games=-1), "num_games must be >= 0"),
])
def test_bad_settings_are_one_line_errors(params, message, cache):
    with pytest.raises(ValueError, match=message) as e:
        TextWorldEnv(cache_dir=cache, **params)
    assert "\n" not in str(e.value)
