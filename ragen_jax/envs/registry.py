"""``make(name, **params)``: build an environment and its params by name.

Keyword arguments are split by name: a field of the env's params dataclass (dynamic values
such as ``max_steps`` or reward sizes, traced under jit) goes to the params, anything else
(shapes, rendering choices) to the env's constructor. An unknown name is an error that names
it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from ragen_jax.envs.bandit import Bandit
from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.sokoban import Sokoban

REGISTRY: dict[str, type[TextEnv]] = {
    "sokoban": Sokoban,
    "frozenlake": FrozenLake,
    "bandit": Bandit,
}


def make(name: str, **params: Any) -> tuple[TextEnv, Any]:
    """Returns ``(env, env_params)`` for a registered env name."""
    if name not in REGISTRY:
        raise ValueError(f"unknown env {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    ctor_names = set(inspect.signature(cls.__init__).parameters) - {"self"}
    param_names = {f.name for f in dataclasses.fields(cls.params_cls)}
    unknown = set(params) - ctor_names - param_names
    if unknown:
        allowed = ", ".join(sorted(ctor_names | param_names))
        raise ValueError(f"env {name!r}: unknown parameter(s) {sorted(unknown)}; allowed: {allowed}")
    env = cls(**{k: v for k, v in params.items() if k in ctor_names})
    env_params = env.default_params.replace(
        **{k: v for k, v in params.items() if k in param_names and k not in ctor_names}
    )
    return env, env_params
