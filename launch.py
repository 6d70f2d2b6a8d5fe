"""ragen_jax training entry point.

    python launch.py                                         # Sokoban, tiny preset (CPU)
    python launch.py --config configs/bandit.py              # another env
    python launch.py --config configs/sokoban.py:qwen2.5-0.5b --config.model.path=/models/Qwen2.5-0.5B-Instruct
    python launch.py --config configs/sokoban.py --config.algorithm.adv_estimator=gae --config.trainer.total_steps=50

Any field of the run config (``ragen_jax/config/schema.py`` lists and documents them) can be
overridden with ``--config.<a>.<b>=value``; an unknown or ill-typed field is a one-line
error naming it. A run prints a short summary; the resolved config is saved as
``<output_dir>/config.json`` and the derived settings as ``<output_dir>/settings.txt``
(``--print_config`` also prints both). Rerunning the same command resumes from the last
checkpoint there, as does ``--config <output_dir>/config.json``; while a run is alive its
folder is locked (``<output_dir>/run.lock``), so a second start on it is refused in one line
naming the running process. The environment demo is ``python -m ragen_jax.envs.demo``.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent
PRINT_CONFIG = "--print_config"  # print the whole resolved config and derived settings first
sys.path.insert(0, str(ROOT))  # so config files can `from configs import base`


def main(argv: list[str]) -> None:
    from ragen_jax.config.loading import load_config, use_run_snapshot

    print_config = PRINT_CONFIG in argv
    argv = [a for a in argv if a != PRINT_CONFIG]
    try:
        config = load_config(argv[1:], prog="launch.py", default=str(ROOT / "configs/sokoban.py"))
        config = use_run_snapshot(config)  # resuming a run whose model folder has moved
        from ragen_jax import distributed
        from ragen_jax.config.fields import ConfigError
        from ragen_jax.config.loading import config_for_print, from_config_dict
        from ragen_jax.config.resolve import resolve
        from ragen_jax.policy import check_model_folder

        run_config = from_config_dict(config)  # every field checked, one-line errors
        check_model_folder(run_config.model)  # config.json, architecture, tokenizer files
        distributed.initialize(run_config.distributed)  # before anything starts JAX's backend
    except ValueError as e:  # also CheckpointError, a ValueError
        raise SystemExit(f"launch.py: {e}") from None
    import jax

    from ragen_jax import train
    from ragen_jax.checkpoint import (
        CheckpointMismatchError,
        CheckpointRestoreError,
        CheckpointSaveError,
    )
    from ragen_jax.models import CheckpointError
    from ragen_jax.run_lock import RunFolderInUseError

    if print_config and jax.process_index() == 0:
        from ragen_jax.config.summary import full_settings

        print(config_for_print(run_config), flush=True)
        print(full_settings(resolve(run_config), jax.default_backend()), flush=True)
    try:
        summary = train.run(run_config)
    except (ConfigError, CheckpointError, CheckpointSaveError, CheckpointRestoreError,
            CheckpointMismatchError, FileNotFoundError, RunFolderInUseError) as e:
        _exit(f"launch.py: {e}")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        # A log, trajectory or TensorBoard write found the disk full (a checkpoint's own
        # failure is a CheckpointSaveError above); the run folder's checkpoints are intact.
        where = e.filename or resolve(run_config).output_dir
        _exit(f"launch.py: no space left on device writing {where}; free space there and "
              "rerun the same command: it resumes from the last complete checkpoint")
    if jax.process_index() != 0:
        return
    out = Path(summary["output_dir"])
    from ragen_jax.plots import plot_run

    try:
        curves = plot_run(out)
    except ValueError as e:  # e.g. no validation ran yet
        curves = f"(none: {e})"
    state = "interrupted" if summary.get("interrupted") else "done"
    late = summary.get("compiled_after_step_1") or []
    compiled = (f"{summary.get('compile_count', 0):.0f} XLA programs in "
                f"{summary.get('compile_seconds', 0):.0f} s"
                + (f"; steps after the first that compiled: {', '.join(map(str, late[:10]))}"
                   + (" ..." if len(late) > 10 else "") if late else ""))
    print(f"\n{state} at step {summary['step']}. Run folder: {out}/\n"
          f"  compiled     {compiled}\n"
          f"  curves       {curves}\n"
          f"  metrics      {out}/metrics.jsonl  (TensorBoard: tensorboard --logdir {out}/tb)\n"
          f"  checkpoints  {out}/checkpoints/   (rerun the same command to resume; export: "
          f"python -m ragen_jax.export --checkpoint {out} --out HF_DIR)\n"
          f"  trajectories {out}/trajectories/  (validation episodes: JSONL + HTML viewer)\n"
          f"  evaluate     python -m ragen_jax.eval --checkpoint {out}")


def _exit(line: str) -> NoReturn:
    """Prints ``line`` to stderr and ends the process now (exit 1). After a failed save,
    orbax's writer threads wait 5 minutes for a folder that never came before the
    interpreter's shutdown could join them; the trainer closed its logs and checkpoints while
    the error unwound, so nothing is left to wait for. Imported, not run, it raises
    ``SystemExit(line)``: a caller's process is not ended under it."""
    import os

    if __name__ != "__main__":
        raise SystemExit(line)
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(1)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except Exception:
        # A crashed run exits now: after an accelerator error (seen on a GPU: out of memory)
        # the interpreter's shutdown waited on the runtime for minutes. The trainer closed its
        # logs and checkpoints while the error unwound.
        import os
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
