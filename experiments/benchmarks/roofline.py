"""A machine's ceilings and a workload's least cost, the bounds the benchmarks compare with.

The ceilings are measured (a jitted matmul's FLOP/s, a jitted sum's bytes/s); the costs are
counted from a model's shapes (the FLOPs of a greedy call, the bytes a decode step reads).
JAX is imported inside the functions: ``peers_tunix`` runs under another venv's JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from experiments.common import timed

if TYPE_CHECKING:
    from ragen_jax.models import QwenConfig


def matmul_peak(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """GFLOP/s of a jitted ``n^3`` matmul in ``dtype`` (best of ``repeats``): the roofline."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.RandomState(0).randn(n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    return 2 * n**3 / timed(lambda: dot(a, a).block_until_ready(), repeats) / 1e9


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a jitted sum over a ``gib`` GiB float32 array (best of ``repeats``): the rate
    at which a decode step can read weights and cache, the bound decode is measured against."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    return x.size * 4 / timed(lambda: total(x).block_until_ready(), repeats) / 1e9


def memory_reading(compiled: Any) -> tuple[float, str]:
    """(GiB, source) of a compiled step's peak: the device's allocator peak where the backend
    reports one, else XLA's memory analysis (arguments + outputs + temporaries - aliased)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "memory_stats peak"
    m = compiled.memory_analysis()
    live = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)
    return live / 2**30, "XLA memory_analysis"


def work_gflop(cfg: QwenConfig, batch: int, prompt: int, new: int) -> float:
    """The least float32 work (GFLOP) of one greedy call: ``prompt + new - 1`` tokens per row
    through the decoder (the last sampled token is never fed back), causal attention over
    each token's real context, logits at the ``new`` sampling positions."""
    e, h, k, d, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim, cfg.intermediate_size)
    per_token = 2 * cfg.num_hidden_layers * (e * h * d + 2 * e * k * d + h * d * e + 3 * e * f)
    tokens = prompt + new - 1
    context = tokens * (tokens + 1) // 2  # sum over tokens of the keys each attends to
    attention = 2 * 2 * cfg.num_hidden_layers * h * d * context  # q.k and p.v
    head = 2 * e * cfg.vocab_size * new
    return batch * (per_token * tokens + attention + head) / 1e9


def decode_bytes(cfg: QwenConfig, params_bytes: int, batch: int, slots: int) -> int:
    """Bytes a float32 decode step must read at least: every weight once, and the keys and
    values of the ``slots`` cache slots it attends over, for every row."""
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    return params_bytes + kv * batch * slots


def decode_step_bytes(policy: Any, cfg: QwenConfig, batch: int, slots: int) -> int:
    """The bytes a decode step reads at the least: every weight of the sampler's copy once,
    and the keys and values of ``slots`` cache slots of each of ``batch`` rows, in the cache's
    dtype (``cfg.dtype``)."""
    import jax
    from flax import nnx

    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(policy)))
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    return weights + kv * batch * slots
