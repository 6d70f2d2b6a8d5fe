"""Pure-JAX text environments (gymnax style): Sokoban, FrozenLake, Bandit."""

from ragen_jax.envs.bandit import Bandit
from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.registry import REGISTRY, make
from ragen_jax.envs.sokoban import Sokoban

__all__ = ["REGISTRY", "Bandit", "FrozenLake", "Sokoban", "TextEnv", "make"]
