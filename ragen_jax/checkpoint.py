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
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

GIB = 2**30


def size_text(n: int) -> str:
    """``n`` bytes in GiB, or in MiB below a tenth of one (a tiny model's checkpoint)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost mount); the message says which
    step, why, and which complete checkpoint a rerun resumes from."""


def _flat(tree: Any) -> tuple[dict[str, Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {jax.tree_util.keystr(path) or "value": leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("checkpoint: two leaves of the training state share a path name")
    return flat, treedef


class CheckpointStore:
    """``save(step, items, meta)``, ``latest_step()``, ``restore(step, like)`` under ``path``."""

    def __init__(self, path: str | os.PathLike, keep: int = 3, *, writer: bool = False):
        """``writer``: the training run that owns ``path``, which first deletes the temporary
        folders of saves that never completed (a full disk's leftovers); a reader (export,
        evaluation of a live run) leaves them, since one may be a save in progress."""
        self.path = Path(path).absolute()
        self.keep = keep
        self.manager = ocp.CheckpointManager(self.path, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=writer))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, items: dict[str, Any], meta: dict[str, Any]) -> None:
        """Writes the checkpoint of ``step`` (``items``: name -> pytree of arrays) and waits
        until it is on disk; a failed write raises ``CheckpointSaveError`` (orbax wrote into a
        temporary folder, so the last complete checkpoint stays the one a rerun resumes from)."""
        args = {name: ocp.args.StandardSave(_flat(tree)[0]) for name, tree in items.items()}
        try:
            self.manager.save(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta)),
                              force=True)
            self.manager.wait_until_finished()
        except Exception as e:  # orbax re-raises its writer threads' errors as they came
            last = [s for s in self.manager.all_steps() if s != step]
            resume = f"step {max(last)}" if last else "the start (none is complete)"
            reason = str(e).splitlines()[0][:300]
            raise CheckpointSaveError(
                f"checkpoint of step {step} not written to {self.path} ({type(e).__name__}: "
                f"{reason}); a rerun resumes from {resume}. Free space there or lower "
                f"trainer.keep_checkpoints (one checkpoint is {size_text(nbytes(items))})") from e

    def space_note(self, size: int) -> str | None:
        """Checks that the disk under ``path`` can hold this run's checkpoints of ``size``
        bytes each: raises ``CheckpointSaveError`` if not even one fits; returns a warning
        when the ``keep`` kept plus the one being written (orbax deletes the oldest after the
        new one is complete) do not, else None."""
        where = next(p for p in (self.path, *self.path.parents) if p.exists())
        free = shutil.disk_usage(where).free
        kept = len(self.all_steps())
        need = max(self.keep + 1 - kept, 1) * size
        sizes = (f"one checkpoint of this run is {size_text(size)} (weights and optimizer "
                 f"state), {size_text(free)} free under {where}")
        if free < size:
            raise CheckpointSaveError(f"trainer.output_dir: {sizes}; choose a folder on a larger "
                                      "disk")
        if free < need:
            fits = free // size + kept - 1  # kept while the next one is written
            advice = (f"set trainer.keep_checkpoints={fits} or free space" if fits >= 1 else
                      "even one kept while the next is written does not fit: put "
                      "trainer.output_dir on a larger disk")
            return (f"warning: {sizes}: trainer.keep_checkpoints={self.keep} needs "
                    f"{size_text(need)} of it; saves will fail when the disk fills: {advice}")
        return None

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


def nbytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (global shapes): what a checkpoint of it holds."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def abstract(tree: Any) -> Any:
    """``tree`` with each array replaced by its shape, dtype and sharding: a restore target
    that holds no device memory, so the arrays it was made from can be freed first."""
    return jax.tree.map(_abstract, tree)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
