"""The model shapes and random training batches the benchmarks build.

``model_config`` names Qwen2.5's shapes (``tiny``, ``0.5b`` .. ``7b``; Hugging Face
``config.json`` values), ``accelerator_config`` the same in bf16 compute with the real
vocabulary (and a ``smoke`` shape for a CPU check), ``train_batch`` a random ``TrainBatch``
or, given a sharding, its abstract shapes for compile-only runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragen_jax.models import QwenConfig
    from ragen_jax.starpo.optimizer_step import TrainBatch

SHAPES = {  # Hugging Face Qwen2.5-*-Instruct config.json values (0.5B: QwenConfig's preset)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
}
SMOKE = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # a check
GiB = 2**30


def model_config(name: str, **kw: Any) -> QwenConfig:
    """The QwenConfig of a benchmark model: ``tiny``, ``0.5b``, ``1.5b``, ``3b`` or ``7b`` shapes."""
    from ragen_jax.models import QwenConfig

    if name == "tiny":
        return QwenConfig.tiny(**kw)
    if name == "0.5b":
        return QwenConfig.qwen2_5_0_5b(**kw)
    return QwenConfig.tiny(**SHAPES[name], rope_theta=1e6, **kw)


def accelerator_config(size: str, remat: str) -> QwenConfig:
    """Qwen2.5's shapes (real vocabulary) for ``size`` in 0.5b, 1.5b, 3b, 7b, smoke; bf16 compute."""
    import jax.numpy as jnp

    from ragen_jax.models import QwenConfig

    kw = dict(dtype=jnp.bfloat16, remat=remat)
    if size == "smoke":
        return QwenConfig(rope_theta=1e6, rms_norm_eps=1e-6, **SMOKE, **kw)
    return model_config(size, **kw)


def train_batch(batch: int, length: int, vocab: int, sharding: Any = None) -> TrainBatch:
    """A random ``batch x length`` TrainBatch, or with ``sharding`` its abstract shapes placed
    by it (nothing allocated: for compile-only runs)."""
    import jax
    import jax.numpy as jnp

    from ragen_jax.starpo.optimizer_step import TrainBatch

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if sharding is not None:  # abstract, for compile-only runs
        f = jnp.float32
        return TrainBatch(arr((batch, length), jnp.int32), arr((batch, length), bool),
                          arr((batch, length), jnp.int32), arr((batch, length), f),
                          arr((batch, length), f), arr((batch, length), f), arr((batch, length), f))
    key = jax.random.key(0)
    ids = jax.random.randint(key, (batch, length), 0, vocab)
    ones = jnp.ones((batch, length), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    adv = jax.random.normal(key, (batch, length))
    return TrainBatch(ids, jnp.ones((batch, length), bool), pos, ones, -ones, adv, -ones)


def peer_config(size: str, big_vocab: int) -> QwenConfig:
    """``bench_peers``' shapes: ``tiny``, or Qwen2.5-0.5B's layers with a ``big_vocab``-token
    vocabulary."""
    from ragen_jax.models import QwenConfig

    if size == "tiny":
        return QwenConfig.tiny()
    return QwenConfig.qwen2_5_0_5b(vocab_size=big_vocab)
