"""Training checkpoints with orbax: named items of arrays, plus a small JSON of host state.

A checkpoint is one orbax step folder holding one item per named pytree (the trainer saves
``actor``: the actor's trained variables, and ``state``: the rest of the ``TrainState``),
each stored as a flat dict keyed by pytree path names, so a mismatch names the field, and
``meta`` (JSON: step, data counters, early-stopping state). ``restore`` reads the items it
is given, into their structure and shardings (a run resumed on a different mesh places each
array on its shard; export restores the actor alone). The last ``keep`` checkpoints are kept.

A step that cannot be read (a truncated data file, a missing ``meta/metadata``) raises
``CheckpointRestoreError``; the trainer then renames it with ``set_aside`` to
``<step>.damaged-<n>`` (a name orbax does not take for a step, so it is neither listed nor
deleted) and resumes from the step before. A step whose arrays do not match the run's (another
model, LoRA rank or estimator) is no damage: ``CheckpointMismatchError``, nothing moved. A
writer checks at once that it can write its folder (``check_writable``), before a run spends
minutes on a warm start to fail at its first save.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
import types
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


class FolderNotWritableError(CheckpointSaveError):
    """A run folder or its ``checkpoints/`` cannot be written (read-only, no permission, a
    full disk); found at the start, the message names the folder and the field that sets it."""


class CheckpointRestoreError(ValueError):
    """A checkpoint step that cannot be read (damaged or incomplete); ``step`` names it and the
    message gives the first line of the reason."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step = step
        self.reason = reason


class CheckpointMismatchError(ValueError):
    """A readable checkpoint step whose arrays are not the ones this run config builds (another
    model size, LoRA rank or estimator): a config error, so the step is left where it is."""


# Words of an error that says the disk is full, as orbax and tensorstore pass it on (a
# tensorstore write error arrives as a ValueError whose text holds the OS's message).
_NO_SPACE = ("No space left on device", "ENOSPC", "Disk quota exceeded")
_NOT_WRITABLE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "permission denied"}


