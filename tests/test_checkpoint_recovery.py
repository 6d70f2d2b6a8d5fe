"""Checkpoints that recover: a damaged step is named, moved aside and the run resumes from the
step before it (or starts fresh, saying so); a run folder that cannot be written is one line
at the start; a failed save gives advice that fits its cause."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ragen_jax.checkpoint import (
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointStore,
    FolderNotWritableError,
    check_writable,
)
from ragen_jax.metrics import read_jsonl
from ragen_jax.run_lock import RunFolderInUseError, lock_run_folder, release_run_folder
from tests.test_train import ROOT, _run, _without_timing, micro_config


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A finished 2-step run: checkpoints of steps 0 (after the warm start) and 2."""
    out = tmp_path_factory.mktemp("two_steps")
    _run(micro_config(out, steps=2))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0", "2"]
    return out


def _copy_checkpoints(run: Path, to: Path) -> Path:
    shutil.copytree(run / "checkpoints", to / "checkpoints")
    return to / "checkpoints"


def _truncate_a_data_file(step: Path) -> Path:
    """Cuts the step's largest array data file in half (the actor's weights: the optimizer's
    moments are zeros at step 0, which zarr need not store)."""
    files = [p for p in step.rglob("*") if p.is_file() and p.parent.name == "d"]
    largest = max(files, key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    return largest


def _damage_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "could not be restored" in line]


def test_a_truncated_step_is_moved_aside_and_the_run_resumes_from_the_one_before(
        two_steps, tmp_path, capfd):
    """A data file of the newest step cut short: one line names the step and the reason, the
    step is renamed ``2.damaged-1`` (kept, with the cut file in it, and not a step for orbax)
    and the run resumes from step 0, repeating steps 1-2 exactly as the first run did."""
    checkpoints = _copy_checkpoints(two_steps, tmp_path)
    shutil.copy(two_steps / "metrics.jsonl", tmp_path / "metrics.jsonl")  # rows 0-2 logged before
    cut = _truncate_a_data_file(checkpoints / "2")
    size = cut.stat().st_size
    capfd.readouterr()
    summary = _run(micro_config(tmp_path, steps=2))
    out, err = capfd.readouterr()
    assert summary["resumed_from"] == 0 and summary["step"] == 2
    lines = _damage_lines(out + err)
    assert len(lines) == 1, out + err
    assert lines[0].startswith("checkpoint step 2 could not be restored (")
    assert "OUT_OF_RANGE" in lines[0] and f'local file "{checkpoints / "2"}/' in lines[0]
    assert lines[0].endswith(f"moved aside to {checkpoints / '2.damaged-1'}; resuming from step 0")
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    moved = checkpoints / "2.damaged-1" / cut.relative_to(checkpoints / "2")
    assert moved.stat().st_size == size  # moved, not repaired or deleted
    assert CheckpointStore(checkpoints).all_steps() == [0, 2]  # 2 saved anew; the damaged unlisted
    assert (checkpoints / "2.damaged-1").is_dir()  # and not cleaned up by the writer either
    again, first = (_without_timing(read_jsonl(run / "metrics.jsonl")) for run in (tmp_path, two_steps))
    assert [again[s] for s in (1, 2)] == [first[s] for s in (1, 2)]
    # Steps 1-2 were played again; their earlier rows went, so each step has one row.
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [0, 1, 2]


def test_with_every_step_damaged_the_run_starts_fresh_and_says_so(two_steps, tmp_path, capfd):
    """The newest step without its ``meta/metadata`` and the older one cut short: each is
    named and moved aside, and the run starts over from its warm start, as a new run does."""
    checkpoints = _copy_checkpoints(two_steps, tmp_path)
    (checkpoints / "2" / "meta" / "metadata").unlink()
    _truncate_a_data_file(checkpoints / "0")
    (checkpoints / "0.damaged-1").mkdir()  # an earlier casualty: the name takes the next n
    capfd.readouterr()
    summary = _run(micro_config(tmp_path, steps=2))
    out, err = capfd.readouterr()
    assert summary["resumed_from"] is None and summary["step"] == 2
    lines = _damage_lines(out + err)
    assert len(lines) == 2, out + err
    assert lines[0].startswith("checkpoint step 2 could not be restored (FileNotFoundError: ")
    assert str(checkpoints / "2" / "meta" / "metadata") in lines[0]
    assert lines[0].endswith(f"moved aside to {checkpoints / '2.damaged-1'}; resuming from step 0")
    assert lines[1].startswith("checkpoint step 0 could not be restored (")
    assert lines[1].endswith(f"moved aside to {checkpoints / '0.damaged-2'}; no complete "
                             f"checkpoint is left: starting fresh from step 0")
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "0", "0.damaged-1", "0.damaged-2", "2", "2.damaged-1"]
    # A fresh start is the first run again (warm start, step 0's validation, two steps).
    assert _without_timing(read_jsonl(tmp_path / "metrics.jsonl")) == _without_timing(
        read_jsonl(two_steps / "metrics.jsonl"))


