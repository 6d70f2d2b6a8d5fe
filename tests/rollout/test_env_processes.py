"""Host envs in worker processes (``isolation="process"``) under real faults: an env that
never returns, one spinning in C with the GIL held, a segfault, ``os.abort()``, a memory leak
past ``memory_limit_mb``, a constructor that hangs. Each costs its episode only: the other
rows of the batch (on the same worker, rebuilt by replay) and the next rollout succeed, the
number of live worker processes and of this process's threads stays bounded, and no test
waits for a fault (each error names the timeout that cut it; pytest-timeout backs them)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import psutil
import pytest

from ragen_jax.envs.host.family import HostEnvFamily
from ragen_jax.envs.host.processes import Histories, Job, ProcessPool
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.scripted import answer_text
from tests.rollout.faulty_envs import Faulty, SlowBuild

pytestmark = pytest.mark.timeout(60)

CFG = RolloutConfig(env_groups=2, group_size=2, max_turn=2, max_actions_per_traj=4, max_actions_per_turn=2, response_length=32, prompt=PromptConfig(enable_think=False))


def _policy(tok, answers):
    return ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(answers(row, call), CFG.context))


def _workers() -> int:
    """This process's live descendants (a zombie, or one gone since it was listed, is not)."""
    return sum(_alive(p) for p in psutil.Process().children(recursive=True))


@pytest.mark.parametrize("kind", ["sleep", "regex", "segv", "abort", "leak", "boom"])
def test_a_fault_costs_only_its_episode(tok, kind):
    gc.collect()
    before = _workers()  # other tests' pools, the fork server, multiprocessing's resource tracker
    rollout = AgentRollout(HostEnvFamily(Faulty, step_timeout=2.0, memory_limit_mb=128),
                           None, tok, CFG)
    threads = threading.active_count()
    # Row 0 moves first, then row 2's fault kills the (single) worker holding every row:
    # rows 0, 1 and 3 are rebuilt by replay and finish their episodes next turn.
    batch = rollout.collect(_policy(tok, lambda row, call: (
        [kind] if row == 2 else ["go"] if call == 0 else ["win"])), np.array([11, 12]),
        jax.random.key(0))
    t = batch.trajectories
    assert t[2]["env_error"], kind
    assert [x["success"] for x in t] == [True, True, False, True]
    assert [x["env_error"] for x in t[:2] + t[3:]] == ["", "", ""]
    assert t[0]["final_state"] == "seed 11 move 2 win"  # the replayed instance went on
    assert batch.metrics["rollout/env_errors"] == 1.0
    # A hang is cut at the family's 2 s step_timeout (the error names it), not at a default.
    expected = {"sleep": "timed out: an env call took over 2 s",
                "regex": "timed out: an env call took over 2 s", "segv": "its worker process died (killed by SIGSEGV)",
                "abort": "its worker process died (killed by SIGABRT)", "leak": "MemoryError",
                "boom": "ValueError: boom"}[kind]
    assert t[2]["env_error"].startswith(expected), t[2]["env_error"]
    for seeds in ([13, 14], [15, 16]):  # the next rollouts play on, on one fresh worker
        batch = rollout.collect(_policy(tok, lambda row, call: ["win"]), np.array(seeds),
                                jax.random.key(1))
        assert batch.success.all() and batch.metrics["rollout/env_errors"] == 0.0
    assert rollout.driver.calls.pool.live_processes() == 1
    # The worker; the fork server and resource tracker if new (killed workers reaped).
    assert _settles(lambda: _workers() <= before + 3)
    assert threading.active_count() <= threads + 1
    rollout.driver.close()
    assert rollout.driver.calls.pool.live_processes() == 0
    assert _settles(lambda: _workers() <= before + 2)


def test_a_hang_in_reset_and_a_hanging_constructor_cost_their_episodes(tok, tmp_path):
    flag = tmp_path / "hang"
    import functools

    family = HostEnvFamily(functools.partial(SlowBuild, str(flag)), step_timeout=0.5)
    rollout = AgentRollout(family, None, tok, CFG)
    flag.touch()  # every instance built from now on hangs in its constructor
    batch = rollout.collect(_policy(tok, lambda row, call: ["win"]), np.array([1, 2]), jax.random.key(0))
    assert all(x["env_error"].startswith("reset: timed out: an env call took over 0.5 s")
               for x in batch.trajectories)
    flag.unlink()
    batch = rollout.collect(_policy(tok, lambda row, call: ["win"]), np.array([1, 2]), jax.random.key(0))
    assert batch.success.all()
    rollout.driver.close()