def _cause_errno(e: BaseException) -> int | None:
    """The errno of ``e`` or of an exception it was raised from, else one its text names."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    if any(w in text for w in _NO_SPACE):
        return errno.ENOSPC
    if "Read-only file system" in text:
        return errno.EROFS
    if "Permission denied" in text:
        return errno.EACCES
    return None


def _first_line(e: BaseException, limit: int = 300) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:limit] if lines else ''}"


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception ``e`` was raised from: the one that names the file (orbax
    wraps tensorstore's "OUT_OF_RANGE: Error reading <array> in <folder>" in a generic
    "error while reading array index")."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def check_writable(folder: str | os.PathLike, field: str = "trainer.output_dir") -> Path:
    """Makes ``folder`` (and its parents) if needed and writes, then removes, a small file in
    it; raises ``FolderNotWritableError`` naming ``folder`` and ``field`` if either fails.

    A real write, not ``os.access``: root passes every permission check there (chmod does not
    stop it), while a read-only mount or a full disk stops root too. Returns the folder."""
    folder = Path(folder).absolute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        code = _cause_errno(e)
        # mkdir names the parent it could not write in; the probe's own file is not news
        where = e.filename if e.filename and ".write-check-" not in str(e.filename) else folder
        if code == errno.ENOSPC:
            advice = "no space left on device: free space there"
        elif code in _NOT_WRITABLE:
            advice = f"{_NOT_WRITABLE[code]}: make it writable"
        else:
            advice = f"{e.strerror or _first_line(e)}: fix it"
        raise FolderNotWritableError(
            f"{field}: cannot write {where} ({advice}, or choose another {field})") from None
    return folder


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
        if writer:  # before orbax makes the folder: its failure there is a traceback
            check_writable(self.path)
        self.manager = ocp.CheckpointManager(self.path, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=writer))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def reload(self) -> None:
        """Rereads the folder's steps (after ``set_aside``, on every process)."""
        self.manager.reload()

    def set_aside(self, step: int) -> Path:
        """Renames the folder of ``step`` to ``<step>.damaged-<n>`` (the first free ``n``), so
        that orbax neither lists nor deletes it and the data stays for a look; returns the
        new path. Raises ``CheckpointRestoreError`` if the rename fails."""
        src = self.path / str(step)
        n = 1
        while (self.path / f"{step}.damaged-{n}").exists():
            n += 1
        dst = self.path / f"{step}.damaged-{n}"
        try:
            src.rename(dst)
        except OSError as e:
            raise CheckpointRestoreError(
                f"checkpoint {src} cannot be read and could not be moved aside ({_first_line(e)}); "
                f"move or delete it by hand and rerun", step, _first_line(e)) from None
        self.manager.reload()
        return dst

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
            code = _cause_errno(e)
            if code == errno.ENOSPC:
                advice = (f"Free space there or lower trainer.keep_checkpoints (one checkpoint "
                          f"is {size_text(nbytes(items))})")
            elif code in _NOT_WRITABLE:
                advice = (f"The folder is not writable ({_NOT_WRITABLE[code]}): make it "
                          f"writable or choose another trainer.output_dir")
            else:
                advice = "Fix the cause above and rerun the same command"
            raise CheckpointSaveError(
                f"checkpoint of step {step} not written to {self.path} ({_first_line(e)}); "
                f"a rerun resumes from {resume}. {advice}") from e

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
        shardings) of ``like[name]`` (arrays or ``ShapeDtypeStruct``), and the meta JSON.

        Raises ``CheckpointMismatchError`` when the step's array metadata reads but names
        other arrays or shapes than ``like`` (checked first, so a config change is never taken
        for damage), and ``CheckpointRestoreError`` when anything of the step cannot be read.
        An out-of-memory error of the device is neither and passes through."""
        flats = {name: _flat(tree) for name, tree in like.items()}
        folder = self.path / str(step)
        try:
            for name, (flat, _) in flats.items():
                self._check_shapes(step, name, flat)
            args = {name: ocp.args.StandardRestore({k: _abstract(v) for k, v in flat.items()})
                    for name, (flat, _) in flats.items()}
            out = self.manager.restore(step, args=ocp.args.Composite(
                **args, meta=ocp.args.JsonRestore()))
            if not isinstance(out["meta"], dict):
                raise ValueError(f"meta is {type(out['meta']).__name__}, not a JSON object")
        except (CheckpointMismatchError, jax.errors.JaxRuntimeError, MemoryError):
            raise
        except Exception as e:  # any reader's error: a file cut short, missing or garbled
            _mute_aborted_reads()
            reason = _first_line(_root_cause(e))
            raise CheckpointRestoreError(f"checkpoint {folder} cannot be read ({reason})",
                                         step, reason) from e
        restored = {}
        for name, (flat, treedef) in flats.items():
            arrays = out[name]
            restored[name] = jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in flat])
        return restored, dict(out["meta"])

    def _check_shapes(self, step: int, name: str, flat: dict[str, Any]) -> None:
        """Raises ``CheckpointMismatchError`` unless item ``name`` of ``step`` holds exactly the
        arrays of ``flat`` with their shapes (orbax restores only identical structures);
        an unreadable metadata file raises its own error, which ``restore`` calls damage."""
        saved = ocp.StandardCheckpointHandler().metadata(self.path / str(step) / name)
        saved = dict(getattr(saved, "item_metadata", saved) or {})
        if not saved:
            raise ValueError(f"{name}: no array metadata")
        missing, extra = sorted(set(flat) - set(saved)), sorted(set(saved) - set(flat))
        where = f"checkpoint {self.path}/{step} ({name})"
        advice = ("resume with the config it was trained with (the run folder's config.json) "
                  "or choose another trainer.output_dir")
        if missing or extra:
            what = (f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which this run "
                    f"does not build")
            raise CheckpointMismatchError(f"{where} {what} ({len(missing)} missing, "
                                          f"{len(extra)} extra arrays): {advice}")
        for key, x in flat.items():
            shape = tuple(getattr(saved[key], "shape", ()) or ())
            if shape != tuple(x.shape):
                raise CheckpointMismatchError(f"{where}: {key} is {shape} there, {tuple(x.shape)} "
                                              f"in this run: {advice}")

    def close(self) -> None:
        self.manager.close()


_MUTED = False


def _mute_aborted_reads() -> None:
    """Keeps the reports of a failed restore's leftover reads off stderr, for the rest of the
    process: when one array of a step fails, orbax's event loop closes while tensorstore
    still completes the others, and each completion (``RuntimeError: Event loop is closed``)
    and each abandoned read coroutine is reported through ``sys.unraisablehook``, dozens of
    tracebacks after the one-line error. Only those two kinds are dropped; every other report
    goes to the hook this replaces."""
    global _MUTED
    if _MUTED:
        return
    _MUTED = True
    previous = sys.unraisablehook

    def hook(report: Any) -> None:
        value, obj = report.exc_value, report.object
        closed = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        aborted = (isinstance(obj, types.CoroutineType)
                   and "orbax" in getattr(obj.cr_code, "co_filename", ""))
        if not (closed or aborted):
            previous(report)

    sys.unraisablehook = hook


def nbytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (global shapes): what a checkpoint of it holds."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def abstract(tree: Any) -> Any:
    """``tree`` with each array replaced by its shape, dtype and sharding: a restore target
    that holds no device memory, so the arrays it was made from can be freed first."""
    return jax.tree.map(_abstract, tree)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
