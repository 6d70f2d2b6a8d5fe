"""ragen_jax: multi-turn reinforcement learning for LLM reasoning agents (StarPO) in JAX."""

__version__ = "0.1.0"