def test_a_prototype_that_hangs_or_crashes_is_a_one_line_error(tmp_path):
    import functools

    flag = tmp_path / "hang"
    flag.touch()
    with pytest.raises(RuntimeError, match=r"^building the env in a worker process failed: "
                                           r"timed out: an env call took over 0.5 s"):
        HostEnvFamily(functools.partial(SlowBuild, str(flag)), step_timeout=0.5)
    lock = threading.Lock()  # a closure over a lock cannot travel to a worker
    with pytest.raises(ValueError, match=r"^env .*cannot be pickled.*isolation='thread'"):
        HostEnvFamily(lambda: (lock, Faulty())[1])


def test_parallel_friendly_envs_run_in_parallel_processes(tok):
    """Four workers step four rows at once, each on its own process."""
    class_ = Faulty
    rollout = AgentRollout(HostEnvFamily(class_, parallel_friendly=True, max_workers=4), None,
                           tok, CFG)
    rollout.collect(_policy(tok, lambda row, call: ["win"]), np.array([1, 2]), jax.random.key(0))
    pool = rollout.driver.calls.pool
    assert pool.live_processes() == 4 and len(set(pool.pids())) == 4
    rollout.driver.close()


def test_workers_end_with_their_parent_even_when_it_is_killed(tmp_path):
    """SIGTERM (the default handler: no cleanup runs) and SIGKILL of the process that owns a
    pool leave no worker behind."""
    # The owner holds a bare ProcessPool: the workers' end is the pool's doing, and the owner
    # then imports no JAX (seconds of a loaded machine's time per start).
    script = textwrap.dedent("""
        import time
        from ragen_jax.envs.host.processes import Job, ProcessPool
        from tests.rollout.faulty_envs import Faulty
        if __name__ == "__main__":
            pool = ProcessPool(Faulty, 3, 30.0)
            jobs = pool.run([Job("reset", b, (b,)) for b in range(3)])
            assert not any(job.error for job in jobs), [job.error for job in jobs]
            print(" ".join(map(str, pool.pids())), flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "owner.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        owner = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True,
                                 env=env, cwd=os.getcwd())
        try:
            line = owner.stdout.readline()  # the owner's pids, once its workers are up
            workers = [psutil.Process(int(p)) for p in line.split()]
            assert len(workers) == 3 and all(_alive(w) for w in workers), line
            owner.send_signal(sig)
            owner.wait(timeout=60)
            assert _settles(lambda w=workers: not any(_alive(p) for p in w)), sig
        finally:
            owner.kill()
            owner.wait()


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (False once reaped, or if its pid now names another process)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _settles(condition, timeout: float = 90.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (polled, garbage collected in
    between): what the kernel and the fork server end or reap takes its time on a loaded
    machine, and a leak never settles."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.05)
    return True


@pytest.mark.timeout(300)
def test_fifty_kills_and_restarts_leave_fds_threads_and_processes_bounded():
    """Fifty workers killed (one in five past the timeout, the others by a segfault) and replaced:
    this process's open file descriptors, threads and live child processes settle where they
    were after the first cycle, every killed worker is reaped (none left a zombie), and a row
    on the killed workers plays on throughout, rebuilt by a replay of its whole episode each
    time."""
    # 2 s: above any single call of a fresh worker (building the env, each replayed action) and
    # the time to see a segfaulted worker dead, on a 2-core machine under four busy loops (at
    # 0.5 s a replayed step there timed out); ten timeouts keep the waiting at 20 s.
    pool = ProcessPool(Faulty, 1, 2.0)
    rows = Histories()
    killed = []

    def cycle(i: int) -> None:
        job = pool.run([rows.job("step", 0, (["go"],))])[0]
        killed.extend(psutil.Process(p) for p in pool.pids())
        rows.step_done(job)
        assert not job.error and job.progress.text == f"seed 1 move {i + 1} go", job.error
        hang = i % 5 == 1
        fault = pool.run([Job("reset", 1, (2,)), Job("step", 1, (["sleep" if hang else "segv"],))])
        assert fault[1].error.startswith("timed out" if hang else "its worker process died"), fault[1].error

    try:
        reset = pool.run([Job("reset", 0, (1,))])[0]
        rows.reset_done(reset)
        cycle(0)  # starts the fork server and the resource tracker, if not yet running
        assert _settles(lambda: not any(_alive(w) for w in killed))
        fds, threads, children = _fds(), threading.active_count(), _workers()
        t0 = time.perf_counter()
        for i in range(1, 50):
            cycle(i)
        # 10 timeouts of 2 s and 50 restarts of a few milliseconds: about 20 s. A restart that
        # waited out its kill's 5 s join would take over 250.
        assert time.perf_counter() - t0 < 120
        assert pool.restarts == 50 and len(set(killed)) == 50
        # What a killed worker held goes once the fork server has reaped it.
        _settles(lambda: _fds() <= fds and threading.active_count() <= threads
                 and _workers() <= children and not any(w.is_running() for w in killed))
        assert _fds() <= fds and threading.active_count() <= threads and _workers() <= children
        assert not any(w.is_running() for w in killed)  # reaped: not even a zombie
    finally:
        pool.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))
