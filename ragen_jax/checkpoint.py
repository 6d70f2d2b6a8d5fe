"""Training checkpoints with orbax: named items of arrays, plus a small JSON of host state.

A checkpoint is one orbax step folder holding one item per named pytree (the trainer saves
``actor``: the actor's trained variables, and ``state``: the rest of the ``TrainState``),
each stored as a flat dict keyed by pytree path names, so a mismatch names the field, and
``meta`` (JSON: step, data counters, early-stopping state). ``restore`` reads the items it
is given, into their structure and shardings (a run resumed on a different mesh places each
array on its shard; export restores the actor alone). The last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def _flat(tree: Any) -> tuple[dict[str, Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {jax.tree_util.keystr(path) or "value": leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("checkpoint: two leaves of the training state share a path name")
    return flat, treedef


class CheckpointStore:
    """``save(step, items, meta)``, ``latest_step()``, ``restore(step, like)`` under ``path``."""

    def __init__(self, path: str | os.PathLike, keep: int = 3):
        self.path = Path(path).absolute()
        self.manager = ocp.CheckpointManager(
            self.path, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, items: dict[str, Any], meta: dict[str, Any]) -> None:
        """Writes the checkpoint of ``step`` (``items``: name -> pytree of arrays) and waits
        until it is on disk."""
        args = {name: ocp.args.StandardSave(_flat(tree)[0]) for name, tree in items.items()}
        self.manager.save(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta)),
                          force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The items named in ``like`` saved at ``step``, each in the structure (and
        shardings) of ``like[name]`` (arrays or ``ShapeDtypeStruct``), and the meta JSON."""
        flats = {name: _flat(tree) for name, tree in like.items()}
        args = {name: ocp.args.StandardRestore({k: _abstract(v) for k, v in flat.items()})
                for name, (flat, _) in flats.items()}
        out = self.manager.restore(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonRestore()))
        restored = {}
        for name, (flat, treedef) in flats.items():
            arrays = out[name]
            missing = sorted(set(flat) - set(arrays))
            if missing:
                raise ValueError(f"checkpoint {self.path}/{step}: {name} lacks {missing[:3]}")
            restored[name] = jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in flat])
        return restored, dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


def abstract(tree: Any) -> Any:
    """``tree`` with each array replaced by its shape, dtype and sharding: a restore target
    that holds no device memory, so the arrays it was made from can be freed first."""
    return jax.tree.map(_abstract, tree)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
