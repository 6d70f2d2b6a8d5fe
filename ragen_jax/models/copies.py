"""The copies of a Qwen2 model that the sampler computes with (the trainer keeps the original).

``compute_copy`` makes it: the weights in the compute dtype, the decoder layers as separate
modules (``per_layer``: XLA:CPU reads a layer's weights in place only when they are separate
arrays, see ``qwen.py``'s docstring) and, on the CPU, the ``decode_layout``. Each is a new
module sharing nothing mutable with the original, so training steps never see it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.qwen import Linear, Qwen2ForCausalLM, output_head, unstack_layers


def per_layer(model: nnx.Module) -> nnx.Module:
    """``model`` with its decoder layers as separate modules (``nnx.List``), as a new module
    sharing nothing mutable; ``model`` itself if they already are. Why: ``qwen.py``'s module
    docstring. Its caches are tuples per layer (``init_cache``)."""
    if not model.model.stacked:
        return model
    copy = nnx.merge(*nnx.split(model))
    copy.model.layers = unstack_layers(copy.model.layers, model.config.num_hidden_layers)
    return copy


def _swapped(var: nnx.Variable) -> nnx.Param:
    """``var`` with its last two axes (and their partition spec) swapped."""
    meta = dict(var.get_metadata())
    spec = meta.get("out_sharding")
    if spec is not None and len(spec) >= 2:
        meta["out_sharding"] = (*spec[:-2], spec[-1], spec[-2])
    return nnx.Param(jnp.swapaxes(var[...], -1, -2), **meta)


def decode_layout_by_default() -> bool:
    """Whether a sampling copy takes the ``decode_layout`` when nobody says: on the CPU."""
    return jax.default_backend() == "cpu"


def in_decode_layout(model: nnx.Module) -> bool:
    """Whether ``model`` is already in the ``decode_layout``."""
    head = getattr(model, "lm_head", None)
    return isinstance(head, Linear) and head.transposed


def decode_layout(model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    """``model`` in the CPU decoding layout, as a new module sharing nothing mutable: every
    ``Linear`` weight stored ``[in, out]`` (``transposed``), and a tied output head copied into
    its own transposed ``lm_head`` (``embed_tokens.weight.T``; one more ``[E, V]`` array).

    Why: XLA:CPU runs few-row matmuls (``[B, E] x [E, F]``, B of 8-32) below the memory
    bandwidth in the Hugging Face ``[out, in]`` layout: on the 0.5B shape a batch-8 decode step
    took 72 ms in this layout against 102 ms (the same at batch 1, 45 vs 43 ms; one probe,
    2026-11-27, XLA's default options; ``experiments/benchmarks/bench_peers.py`` compares whole calls).
    Logits equal the original layout's up to float
    rounding. A copy to compute with, not to save (its tied head is untied)."""
    copy = nnx.merge(*nnx.split(model))
    for _, module in copy.iter_modules():
        if isinstance(module, Linear) and not module.transposed:
            module.weight = _swapped(module.weight)
            module.transposed = True
    if copy.lm_head is None:
        head = nnx.eval_shape(lambda: output_head(copy.config, rngs=nnx.Rngs(0)))
        head.weight = _swapped(copy.model.embed_tokens.weight)
        head.transposed = True
        copy.lm_head = nnx.data(head)  # was a static None
    return copy


def compute_copy(model: nnx.Module, *, layout: bool | None = None) -> nnx.Module:
    """The sampler's copy of ``model``: its floating-point variables in the compute dtype
    (``config.dtype``) and its layers ``per_layer``, as a new module sharing nothing mutable
    (``model`` itself when it already is both and needs no new layout). Decoding is bound by
    reading the weights, so float32 master weights cast on every step would read twice the
    bytes. With ``layout`` (default: when JAX's backend is the CPU) the copy is also in the
    ``decode_layout``."""
    dtype = model.config.dtype
    if jnp.dtype(model.config.param_dtype) != jnp.dtype(dtype):
        graphdef, state = nnx.split(model)
        state = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
        cast = nnx.merge(graphdef, state)
        cast.config = cast.model.config = model.config.replace(param_dtype=dtype)
        model = cast
    model = per_layer(model)
    if layout is None:
        layout = decode_layout_by_default()
    if layout and isinstance(model, Qwen2ForCausalLM) and not in_decode_layout(model):
        model = decode_layout(model)
    return model
