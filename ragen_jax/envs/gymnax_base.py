"""gymnax's two base modules, ``environment`` (the ``Environment`` class every JAX env here
subclasses) and ``spaces``, without the rest of gymnax.

``import gymnax.environments.spaces`` runs gymnax's package ``__init__`` files first, and they
import every gymnax environment, and with them seaborn, scipy.stats, pandas and matplotlib:
about 4 CPU-seconds in every process that imports an env here (the trainer, each env server,
each ``launch.py``), for two modules that import nothing of gymnax. So the two files are
loaded from gymnax's installed package under their own names, ``gymnax.environments.environment``
and ``gymnax.environments.spaces``. A later ``import gymnax`` (a user's gymnax wrappers) runs
gymnax's ``__init__`` files as usual, and they find these same module objects in
``sys.modules``: ``isinstance(env, gymnax.environments.environment.Environment)`` holds for
our envs either way. (One difference remains when ragen_jax's envs were imported first: the
attribute chain ``gymnax.environments.spaces`` is not set by gymnax's ``__init__``; ``from
gymnax.environments import spaces`` works as ever.)
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def _load(name: str) -> ModuleType:
    """The module ``gymnax.environments.<name>``: the one already imported, or its file run
    alone."""
    full = f"gymnax.environments.{name}"
    if full in sys.modules:
        return sys.modules[full]
    package = importlib.util.find_spec("gymnax")  # finds the folder; runs no gymnax code
    if package is None or not package.submodule_search_locations:
        raise ImportError("gymnax is not installed (pip install gymnax)")
    path = f"{list(package.submodule_search_locations)[0]}/environments/{name}.py"
    spec = importlib.util.spec_from_file_location(full, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    return module


environment = _load("environment")
spaces = _load("spaces")
