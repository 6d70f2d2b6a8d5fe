"""TextWorld (``textworld`` on PyPI, Microsoft's text-adventure engine, ALFWorld's engine)
games as a host environment.

Each seed names a game that a TextWorld challenge (``tw-coin_collector``, ``tw-treasure_hunter``,
``tw-simple``, ``tw-cooking``) generates with that seed and the challenge's settings (the
constructor's extra keywords, checked by the challenge's own ``tw-make`` argument parser:
``level=5``, ``rewards="dense", goal="brief"``, ...). A game is generated and compiled (the
wheel's bundled Inform 7 tools, no download) once, into ``cache_dir`` (default: a folder in
the temp dir), and played from there afterwards by every process: generating one takes a
second or more, playing one milliseconds a command. ``num_games=N`` plays a fixed pool of N
games (seed ``s`` plays game ``s % N``, as RAGEN's ALFWorld picks ``game_files[seed % len]``),
so a run compiles at most N games; ``num_games=0`` gives every seed a game of its own.

Actions are free-text commands passed to the game's parser (``open chest``, ``go north``).
Each observation is the game's reply (the banner, the prompt and the status line removed)
followed by its admissible commands, as RAGEN's ALFWorld shows them (``show_commands``);
``random_action`` draws one of them (the format warm-start; never a walkthrough). The reward is
the change of the game's score (TextWorld's quest rewards: 1 for a coin collector's coin, one
point per sub-goal of ``tw-simple``'s dense rewards); ``info["success"]`` is TextWorld's
``won``; the episode ends when the game is won or lost, otherwise at the rollout's
``max_turn``. Interpreter commands that leave the game (``save``, which writes a file;
``restore``, ``restart``, ``quit``, ``script``) are refused without reaching it.

Level identity (held-out validation): a hash of the game's content (world, quests, names and
descriptions, objective), so two seeds that generate the same game are one level.

RAGEN has no plain TextWorld env; its ALFWorld env (``AlfredTXTEnv``) plays ALFWorld's
pre-made TextWorld games. Differences from it: games are generated from the seed rather than
read from ALFWorld's data; the reward is the score's change rather than 10 on a win (a
challenge's score reaches its maximum exactly when the game is won); ALFWorld's own wrappers
(its demangler and infos) are not used.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ragen_jax.envs.host.env import HostEnv

INSTRUCTION = ("You are playing a text adventure game. Each answer is one command for the game, "
               "e.g. <answer>open chest</answer> or <answer>go north</answer>; the game lists "
               "the commands it accepts after each observation.")
# Interpreter commands that act outside the game world: a command with any of these words is
# refused (``save`` writes a file in the working directory; ``restart``/``quit`` leave the game
# waiting for a yes or no; one line may hold several commands: ``look. save``).
REFUSED = frozenset({"save", "restore", "restart", "quit", "q", "script", "unscript",
                     "noscript", "transcript"})
_PROMPT = re.compile(r"^>", re.MULTILINE)  # the parser's prompt; the status line follows it
# The interpreter (jericho's dumb frotz) reads control characters as hot keys (recording or
# replaying input files), a backslash as the start of its own commands (``\help``), and hangs
# on a NUL; the games' words are ASCII. A command keeps printable ASCII but the backslash;
# anything else becomes a space.
_NOT_TYPED = re.compile(r"[^\x20-\x5b\x5d-\x7e]")
_LETTER = re.compile(r"[A-Za-z]")
_WORD = re.compile(r"[a-z]+")
_BLANK_LINES = re.compile(r"\n{3,}")


class _SettingsParser(argparse.ArgumentParser):
    """A challenge's ``tw-make`` parser whose errors are one-line exceptions, not exits."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def challenge_settings(challenge: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` completed with the challenge's defaults and checked by its own argument
    parser (names, types, choices, required ones): what its ``make`` reads."""
    import textworld.challenges

    if challenge not in textworld.challenges.CHALLENGES:
        raise ValueError(f"textworld: unknown challenge {challenge!r}; one of "
                         f"{', '.join(sorted(textworld.challenges.CHALLENGES))}")
    parser = _SettingsParser(prog=challenge, add_help=False, allow_abbrev=False)
    textworld.challenges.CHALLENGES[challenge][2](parser)
    argv: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    try:
        return vars(parser.parse_args(argv))
    except ValueError as e:
        raise ValueError(f"textworld {challenge}: {e}") from None


def clean(feedback: str) -> str:
    """The game's reply without TextWorld's banner (the leading lines with no letter), the
    parser's prompt and the status line printed after it, the interpreter's closing question
    ("Would you like to RESTART, ..."), indentation and runs of blank lines."""
    match = _PROMPT.search(feedback)
    lines = [line.strip() for line in (feedback[:match.start()] if match else feedback).split("\n")]
    while lines and not _LETTER.search(lines[0]):
        lines.pop(0)
    lines = [line for line in lines if not line.startswith("Would you like to RESTART")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def game_key(game_json: str) -> str:
    """A hash of a compiled game's content (its ``.json``: world, quests, entity names and
    descriptions, objective; not the seeds and settings in its metadata)."""
    with open(game_json) as f:
        data = json.load(f)
    core = {k: data.get(k) for k in ("world", "quests", "infos", "objective")}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def _slug(settings: Mapping[str, Any]) -> str:
    text = "-".join(f"{k}={settings[k]}" for k in sorted(settings)) or "default"
    return re.sub(r"[^A-Za-z0-9=._-]", "_", text)


@contextlib.contextmanager
def _quiet_interpreter() -> Iterator[None]:
    """Silences jericho's "not fully supported" warning on every game it loads: its own score
    and change detection are off for TextWorld's games, whose wrapper tracks the score."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        yield


