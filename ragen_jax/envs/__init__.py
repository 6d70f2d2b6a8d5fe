"""Environments: pure-JAX text environments (gymnax style: Sokoban, FrozenLake, Bandit) and
host environments (Python, free-text actions: Countdown, Sudoku, any Gymnasium env)."""

from ragen_jax.envs.bandit import Bandit
from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.countdown import Countdown
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.gymnasium_env import GymnasiumEnv
from ragen_jax.envs.host import HostEnv, HostEnvFamily, HostState
from ragen_jax.envs.registry import REGISTRY, make, register
from ragen_jax.envs.sokoban import Sokoban
from ragen_jax.envs.sudoku import Sudoku

__all__ = ["REGISTRY", "Bandit", "Countdown", "FrozenLake", "GymnasiumEnv", "HostEnv",
           "HostEnvFamily", "HostState", "Sokoban", "Sudoku", "TextEnv", "make", "register"]
