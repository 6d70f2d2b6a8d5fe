"""The decoder layers stored stacked, as MaxText does: one module whose every variable has a
leading layer axis ``L`` (see ``qwen.py``'s docstring), built from separate layers and taken
apart again, and one layer of it read inside a loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def stack_layers(layers: list[nnx.Module]) -> nnx.Module:
    """One module with the structure of ``layers[0]`` whose every variable stacks the layers'
    values on a new leading axis ``[L, ...]`` (partition spec: the layer axis unsharded).

    Used at construction, so a stacked model is initialised exactly as ``L`` separate
    layers built one after the other from the same ``rngs``."""
    graphdef = nnx.graphdef(layers[0])
    if any(nnx.graphdef(layer) != graphdef for layer in layers[1:]):
        raise ValueError("stack_layers: the layers differ in structure")
    states = [nnx.state(layer) for layer in layers]

    def stack(*vs):
        spec = vs[0].get_metadata().get("out_sharding")
        spec = None if spec is None else (None, *spec)
        return vs[0].replace(jnp.stack([v[...] for v in vs]), out_sharding=spec)

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_var))


def unstack_layers(stacked: nnx.Module, n: int) -> nnx.List:
    """The inverse of ``stack_layers``: ``n`` separate modules, row ``i`` of every variable
    (partition specs without the layer axis)."""
    graphdef, state = nnx.split(stacked)

    def row(i):
        def one(v):
            spec = v.get_metadata().get("out_sharding")
            return v.replace(v[...][i], out_sharding=None if spec is None else tuple(spec[1:]))

        return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=_is_var))

    return nnx.List([row(i) for i in range(n)])


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def layer_at(graphdef, state, i) -> nnx.Module:
    """Layer ``i`` (traced or static) of a stacked layer state, as a module. The index is a
    dynamic slice, which XLA reads in place inside a loop (a static slice may copy)."""
    return nnx.merge(graphdef, jax.tree.map(
        lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), state))
