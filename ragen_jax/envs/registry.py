"""``make(name, **params)``: build an environment and its params by name.

A JAX env (a ``TextEnv`` class): keyword arguments are split by name: a field of the env's
params dataclass (dynamic values such as ``max_steps`` or reward sizes, traced under jit) goes
to the params, anything else (shapes, rendering choices) to the env's constructor. Equal
constructor settings give the same env object in a process (it holds no state: treat it as
read-only), so its jitted functions are traced and compiled once per process.

A host env (a ``HostEnv`` class, or any callable ``(**params) -> HostEnv`` given to
``register``): ``make`` returns ``(HostEnvFamily, None)``; ``parallel_friendly``,
``max_workers``, ``step_timeout``, ``isolation`` and ``memory_limit_mb`` are the family's
options, the other keywords go to the constructor, once per episode slot.

An unknown name or keyword is an error that names it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

from ragen_jax.envs.bandit import Bandit
from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.countdown import Countdown
from ragen_jax.envs.deepcoder import DeepCoder
from ragen_jax.envs.frozenlake import FrozenLake
from ragen_jax.envs.game2048 import Game2048
from ragen_jax.envs.gem_env import GemEnv
from ragen_jax.envs.host.env import HostEnv
from ragen_jax.envs.host.family import HostEnvFamily
from ragen_jax.envs.host.remote import RemoteEnv
from ragen_jax.envs.metamathqa import MetaMathQA
from ragen_jax.envs.rubiks import RubiksCube
from ragen_jax.envs.search import Search
from ragen_jax.envs.sokoban.env import Sokoban
from ragen_jax.envs.sudoku import Sudoku
from ragen_jax.envs.textworld_env import TextWorldEnv

REGISTRY: dict[str, type[TextEnv] | Callable[..., HostEnv]] = {
    "sokoban": Sokoban,
    "frozenlake": FrozenLake,
    "bandit": Bandit,
    "countdown": Countdown,
    "sudoku": Sudoku,
    "game2048": Game2048,
    "rubikscube": RubiksCube,
    "metamathqa": MetaMathQA,
    "search": Search,
    "deepcoder": DeepCoder,
    "gem": GemEnv,
    "textworld": TextWorldEnv,
    "remote": RemoteEnv,  # an env served by ``python -m ragen_jax.envs.host.serve``
}

HOST_OPTIONS = ("parallel_friendly", "max_workers", "step_timeout", "isolation", "memory_limit_mb")


def register(name: str, env: type[TextEnv] | Callable[..., HostEnv]) -> None:
    """Makes ``make(name, ...)`` build ``env``: a ``TextEnv`` class, a ``HostEnv`` class, or a
    callable returning a ``HostEnv`` (e.g. a ``GymnasiumEnv``). Re-registering replaces."""
    REGISTRY[name] = env


def make(name: str, **params: Any) -> tuple[TextEnv | HostEnvFamily, Any]:
    """Returns ``(env, env_params)`` for a registered env name (``env_params`` is None for a
    host env)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown env {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
        return _make_host(name, cls, params), None
    ctor_names = set(inspect.signature(cls.__init__).parameters) - {"self"}
    param_names = {f.name for f in dataclasses.fields(cls.params_cls)}
    unknown = set(params) - ctor_names - param_names
    if unknown:
        allowed = ", ".join(sorted(ctor_names | param_names))
        raise ValueError(f"env {name!r}: unknown parameter(s) {sorted(unknown)}; allowed: {allowed}")
    _check_ints(name, cls, params)
    env = _shared_env(cls, {k: v for k, v in params.items() if k in ctor_names})
    env_params = env.default_params.replace(
        **{k: v for k, v in params.items() if k in param_names and k not in ctor_names}
    )
    return env, env_params


_SHARED_ENVS: dict[tuple, TextEnv] = {}
_MAX_SHARED_ENVS = 32


def _shared_env(cls: type[TextEnv], kwargs: dict[str, Any]) -> TextEnv:
    """One ``cls(**kwargs)`` per class and settings in a process. A JAX env holds no state
    (its states and params are arguments of its pure functions), and the rollout's jitted env
    functions are cached per env object (``rollout.env_driver``): two runs, or a run and its
    evaluation, in one process then trace and compile an env's programs once. Settings that
    cannot be hashed build an env of their own."""
    key = (cls, tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return cls(**kwargs)
    if key not in _SHARED_ENVS:
        if len(_SHARED_ENVS) >= _MAX_SHARED_ENVS:  # the oldest goes (with its compiled programs)
            del _SHARED_ENVS[next(iter(_SHARED_ENVS))]
        _SHARED_ENVS[key] = cls(**kwargs)
    return _SHARED_ENVS[key]


def _frozen(value: Any) -> Any:
    """A key for ``value`` that tells types apart (``True``, ``1`` and ``1.0`` hash alike) and
    takes a list as its tuple (a config's ``dim_room=[6, 6]`` is ``(6, 6)``)."""
    if isinstance(value, list | tuple):
        return tuple, tuple(_frozen(v) for v in value)
    return type(value), value


def _check_ints(name: str, cls: type, params: dict[str, Any]) -> None:
    """Refuses a non-integer for a constructor parameter typed ``int`` (``size=1e6``, a float
    from the command line, reached numpy's allocator as a 7 TiB board)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # an annotation that names a type-checking-only import
        hints = {}
    for k, v in params.items():
        if hints.get(k) is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"env {name!r}: parameter {k} must be an int, got {v!r}")


def _make_host(name: str, factory: Callable[..., HostEnv], params: dict[str, Any]) -> HostEnvFamily:
    options = {k: params[k] for k in HOST_OPTIONS if k in params}
    kwargs = {k: v for k, v in params.items() if k not in HOST_OPTIONS}
    signature = inspect.signature(factory)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    unknown = set(kwargs) - set(signature.parameters)
    if unknown and not takes_any:
        allowed = ", ".join(sorted(set(signature.parameters) | set(HOST_OPTIONS)))
        raise ValueError(f"env {name!r}: unknown parameter(s) {sorted(unknown)}; allowed: {allowed}")
    return HostEnvFamily(functools.partial(factory, **kwargs) if kwargs else factory, **options)
