"""Lets the env tests import single env modules while a sibling env module is still missing.

``ragen_jax/envs/__init__.py`` imports every env (Sokoban, FrozenLake, Bandit). On a branch
where one of them is not written yet, importing ``ragen_jax.envs.frozenlake`` would fail in the
package ``__init__``. In that case only, register ``ragen_jax.envs`` as a bare namespace (its
submodules import normally, its ``__init__`` is skipped). Once every module the ``__init__``
imports exists, this does nothing.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import ragen_jax

_ENVS_DIR = Path(ragen_jax.__file__).parent / "envs"
_NEEDED = ("base.py", "registry.py", "sokoban.py", "frozenlake.py", "bandit.py")

if "ragen_jax.envs" not in sys.modules and not all((_ENVS_DIR / f).exists() for f in _NEEDED):
    _pkg = types.ModuleType("ragen_jax.envs")
    _pkg.__path__ = [str(_ENVS_DIR)]
    _pkg.__package__ = "ragen_jax.envs"
    sys.modules["ragen_jax.envs"] = _pkg
    ragen_jax.envs = _pkg
