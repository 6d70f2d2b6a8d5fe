"""ragen_jax: multi-turn reinforcement learning for LLM reasoning agents (StarPO) in JAX."""

import os

# transformers prints "PyTorch was not found. Models won't be available..." when it is
# imported without PyTorch: ragen_jax uses only its tokenizers and configs (the models are
# JAX), so the notice is noise on every run. It is an advisory warning, and this variable
# hides those only (errors and real warnings still print); a user's own setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
