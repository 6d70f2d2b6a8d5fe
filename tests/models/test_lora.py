"""LoRA: starts as the base model, trains only adapters, merges exactly, exports."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, from_pretrained, save_pretrained
from ragen_jax.models.lora import add_lora, merge_lora, without_adapters

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)


def _inputs():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(10), (2, 10))


def test_lora_train_disable_merge_export(tmp_path):
    model = Qwen2ForCausalLM(QwenConfig.tiny(**CFG), rngs=nnx.Rngs(0))
    tokens, pos = _inputs()
    base_logits, _ = model(tokens, pos)
    add_lora(model, rank=4, alpha=8.0)
    adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    assert len(adapters) == 2 * 7  # A and B of 7 linear layers, each stacked over the 2 layers
    assert all(a.shape[0] == 2 and 4 in a.shape[1:] for a in adapters)
    np.testing.assert_array_equal(np.asarray(model(tokens, pos)[0]), np.asarray(base_logits))

    # A few steps on adapters only: base weights stay, adapters move, logits change.
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    base_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))

    def loss_fn(lora):
        logits, _ = nnx.merge(graphdef, lora, rest)(tokens, pos)
        return -jax.nn.log_softmax(logits)[..., 7].mean()

    tx = optax.adam(1e-2)
    opt = tx.init(lora)
    grad_fn = jax.jit(jax.grad(loss_fn))  # one program for the three steps
    for _ in range(3):
        grads = grad_fn(lora)
        updates, opt = tx.update(grads, opt, lora)
        lora = optax.apply_updates(lora, updates)
    nnx.update(model, lora)
    base_after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after), strict=True):
        np.testing.assert_array_equal(a, b)
    adapted, _ = model(tokens, pos)
    assert float(jnp.abs(adapted - base_logits).max()) > 1e-3

    # Reference policy: adapters disabled gives the base logits again.
    reference = nnx.merge(*nnx.split(model)[:1], without_adapters(nnx.state(model)))
    np.testing.assert_allclose(np.asarray(reference(tokens, pos)[0]), np.asarray(base_logits), atol=1e-6)

    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(model, tmp_path / "unmerged")
    merge_lora(model)
    assert not jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    np.testing.assert_allclose(np.asarray(model(tokens, pos)[0]), np.asarray(adapted), atol=1e-5)
    save_pretrained(model, tmp_path / "merged")
    reloaded = from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(np.asarray(reloaded(tokens, pos)[0]), np.asarray(adapted), atol=1e-5)


def test_bad_lora_settings():
    model = Qwen2ForCausalLM(QwenConfig.tiny(**CFG), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lora.rank"):
        add_lora(model, rank=0)
    with pytest.raises(ValueError, match="lora.target_modules"):
        add_lora(model, rank=2, target_modules=("qkv",))
    add_lora(model, rank=2, target_modules=("q_proj", "v_proj"))
    assert len(jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) == 2 * 2  # A, B of q and v
