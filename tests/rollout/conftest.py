"""Fixtures shared by the rollout tests: the built-in tokenizer and the default Sokoban."""

import pytest

from ragen_jax.envs import make
from ragen_jax.models import tokenizer as tk


@pytest.fixture(scope="module")
def tok():
    return tk.load(None)


@pytest.fixture(scope="module")
def sokoban():
    return make("sokoban")
