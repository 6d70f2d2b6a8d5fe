"""LoRA adapters on the Qwen2 linear layers: add, train alone, disable, merge for export.

``add_lora(model, rank, alpha)`` gives every targeted ``Linear`` two ``nnx.LoRAParam``
matrices, ``lora_a [r, in]`` (random) and ``lora_b [out, r]`` (zero, so the adapted model
starts equal to the base), stacked ``[L, ...]`` like the decoder layers' weights, and the
output gains ``alpha / r * x A^T B^T``. Train only the adapters by splitting the model with
the ``nnx.LoRAParam`` filter; the reference policy is the same model with the adapters zeroed
(``without_adapters``), as RAGEN uses the actor with adapters disabled; ``merge_lora`` folds
``B A`` into the base weights for export.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.qwen import Linear

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _targets(model: nnx.Module, target_modules: str | tuple[str, ...]):
    names = ALL_LINEAR if target_modules == "all-linear" else tuple(target_modules)
    unknown = set(names) - set(ALL_LINEAR)
    if unknown:
        raise ValueError(f"lora.target_modules: unknown {sorted(unknown)}; choose from {ALL_LINEAR}")
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[-1] in names:
            yield module


def add_lora(model: nnx.Module, rank: int, alpha: float = 64.0,
             target_modules: str | tuple[str, ...] = "all-linear", seed: int = 0) -> nnx.Module:
    """Adds adapters in place (RAGEN's defaults: ``alpha=64``, all linear layers)."""
    if rank < 1:
        raise ValueError(f"lora.rank must be >= 1, got {rank}")
    key = jax.random.key(seed)
    for i, linear in enumerate(list(_targets(model, target_modules))):
        *layers, out_dim, in_dim = linear.weight.shape  # layers: the stacked layer axis, [L]
        dtype = linear.weight[...].dtype
        spec = linear.weight.get_metadata().get("out_sharding") or (None,) * linear.weight.ndim
        *lead, out_spec, in_spec = spec
        if linear.transposed:  # weight [..., in, out]
            out_dim, in_dim, out_spec, in_spec = in_dim, out_dim, in_spec, out_spec
        a = jax.random.normal(jax.random.fold_in(key, i), (*layers, rank, in_dim), dtype)
        linear.lora_a = nnx.LoRAParam(a / jnp.sqrt(in_dim), out_sharding=(*lead, None, in_spec),
                                      eager_sharding=False)
        linear.lora_b = nnx.LoRAParam(jnp.zeros((*layers, out_dim, rank), dtype),
                                      out_sharding=(*lead, out_spec, None), eager_sharding=False)
        linear.lora_scale = float(alpha) / rank
    return model


def without_adapters(state: nnx.State) -> nnx.State:
    """A copy of a model state whose adapters contribute nothing (the reference policy)."""
    return jax.tree.map(lambda v: v.replace(jnp.zeros_like(v[...])) if isinstance(v, nnx.LoRAParam) else v,
                        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Folds every adapter into its base weight and turns it off (``lora_a = lora_b = None``,
    in place), so the model is a plain Qwen2 again: ``save_pretrained`` then exports the
    adapted policy."""
    for linear in list(_targets(model, "all-linear")):
        if linear.lora_a is None:
            continue
        delta = linear.lora_scale * (linear.lora_b[...] @ linear.lora_a[...])
        if linear.transposed:
            delta = jnp.swapaxes(delta, -1, -2)
        linear.weight[...] = (linear.weight[...] + delta).astype(linear.weight[...].dtype)
        linear.lora_a = linear.lora_b = None
        linear.lora_scale = 0.0
    return model
