"""Placing a model on a ``jax.sharding.Mesh``: every parameter carries a partition spec as
metadata (``out_sharding``, names from ``sharding.py``'s mesh axes); these turn the specs into
``NamedSharding``s that fit a given mesh and put the weights there."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from ragen_jax.models.qwen import Qwen2ForCausalLM


def fit_spec(spec, shape, mesh: Mesh) -> PartitionSpec:
    """``spec`` restricted to ``mesh``: axes the mesh lacks, or that do not divide the
    dimension (e.g. 2 KV heads on a tensor axis of 4), are replaced by replication."""
    spec = tuple(spec) if spec is not None else ()
    out = []
    for dim, axis in zip(shape, spec + (None,) * (len(shape) - len(spec)), strict=False):
        names = axis if isinstance(axis, tuple) else (axis,) if axis else ()
        names = tuple(n for n in names if n in mesh.shape)
        size = math.prod(mesh.shape[n] for n in names)
        out.append(names if names and dim % size == 0 else None)
    out = [o[0] if isinstance(o, tuple) and len(o) == 1 else o for o in out]
    return PartitionSpec(*out)


def param_shardings(state, mesh: Mesh):
    """NamedShardings for an NNX state (concrete or abstract) from its ``out_sharding``."""

    def one(var):
        spec = var.get_metadata().get("out_sharding")
        return NamedSharding(mesh, fit_spec(spec, var.shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: Qwen2ForCausalLM, mesh: Mesh) -> Qwen2ForCausalLM:
    """Places every parameter of ``model`` on ``mesh`` following its partition spec (in place)."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    model.model.activation_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    values = jax.tree.map(
        lambda var, s: jax.device_put(var[...], s),
        state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    nnx.update(model, values)
    return model
