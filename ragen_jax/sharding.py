"""The device mesh: axes ``("data", "fsdp", "tensor")`` on 1 CPU, 8 simulated devices or a
pod. Parameters are placed by their NNX partition specs (``models.shard_model``); batches are
split over ``("data", "fsdp")``."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ragen_jax.config.fields import ConfigError

AXES = ("data", "fsdp", "tensor")


def make_mesh(shape: tuple[int, int, int] = (1, 1, 1), devices=None) -> Mesh:
    """A mesh of ``data x fsdp x tensor`` devices; ``-1`` in one axis takes the rest. A shape
    the devices cannot fill is a ``ConfigError`` naming the ``mesh.*`` fields (``config.mesh``
    is where a run's shape comes from)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    fields = "mesh.data x mesh.fsdp x mesh.tensor"
    if shape.count(-1) > 1:
        raise ConfigError(f"{fields}: at most one axis may be -1, got {tuple(shape)}")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        if known > len(devices) or len(devices) % known:
            given = " x ".join("?" if s == -1 else str(s) for s in shape)
            raise ConfigError(f"{fields} = {given}: the given axes ({known} devices) must divide "
                              f"the {len(devices)} devices available")
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ConfigError(f"{fields} = {' x '.join(map(str, shape))} needs "
                          f"{int(np.prod(shape))} devices, {len(devices)} are available")
    return Mesh(np.array(devices).reshape(shape), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``("data", "fsdp")``, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def shard_batch(batch, mesh: Mesh):
    """Places every array of a batch pytree with its leading axis over ``("data", "fsdp")``."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)
