"""Environments: pure-JAX text environments (gymnax style: Sokoban, FrozenLake, Bandit, 2048,
the 2x2 Rubik's cube) and
host environments (Python, free-text actions: Countdown, Sudoku, MetaMathQA, Search, any
Gymnasium env)."""

from ragen_jax.envs.bandit import Bandit
from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.countdown import Countdown
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.game2048 import Game2048
from ragen_jax.envs.gymnasium_env import GymnasiumEnv
from ragen_jax.envs.host import HostEnv, HostEnvFamily, HostState
from ragen_jax.envs.metamathqa import MetaMathQA
from ragen_jax.envs.registry import REGISTRY, make, register
from ragen_jax.envs.rubiks import RubiksCube
from ragen_jax.envs.search import Search
from ragen_jax.envs.sokoban import Sokoban
from ragen_jax.envs.sudoku import Sudoku

__all__ = ["REGISTRY", "Bandit", "Countdown", "FrozenLake", "Game2048", "GymnasiumEnv", "HostEnv",
           "HostEnvFamily", "HostState", "MetaMathQA", "RubiksCube", "Search", "Sokoban", "Sudoku",
           "TextEnv", "make", "register"]
