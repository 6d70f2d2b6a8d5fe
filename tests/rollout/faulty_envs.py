"""Host envs with real faults (and ``Rooms``, whose levels come in rooms), importable by name so
worker processes can build them.

``Faulty`` plays a seed and obeys its action: ``win`` ends the episode won, ``go`` pays 1 and
goes on, ``pause`` takes 0.3 s and goes on, ``sleep`` never returns, ``regex`` spins in C holding the GIL (catastrophic
backtracking), ``segv`` dereferences NULL, ``abort`` calls ``os.abort()``, ``leak`` allocates
until it cannot, ``boom`` raises.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from pathlib import Path

from ragen_jax.envs.countdown import Countdown
from ragen_jax.envs.host.env import HostEnv

_BACKTRACK = re.compile(r"(a+)+$")


def fault(action: str) -> None:
    """Runs the fault ``action`` names (nothing for an ordinary action)."""
    if action == "pause":
        time.sleep(0.3)
    elif action == "sleep":
        threading.Event().wait()
    elif action == "regex":
        _BACKTRACK.match("a" * 64 + "b")
    elif action == "segv":
        ctypes.string_at(0)
    elif action == "abort":
        os.abort()
    elif action == "leak":
        hoard = []
        while True:
            hoard.append(bytearray(16 * 2**20))
    elif action == "boom":
        raise ValueError("boom")


class Faulty(HostEnv):
    instruction = "Say win."

    def reset(self, seed):
        self.seed, self.moves = seed, 0
        return f"seed {seed}"

    def step(self, action):
        fault(action)
        self.moves += 1
        done = action == "win"
        return f"seed {self.seed} move {self.moves} {action}", 1.0, done, {"success": done}


class SlowBuild(Faulty):
    """Its constructor hangs while the file ``flag`` exists."""

    def __init__(self, flag: str):
        while Path(flag).exists():
            time.sleep(0.01)


class HangingCountdown(Countdown):
    """Countdown whose reset never returns (a random micro model rarely answers in format,
    so a hang in ``step`` would seldom be reached)."""

    def reset(self, seed):
        threading.Event().wait()


class Slow(Faulty):
    """``slow`` takes 3 s to answer."""

    def step(self, action):
        if action == "slow":
            time.sleep(3.0)
        return super().step(action)


class Rooms(HostEnv):
    """Level ``seed``, in room ``seed % 5``: a held-out room keeps its every level out."""

    def reset(self, seed):
        self.seed = seed
        return f"level {seed}"

    def step(self, action):
        return f"level {self.seed}", 0.0, True, {"success": False}

    def holdout_key(self):
        return f"room {self.seed % 5}"

