"""Scanned layers and rematerialisation change how the no-cache forward runs, not what it
computes: logits and gradients equal the unrolled, non-rematerialised model's; the cached path
(sampling) is untouched; LoRA adapters ride along in the stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, compute_copy
from ragen_jax.models.copies import per_layer
from ragen_jax.models.lora import add_lora

CFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2)
B, T = 2, 12


def loss_and_grads(config: QwenConfig, lora: bool = False):
    model = Qwen2ForCausalLM(config, rngs=nnx.Rngs(0))
    if lora:
        add_lora(model, rank=2)
        # adapters start with B = 0; give them a value so their gradient path is exercised
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
            var.set_value(var[...] + 0.01)
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, config.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = jnp.arange(T)[None] < jnp.array([[T], [T - 3]])
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam if lora else nnx.Param, ...)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p, rest)(ids, pos, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * mask)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("scan,remat,lora", [(True, "none", False), (True, "full", False),
                                             (False, "dots", False), (True, "dots", True)])
def test_scan_and_remat_equal_the_unrolled_model(scan, remat, lora):
    ref_loss, ref_grads = loss_and_grads(CFG.replace(scan_layers=False, remat="none"), lora)
    got_loss, got_grads = loss_and_grads(CFG.replace(scan_layers=scan, remat=remat), lora)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads), strict=True):
        scale = float(jnp.max(jnp.abs(b)))  # float32 reassociation noise grows with it
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4 * max(scale, 1.0))


def test_scanned_forward_equals_the_cached_path():
    """The sampler's cached prefill gives the same logits as the scanned training forward."""
    model = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    full, _ = model(ids, pos)
    cached, _ = model(ids, pos, None, model.init_cache(B, T + 4))
    np.testing.assert_allclose(np.asarray(full), np.asarray(cached), atol=1e-5)


@pytest.mark.parametrize("cached", [False, True])
def test_per_layer_layout_equals_the_stacked_model(cached):
    """The sampler's layout (separate layers, a per-layer cache) computes what the stacked
    layers do, with and without a cache, and holds row i of every stacked variable."""
    model = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(0))
    split = per_layer(model)
    assert model.model.stacked and not split.model.stacked and len(split.model.layers) == CFG.num_hidden_layers
    np.testing.assert_array_equal(np.asarray(split.model.layers[1].mlp.up_proj.weight[...]),
                                  np.asarray(model.model.layers.mlp.up_proj.weight[...][1]))
    ids = jax.random.randint(jax.random.key(4), (B, T), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    if cached:
        a, cache_a = model(ids, pos, None, model.init_cache(B, T + 4))
        b, cache_b = split(ids, pos, None, split.init_cache(B, T + 4))
        assert isinstance(cache_b.k, tuple) and cache_a.k.shape == (CFG.num_hidden_layers, *cache_b.k[0].shape)
        np.testing.assert_allclose(np.asarray(cache_a.k), np.stack(cache_b.k), atol=1e-5)
    else:
        a, b = model(ids, pos)[0], split(ids, pos)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_bf16_compute_on_float32_storage_equals_a_bf16_copy():
    """Casting float32 master weights on the fly (training) and sampling from the stored bf16
    copy (``compute_copy``) compute the same thing."""
    config = CFG.replace(dtype=jnp.bfloat16)
    model = Qwen2ForCausalLM(config, rngs=nnx.Rngs(0))
    copy = compute_copy(model)
    assert copy is not model and copy.config.param_dtype == jnp.bfloat16
    assert not copy.model.stacked and compute_copy(copy) is copy  # nothing to cast or unstack
    ids = jax.random.randint(jax.random.key(3), (B, T), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    on_the_fly = per_layer(model)  # the same layer loop, float32 weights cast per use
    np.testing.assert_array_equal(np.asarray(on_the_fly(ids, pos)[0]), np.asarray(copy(ids, pos)[0]))
    with pytest.raises(ValueError, match="remat"):
        CFG.replace(remat="sometimes")
