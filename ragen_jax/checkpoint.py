"""Training checkpoints with orbax: arrays by name, plus a small JSON of host-side state.

A checkpoint is one orbax step folder holding ``arrays`` (every leaf of the training state:
actor and critic parameters, optimizer states, stored under their pytree path names, so a
mismatch names the field) and ``meta`` (JSON: step, data counters, early-stopping state).
``restore`` reads into the live state's structure and shardings, so a run resumed on a
different mesh places each array on its shard. The last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def _flat(tree: Any) -> tuple[dict[str, Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {jax.tree_util.keystr(path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("checkpoint: two leaves of the training state share a path name")
    return flat, treedef


class CheckpointStore:
    """``save(step, state, meta)``, ``latest_step()``, ``restore(step, like)`` under ``path``."""

    def __init__(self, path: str | os.PathLike, keep: int = 3):
        self.path = Path(path).absolute()
        self.manager = ocp.CheckpointManager(
            self.path, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Writes the checkpoint of ``step`` and waits until it is on disk."""
        flat, _ = _flat(state)
        self.manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """The state saved at ``step``, in the structure (and shardings) of ``like``."""
        flat, treedef = _flat(like)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
                    for k, v in flat.items()}
        out = self.manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        arrays = out["arrays"]
        missing = sorted(set(abstract) - set(arrays))
        if missing:
            raise ValueError(f"checkpoint {self.path}/{step}: missing {missing[:3]}")
        return jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in flat]), dict(out["meta"])

    def close(self) -> None:
        self.manager.close()
