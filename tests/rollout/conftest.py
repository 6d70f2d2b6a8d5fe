"""Fixtures shared by the rollout tests: the built-in tokenizer, the default Sokoban and a
tiny random model with sharp logits."""

import pytest
from flax import nnx

from ragen_jax.envs import make
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.models import tokenizer as tk

TINY = QwenConfig.tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tok():
    return tk.load(None)


@pytest.fixture(scope="module")
def sokoban():
    return make("sokoban")


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random model on the built-in vocabulary, its head scaled up: sharper logits,
    fewer near-ties in greedy comparisons."""
    m = Qwen2ForCausalLM(TINY, rngs=nnx.Rngs(0))
    head = m.lm_head.weight
    head[...] = head[...] * 10.0
    return m
