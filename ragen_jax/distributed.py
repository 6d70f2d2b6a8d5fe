"""Multi-process runs on JAX's own distributed runtime (``jax.distributed`` + a global mesh).

One process per host (or per GPU), each driving its local devices. Parameters and the update
batch live on the global mesh; rollouts are process-local: every process plays its share of
the env groups with a replica of the policy on its own devices, and feeds only its rows to the
update (``jax.make_array_from_process_local_data``). Small host values (group scores, metrics,
stop flags) are exchanged with ``multihost_utils.process_allgather`` (``allgather_rows``: many
per-row arrays in one collective; a training iteration's exchanges are listed in
``starpo.rows``). With one process every function here is the identity or the single-process
path.

Failure handling: a process that never joins, or one that dies mid-run, ends the others within
``distributed.initialization_timeout_s`` / ``heartbeat_timeout_s`` (JAX's coordination service
terminates them); the watchdog here only puts a clear line before JAX's own message.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ragen_jax.sharding import AXES


def initialize(d: Any) -> None:
    """``jax.distributed.initialize`` from ``config.distributed`` (no-op for one process, or
    when already initialized). Must run before anything starts JAX's backend (the first array
    or device query), so ``launch.py`` calls this before it imports the trainer.
    ``d`` is a checked ``DistributedConfig`` (its counts and ``process_id`` are checked there)."""
    if jax.distributed.is_initialized() or not d.enabled:
        return
    if jax.config.jax_platforms in (None, "", "cpu") and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process on CPU
    timeout = int(d.initialization_timeout_s)
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout):
            print(f"distributed: process {d.process_id}: the job did not assemble within "
                  f"{timeout} s ({d.num_processes} processes at {d.coordinator_address}); "
                  f"start every process with the same coordinator_address and num_processes",
                  file=sys.stderr, flush=True)
            os._exit(3)  # jax.process_index() is not available before the runtime is up

    threading.Thread(target=watchdog, daemon=True).start()
    auto = d.coordinator_address == "auto"  # TPU pods, SLURM, ...: JAX finds the cluster
    jax.distributed.initialize(coordinator_address=None if auto else d.coordinator_address,
                               num_processes=None if auto else d.num_processes,
                               process_id=None if auto else d.process_id,
                               initialization_timeout=timeout + 10,
                               heartbeat_timeout_seconds=int(d.heartbeat_timeout_s))
    done.set()


def abort(message: str, code: int = 1) -> None:
    """Ends this process at once with a one-line reason (a normal exit would wait on the
    runtime's shutdown barrier for processes that are gone)."""
    print(f"distributed: process {jax.process_index()}: {message}", file=sys.stderr, flush=True)
    os._exit(code)


def multiprocess() -> bool:
    return jax.process_count() > 1


def share(n: int, what: str = "items") -> slice:
    """This process's contiguous share of ``n`` items (``n`` must divide evenly)."""
    p, k = jax.process_index(), jax.process_count()
    if n % k:
        raise ValueError(f"{what}: {n} does not split evenly over {k} processes")
    return slice(p * n // k, (p + 1) * n // k)


def local_mesh(mesh: Mesh) -> Mesh:
    """The mesh of this process's devices (the whole ``mesh`` with one process): the data
    axis takes every local device the tensor axis leaves."""
    if not multiprocess():
        return mesh
    devices = jax.local_devices()
    tensor = mesh.shape["tensor"]
    if len(devices) % tensor:
        raise ValueError(f"mesh.tensor: {tensor} does not divide the {len(devices)} local devices")
    return Mesh(np.array(devices).reshape(len(devices) // tensor, 1, tensor), AXES)


def global_rows(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A global array whose leading axis (over ``("data", "fsdp")``) is the concatenation of
    every process's local rows ``x`` (processes in order)."""
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    if not multiprocess():
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def replicated(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """``x`` (the same on every process) as an array replicated on every device of ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec())
    if not multiprocess():
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def allgather(x: Any) -> np.ndarray:
    """Host values of every process, stacked on a new leading axis ``[P, ...]``."""
    x = np.asarray(x)
    if not multiprocess():
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x))


def allgather_rows(arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every process's per-row host values in one collective: each array's leading axis is
    this process's rows (as many on every process) and becomes every process's rows,
    processes in order; dtypes are kept. The values travel as one float64 array, exact for
    booleans, float32 and float64, and integers below 2**53."""
    arrays = {name: np.asarray(x) for name, x in arrays.items()}
    if not multiprocess():
        return arrays
    rows = next(iter(arrays.values())).shape[0]
    packed = np.concatenate([x.reshape(rows, -1).astype(np.float64) for x in arrays.values()], 1)
    every = allgather(packed)  # [P, rows, columns]
    out, at = {}, 0
    for name, x in arrays.items():
        columns = int(np.prod(x.shape[1:], dtype=np.int64))
        part = every[:, :, at:at + columns].astype(x.dtype)
        out[name] = part.reshape(-1, *x.shape[1:])
        at += columns
    return out


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-able ``obj``, in process order."""
    if not multiprocess():
        return [obj]
    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    sizes = allgather(np.int64(data.size))
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    return [json.loads(bytes(row[:n])) for row, n in zip(allgather(buf), sizes, strict=True)]


def mean_metrics(metrics: dict[str, float], summed: tuple[str, ...] = ()) -> dict[str, float]:
    """Each metric averaged over the processes that report it, or summed for the keys in
    ``summed`` (counts). Every process plays the same number of episodes, so per-episode
    means are exact; maxima become means of maxima."""
    if not multiprocess():
        return metrics
    merged: dict[str, list[float]] = {}
    for m in allgather_json({k: float(v) for k, v in metrics.items()}):
        for k, v in m.items():
            merged.setdefault(k, []).append(v)
    return {k: float(np.sum(v) if k in summed else np.mean(v)) for k, v in sorted(merged.items())}


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (e.g. a stop signal)."""
    return bool(allgather(np.bool_(flag)).any()) if multiprocess() else bool(flag)


def local_replica(model: nnx.Module, mesh: Mesh, local: Mesh) -> nnx.Module:
    """A copy of ``model`` (on the global ``mesh``) whose parameters live on this process's
    devices (``local``, from ``local_mesh``): the policy a process samples with. One all-gather
    per call; with one process, ``model`` itself."""
    if not multiprocess():
        return model
    from ragen_jax.models.placement import shard_model

    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    replicated = NamedSharding(mesh, PartitionSpec())
    full = jax.jit(lambda xs: xs, out_shardings=[replicated] * len(leaves))(leaves)
    copy = nnx.merge(graphdef, jax.tree.unflatten(treedef, [x.addressable_data(0) for x in full]))
    return shard_model(copy, local)


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Leaves not yet on ``mesh`` (an optimizer's step count lands on one device) replicated
    over it, so that every leaf is a global array (orbax saves those from every process)."""
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.Array) and x.sharding.device_set != devices:
            return jax.device_put(np.asarray(x), replicated)
        return x

    return jax.tree.map(place, tree)