def test_a_checkpoint_of_another_config_is_an_error_and_is_not_moved(two_steps, tmp_path):
    """Arrays of other shapes are a config change, not damage: one line naming the array and
    both shapes, and every step stays where it is."""
    from ragen_jax.train import Trainer

    checkpoints = _copy_checkpoints(two_steps, tmp_path)
    trainer = Trainer(micro_config(tmp_path, extra=("--config.model.intermediate_size=96",)))
    with pytest.raises(CheckpointMismatchError) as e:
        trainer.maybe_resume()
    message = str(e.value)
    assert "\n" not in message and f"checkpoint {checkpoints}/2" in message
    assert " there, (" in message and ") in this run: resume with the config" in message
    assert "config.json" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0", "2"]


# -- folders that cannot be written ----------------------------------------------------------


def _user_namespaces() -> bool:
    """Whether this machine lets us make a read-only bind mount in a user and mount namespace
    (how a test makes a folder read-only for root, whom chmod does not stop)."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            "mount --bind /tmp /tmp && mount -o remount,ro,bind /tmp && "
                            "! touch /tmp/.ro-probe"], capture_output=True, timeout=30)
    return probe.returncode == 0


def _launch_micro(out: Path, *, read_only: Path | None = None, chmod: Path | None = None
                  ) -> subprocess.CompletedProcess:
    """``launch.py`` on the micro Bandit config into ``out``, with ``read_only`` mounted
    read-only for it (a user and mount namespace) or ``chmod`` made 0o555 around it."""
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", "configs/bandit.py",
           f"--config.trainer.output_dir={out}", "--config.trainer.total_steps=2",
           "--config.trainer.progress=False", "--config.model.hidden_size=64",
           "--config.model.intermediate_size=128", "--config.model.num_hidden_layers=1",
           "--config.rollout.env_groups=2", "--config.rollout.group_size=4",
           "--config.rollout.val.env_groups=4", "--config.actor.ppo_mini_batch_size=4",
           "--config.warmstart.steps=3", "--config.warmstart.episodes=8",
           "--config.warmstart.batch_size=4", "--config.rollout.response_length=8"]
    if read_only is not None:
        script = ('mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && '
                  'exec "$@"')
        cmd = ["unshare", "-rm", "sh", "-c", script, "sh", str(read_only), *cmd]
    if chmod is not None:
        chmod.chmod(0o555)
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        if chmod is not None:
            chmod.chmod(0o755)


@pytest.mark.parametrize("which", ["run folder", "checkpoints"])
@pytest.mark.parametrize("how", ["read-only mount", "chmod"])
def test_a_folder_that_cannot_be_written_is_one_line_at_the_start(tmp_path, which, how):
    """A run folder, or its ``checkpoints/``, that cannot be written: one line naming it, at
    once (before the warm start; it was three tracebacks at the first save, advice to free
    space, then minutes waiting on orbax's threads). A read-only mount stops root too; chmod
    stops only other users."""
    if how == "chmod" and os.geteuid() == 0:
        pytest.skip("root writes through chmod's permissions (the read-only mount case runs)")
    if how == "read-only mount" and not _user_namespaces():
        pytest.skip("no user namespaces here to mount a folder read-only")
    folder = tmp_path / "run" if which == "run folder" else tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    r = _launch_micro(tmp_path / "run", **{"read_only" if how.startswith("read") else "chmod":
                                           folder})
    reason = "read-only file system" if how.startswith("read") else "permission denied"
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"launch.py: trainer.output_dir: cannot write {folder} ({reason}: make it writable, "
        f"or choose another trainer.output_dir)"], r.stderr[-3000:]
    for later in ("warm-start loaded", "warm-start saved", "validation at step"):
        assert later not in r.stdout  # nothing heavy ran first
    assert not list(folder.iterdir())


def test_check_writable_names_the_cause(tmp_path, monkeypatch):
    """The start's write check names the folder with its cause: a full disk (the only case
    whose advice is to free space), no permission, a read-only file system."""
    import tempfile

    assert check_writable(tmp_path / "new" / "run") == tmp_path / "new" / "run"
    for code, words in ((errno.ENOSPC, "no space left on device: free space there"),
                        (errno.EACCES, "permission denied: make it writable"),
                        (errno.EROFS, "read-only file system: make it writable")):
        def refuse(*_a, code=code, **_k):
            raise OSError(code, os.strerror(code), str(tmp_path / ".write-check-x"))

        monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
        with pytest.raises(FolderNotWritableError) as e:
            check_writable(tmp_path)
        assert str(e.value) == (f"trainer.output_dir: cannot write {tmp_path} ({words}, or "
                                f"choose another trainer.output_dir)")


@pytest.mark.parametrize("error, advice, not_said", [
    (ValueError("RESOURCE_EXHAUSTED: Error writing x: No space left on device"),
     "Free space there or lower trainer.keep_checkpoints", "not writable"),
    (OSError(errno.EROFS, "Read-only file system", "ckpt/4.orbax-checkpoint-tmp"),
     "The folder is not writable (read-only file system)", "Free space"),
    (OSError(errno.EACCES, "Permission denied", "ckpt/4.orbax-checkpoint-tmp"),
     "The folder is not writable (permission denied)", "Free space"),
    (RuntimeError("lost the mount"), "Fix the cause above", "Free space"),
])
def test_a_failed_save_advises_freeing_space_only_for_a_full_disk(tmp_path, monkeypatch, error,
                                                                  advice, not_said):
    store = CheckpointStore(tmp_path / "checkpoints", writer=True)

    def failing(*_a, **_k):
        raise error

    monkeypatch.setattr(store.manager, "save", failing)
    with pytest.raises(CheckpointSaveError) as e:
        store.save(4, {"actor": {"w": np.ones(3, np.float32)}}, {"step": 4})
    message = str(e.value)
    assert message.startswith("checkpoint of step 4 not written") and "\n" not in message
    assert advice in message and not_said not in message, message
    store.close()


# -- one process per run folder ------------------------------------------------------------------

_HOLD = """
import sys, time
from ragen_jax.run_lock import lock_run_folder
lock_run_folder(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_a_live_run_folder_is_refused_naming_its_pid_and_freed_when_the_holder_dies(tmp_path):
    """A process holding the lock: a second lock of the folder fails at once, naming that
    process's pid, host and command; once the holder is killed (``kill -9``: no clean-up
    runs) the kernel has dropped the flock and the next one takes it."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderInUseError) as e:
            lock_run_folder(tmp_path)
        message = str(e.value)
        assert message.startswith(f"trainer.output_dir: run folder {tmp_path} is in use by pid "
                                  f"{holder.pid} (started ")
        assert "command: -c " in message and "\n" not in message
        assert message.endswith("; wait for it to finish (or stop it), or choose another "
                                "trainer.output_dir")
    finally:
        holder.kill()
        holder.wait(timeout=60)
        holder.stdout.close()
    try:
        assert lock_run_folder(tmp_path) == tmp_path / "run.lock"
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        assert lock_run_folder(tmp_path) == tmp_path / "run.lock"  # this process's already
    finally:
        release_run_folder(tmp_path)
    # A multi-process job's other processes lock files of their own.
    assert lock_run_folder(tmp_path, 1) == tmp_path / "run.1.lock"
    release_run_folder(tmp_path, 1)


def test_a_second_launch_on_a_live_run_folder_is_one_line_and_deletes_nothing(tmp_path):
    """The same command started while the first run saves: it used to delete the first
    run's temporary checkpoint folder (the first then died, "checkpoint of step 2 not
    written"). Now it is refused in one line naming the holder (here this test's process),
    before it writes or deletes anything in the folder."""
    saving = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"
    saving.mkdir(parents=True)
    (saving / "part").write_text("a save in progress")
    lock_run_folder(tmp_path)
    try:
        r = _launch_micro(tmp_path)
    finally:
        release_run_folder(tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"launch.py: trainer.output_dir: run folder {tmp_path} is in use "
                               f"by pid {os.getpid()} (started "), lines[0]
    assert (saving / "part").read_text() == "a save in progress"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "run.lock"]