def build_game(challenge: str, settings: Mapping[str, Any], game_seed: int, folder: str) -> str:
    """The path of the compiled game (``.z8``, its ``.json`` beside it) of ``game_seed``,
    generated and compiled into ``folder`` unless already there. Compiled in a private folder
    and moved in, json first, so that a ``.z8`` present is complete (processes share caches)."""
    path = os.path.join(folder, f"seed-{game_seed}.z8")
    if os.path.exists(path):
        return path
    import textworld
    import textworld.challenges

    os.makedirs(folder, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".build-", dir=folder)
    try:
        options = textworld.GameOptions()
        options.seeds = game_seed
        options.path = os.path.join(work, "game.z8")
        with _quiet_interpreter():  # making a game plays its walkthrough once, to check it
            game = textworld.challenges.CHALLENGES[challenge][1](dict(settings), options)
        built = textworld.generator.compile_game(game, options)
        os.replace(os.path.splitext(built)[0] + ".json", os.path.splitext(path)[0] + ".json")
        os.replace(built, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


class TextWorldEnv(HostEnv):
    """A TextWorld game per seed, played by free-text commands (see the module docstring)."""

    instruction = INSTRUCTION
    # jericho, the game interpreter, is a C library whose thread safety is not checked here:
    # instances step one at a time (worker processes still run side by side).
    parallel_friendly = False
    step_timeout = 120.0  # a reset may generate and compile a game (seconds on a busy CPU)

    def __init__(self, challenge: str = "tw-coin_collector", num_games: int = 0,
                 cache_dir: str = "", show_commands: bool = True, instruction: str = "",
                 **settings: Any):
        try:
            import textworld
        except ImportError:
            raise ImportError("TextWorld envs need textworld: pip install 'ragen_jax[textworld]'") from None
        if int(num_games) < 0:
            raise ValueError(f"textworld: num_games must be >= 0 (0: a game per seed), got {num_games!r}")
        self.challenge = challenge
        self.settings = challenge_settings(challenge, settings)
        self.num_games = int(num_games)
        self.folder = os.path.join(cache_dir or os.path.join(tempfile.gettempdir(), "ragen_jax_textworld"),
                                   f"textworld-{textworld.__version__}", challenge, _slug(self.settings))
        self.show_commands = bool(show_commands)
        if instruction:
            self.instruction = instruction
        self.infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, score=True)
        self.keys: dict[str, str] = {}  # game path -> level key
        self.env: Any = None  # TextWorld's environment of the game loaded
        self.game_file = ""
        self.commands: list[str] = []
        self.score = 0
        # Building a game now reports settings TextWorld checks only when it makes one (a
        # coin collector's level range) at construction, in one line, not at the first reset.
        try:
            self.game_path(0)
        except ValueError as e:
            raise ValueError(f"textworld {challenge}: {e}") from None

    @property
    def name(self) -> str:
        return "TextWorld"

    def game_path(self, seed: int) -> str:
        """The compiled game that ``seed`` plays (built on first use)."""
        game_seed = int(seed) % self.num_games if self.num_games else int(seed) % 2**32
        return build_game(self.challenge, self.settings, game_seed, self.folder)

    def _text(self, feedback: str, done: bool = False) -> str:
        text = clean(feedback)
        if self.show_commands and self.commands and not done:
            text += f"\n\nAdmissible actions: [{', '.join(self.commands)}]"  # RAGEN's ALFWorld format
        return text

    def reset(self, seed: int) -> str:
        import textworld

        path = self.game_path(seed)
        if path != self.game_file:
            if self.env is not None:
                self.env.close()
            with _quiet_interpreter():
                self.env = textworld.start(path, request_infos=self.infos)
            self.game_file = path
        state = self.env.reset()
        self.commands = list(state.admissible_commands or [])
        self.score = state.score or 0
        return self._text(state.feedback)

    def level_key(self) -> str | None:
        if not self.game_file:
            return None
        if self.game_file not in self.keys:
            self.keys[self.game_file] = game_key(os.path.splitext(self.game_file)[0] + ".json")
        return self.keys[self.game_file]

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.env is None:
            raise RuntimeError("step before reset")
        command = " ".join(_NOT_TYPED.sub(" ", action).split())
        valid = command.lower() in {c.lower() for c in self.commands}
        if not command or REFUSED & set(_WORD.findall(command.lower())):
            return (self._text(f"The command {command!r} is not available in this game."), 0.0, False,
                    {"success": False, "action_is_valid": False, "action_is_effective": False})
        state, _, done = self.env.step(command)
        reward = float((state.score or 0) - self.score)
        self.score = state.score or 0
        self.commands = list(state.admissible_commands or [])
        return self._text(state.feedback, bool(done)), reward, bool(done), {"success": bool(state.won), "action_is_valid": valid}

    def random_action(self, rng: np.random.Generator) -> str:
        """One of the game's admissible commands now, drawn at random."""
        return self.commands[int(rng.integers(len(self.commands)))] if self.commands else "look"
