"""Multi-process training on JAX's distributed runtime, on localhost CPU processes: 2 processes
x 2 simulated devices, the parameters split over both and within each (fsdp x tensor), against
1 process on 1 device (same losses, metrics and parameters), a
checkpoint written by 2 processes and resumed by 2 processes, a process that never joins and
one that dies mid-run (the other exits with a clear error, never hangs; the job whose
checkpoint is resumed), and an incomplete checkpoint being ignored on resume. Every process runs under a timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ragen_jax.metrics import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240  # seconds per process: generous for a loaded 2-core CI machine

MICRO = ["--config", str(ROOT / "configs/bandit.py"),
         "--config.trainer.save_freq=1", "--config.trainer.test_freq=2",
         "--config.trainer.progress=False",
         # One layer: what is distributed (the batch, the parameters' shards, the optimizer
         # state) is the same for any depth, and each process compiles a fifth less.
         "--config.model.hidden_size=64", "--config.model.intermediate_size=128",
         "--config.model.num_hidden_layers=1",
         "--config.rollout.env_groups=2", "--config.rollout.group_size=4",
         "--config.rollout.val.env_groups=4", "--config.actor.ppo_mini_batch_size=4",
         "--config.actor.micro_batches=1",
         "--config.warmstart.steps=0", "--config.trainer.val_before_train=False",
         "--config.rollout.response_length=8",
         "--config.diagnostics.compute_freq=2", "--config.diagnostics.num_samples=8",
         "--config.algorithm.adv_estimator=grpo"]


# The 2-process job's mesh: parameters split over both processes (fsdp) and within each
# (tensor), the batch over both; against one process on one device, so one job shows that
# the sharded step and the multi-process step are the single-device step.
SHARDED = ("--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, XLA_FLAGS=flags.strip(),
                JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _launch(out: Path, steps: int, *extra: str, devices: int) -> subprocess.Popen:
    """Starts ``launch.py``; its stdout/stderr go to files (a full pipe would block it)."""
    cmd = [sys.executable, str(ROOT / "launch.py"), *MICRO, f"--config.trainer.output_dir={out}",
           f"--config.trainer.total_steps={steps}", *extra]
    logs = out.parent / f"{out.name}.{time.monotonic_ns()}"
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(devices), stdout=open(f"{logs}.out", "w"),
                         stderr=open(f"{logs}.err", "w"))
    p.logs = logs
    return p


def _read(p: subprocess.Popen) -> tuple[str, str]:
    return Path(f"{p.logs}.out").read_text(), Path(f"{p.logs}.err").read_text()


def _job(out: Path, steps: int, *extra: str, processes: int = 2) -> list[subprocess.Popen]:
    port = _free_port()
    return [_launch(out, steps, f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    f"--config.distributed.num_processes={processes}",
                    f"--config.distributed.process_id={i}", *extra, devices=2)
            for i in range(processes)]


def _wait(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process of the job hung past its timeout")
        results.append((p.returncode, *_read(p)))
    return results


def _arrays(run: Path, step: int) -> dict[str, np.ndarray]:
    import jax
    import orbax.checkpoint as ocp

    out = {}
    for item in ("actor", "state"):
        path = run / "checkpoints" / str(step) / item
        ckpt = ocp.StandardCheckpointer()
        meta = ckpt.metadata(path).item_metadata  # saved on 4 devices of 2 processes; read onto this process's one
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one) for k, m in meta.items()}
        out |= {f"{item}/{k}": np.asarray(v) for k, v in ckpt.restore(path, target).items()}
    return out


def _comparable(metrics: dict[str, float]) -> dict[str, float]:
    # Timings and compiles differ; collapse MI diagnostics score a per-process sample of pairs
    # (the first-turn counts and the gradient analysis are global, so they must match).
    return {k: v for k, v in metrics.items()
            if not k.startswith(("timing_s/", "compile/", "collapse_first_turn_sample/",
                                 "collapse_trajectory_sample/"))}


def test_two_processes_match_one_process_resume_across_processes_and_a_death_ends_them(tmp_path):
    """One job does three things, so its processes compile once: it runs step 1 (its two
    processes write the checkpoint), then one process is killed and the other must exit with a
    clear error within 90 s (never hang); a restarted 2-process job resumes from that checkpoint
    to step 2; and every step's metrics and the final parameters equal a 1-process run's."""
    single = tmp_path / "single"
    grads = "--config.diagnostics.gradient_analysis=True"
    ref = _launch(single, 2, grads, devices=1)
    rc, _, err = _wait([ref])[0]
    assert rc == 0, err[-3000:]

    multi = tmp_path / "multi"
    procs = _job(multi, 50, grads, *SHARDED, "--config.distributed.heartbeat_timeout_s=5")
    deadline = time.monotonic() + TIMEOUT
    while not (multi / "checkpoints" / "1").is_dir():  # written by both processes, complete
        assert procs[0].poll() is None and procs[1].poll() is None, _read(procs[0])[1][-3000:]
        assert time.monotonic() < deadline, "the job did not reach step 1"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, _, err = _wait(procs[:1], timeout=90)[0]
    procs[1].wait()
    assert rc != 0 and time.monotonic() - t0 < 90
    assert "another process" in err or "another task died" in err

    second = _wait(_job(multi, 2, grads, *SHARDED))  # a restarted job resumes from step 1
    for rc, _, err in second:
        assert rc == 0, err[-3000:]
    assert "resumed from" in second[0][1] and "resumed from" not in second[1][1]
    assert "Run folder" in second[0][1] and "Run folder" not in second[1][1]  # only process 0 reports

    a, b = read_jsonl(single / "metrics.jsonl"), read_jsonl(multi / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in a:
        ma, mb = _comparable(a[step]), _comparable(b[step])
        assert set(ma) <= set(mb), step
        assert step == 0 or {"actor/pg_loss", "actor/grad_norm", "actor/entropy"} <= set(ma)
        for k in ma:
            assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-5), (step, k)
    assert b[1]["rollout/num_trajectories"] == 8  # counts are summed over the processes
    for kind in ("first_turn_sample", "trajectory_sample"):  # diagnostics on pairs from both
        assert np.isfinite(b[1][f"collapse_{kind}/mi_estimate"]), kind
    assert b[1]["collapse/first_turn_num_total"] == 8  # every process's episodes
    # The gradient analysis at the diagnostics steps only (compute_freq 2: step 1), compared
    # with the one-process run above: 2 groups in 3 buckets, bucket 0 empty and not logged.
    grad = {k: v for k, v in b[1].items() if k.startswith("collapse_grad/")}
    assert np.isfinite(grad["collapse_grad/pg_grad_norm"])
    assert not any(k.startswith("collapse_grad/bucket0/") for k in grad)
    assert grad["collapse_grad/bucket1/num_rows"] + grad["collapse_grad/bucket2/num_rows"] == 8
    assert grad["collapse_grad/bucket1/reward_std_mean"] <= grad["collapse_grad/bucket2/reward_std_mean"]
    assert not any(k.startswith("collapse_grad/") for k in b[2])
    assert "val-env/Bandit/success" in b[2]  # validation over both processes' shares

    pa, pb = _arrays(single, 2), _arrays(multi, 2)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        np.testing.assert_allclose(pb[k], pa[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_a_process_that_never_joins_is_a_clear_error(tmp_path):
    port = _free_port()
    t0 = time.monotonic()
    alone = _launch(tmp_path / "run", 1, f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    "--config.distributed.num_processes=2", "--config.distributed.process_id=0",
                    "--config.distributed.initialization_timeout_s=5", devices=2)
    rc, _, err = _wait([alone], timeout=90)[0]
    assert rc != 0 and time.monotonic() - t0 < 90
    assert "the job did not assemble within 5 s" in err


def test_an_incomplete_checkpoint_is_ignored(tmp_path):
    import jax.numpy as jnp

    from ragen_jax.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    state = {"w": jnp.arange(4.0)}
    store.save(2, {"arrays": state}, {"step": 2})
    store.close()
    # A save cut off mid-write leaves orbax's temporary folder: it is not a checkpoint.
    partial = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1234567890"
    (partial / "arrays").mkdir(parents=True)
    (partial / "arrays" / "garbage").write_bytes(b"\0" * 16)
    store = CheckpointStore(tmp_path / "ckpt")
    assert store.latest_step() == 2
    restored, meta = store.restore(2, {"arrays": state})
    np.testing.assert_array_equal(np.asarray(restored["arrays"]["w"]), np.arange(4.0))
    assert meta["step"] == 2
    store.close()
