"""The HTTP env protocol on 127.0.0.1: a served Countdown plays exactly as the in-process one
(and draws the same random answers), a served JAX env follows the env's own dynamics, a served
env that hangs or crashes costs only its session's call (the server and the other sessions
play on), a server killed mid-episode costs that episode and the next rollout plays on against
its restart, and a reply slower than the client's timeout costs its episode only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import psutil
import pytest

from ragen_jax.envs import make
from ragen_jax.envs.host.remote import RemoteEnv, RemoteEnvError
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.scripted import answer_text

# A server's start (a JAX env's: two JAX imports and the env built twice) takes a quiet
# machine seconds and a loaded one a minute or more; the tests wait for it, not a fixed time.
pytestmark = pytest.mark.timeout(400)

ONE = RolloutConfig(env_groups=2, group_size=2, max_turn=1, max_actions_per_traj=1, max_actions_per_turn=1, response_length=32, prompt=PromptConfig(enable_think=False))
SERVER = ("import sys; from ragen_jax.envs import register; from ragen_jax.envs.host.serve import main; "
          "from tests.rollout.faulty_envs import Slow; register('slow', Slow); main(sys.argv[1:])")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(env: str, port: int, *args: str, timeout: float = 150.0) -> subprocess.Popen:
    """The server, once it answers ``/info``; an error if it exits or does not answer within
    ``timeout`` seconds."""
    server = subprocess.Popen([sys.executable, "-c", SERVER, env, "--port", str(port), *args],
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/info", timeout=5.0)
            return server
        except httpx.TransportError:
            time.sleep(0.1)
    code = server.poll()
    server.kill()
    server.wait()
    raise RuntimeError(f"the env server did not start within {timeout:g} s" if code is None else
                       f"the env server exited with code {code} before it answered")


def _warm(url: str, sessions: int) -> None:
    """Plays a reset on ``sessions`` consecutive new sessions, each waiting as long as its
    server worker takes: every worker is started (its env's module imported) and idle after."""
    envs = [RemoteEnv(url, timeout=120.0) for _ in range(sessions)]
    for seed, env in enumerate(envs):
        env.reset(seed)
    for env in envs:
        env.close()


@pytest.fixture
def port():
    return _port()


def _answers(tok, cfg, texts):
    return ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(texts(row, call), cfg.context))


def test_a_served_countdown_plays_as_the_in_process_one(tok, port):
    server = _serve("countdown", port)
    url = f"http://127.0.0.1:{port}"
    try:
        batches = []
        for env in (make("countdown")[0], make("remote", url=url)[0]):
            rollout = AgentRollout(env, None, tok, ONE, tag="Countdown")
            batches.append(rollout.collect(_answers(tok, ONE, lambda r, c: ["1 + 2 + 3"]),
                                           np.array([5, 6]), jax.random.key(0)))
            rollout.driver.close()
        local, remote = batches
        assert (local.input_ids == remote.input_ids).all() and (local.scores == remote.scores).all()
        strip = lambda t: {k: v for k, v in t.items() if k != "tag"}  # noqa: E731
        assert [strip(t) for t in local.trajectories] == [strip(t) for t in remote.trajectories]
        assert [e.level for e in local.episodes] == [e.level for e in remote.episodes]
        # The format warm-start's random answers: the same draws from the same generator.
        here, there = make("countdown", isolation="thread")[0].factory(), RemoteEnv(url)
        for seed in (1, 2):
            assert here.reset(seed) == there.reset(seed)
            rng_here, rng_there = np.random.default_rng(seed), np.random.default_rng(seed)
            for _ in range(3):
                assert here.random_action(rng_here) == there.random_action(rng_there)
            assert rng_here.bit_generator.state == rng_there.bit_generator.state
        there.close()
    finally:
        server.kill()
        server.wait()


def test_a_server_killed_mid_episode_costs_that_episode(tok, port):
    cfg = RolloutConfig(env_groups=1, group_size=2, max_turn=2, max_actions_per_traj=4, max_actions_per_turn=1, response_length=32, prompt=PromptConfig(enable_think=False))
    server = _serve("slow", port)
    env = make("remote", url=f"http://127.0.0.1:{port}", timeout=2.0, retries=1)[0]
    rollout = AgentRollout(env, None, tok, cfg)
    killed = []

    def script(row, call):
        if call == 1 and not killed:  # after the first turn's steps: the server dies
            server.kill()
            server.wait()
            killed.append(True)
        return ["go"]

    try:
        t0 = time.perf_counter()
        batch = rollout.collect(_answers(tok, cfg, script), np.array([3]), jax.random.key(0))
        assert time.perf_counter() - t0 < 20
        assert all(t["env_error"] for t in batch.trajectories)
        assert batch.metrics["rollout/env_errors"] == 2.0
        restarted = _serve("slow", port)
        batch = rollout.collect(_answers(tok, cfg, lambda r, c: ["win"]), np.array([4]),
                                jax.random.key(1))
        assert batch.success.all() and batch.metrics["rollout/env_errors"] == 0.0
        restarted.kill()
        restarted.wait()
    finally:
        server.kill()
        rollout.driver.close()


def test_a_slow_reply_costs_its_episode_only(tok, port):
    server = _serve("slow", port, "--workers", "4")  # one worker per session, as the client
    url = f"http://127.0.0.1:{port}"
    # Rows are sessions in order and session n is homed on worker n % 4: warmed, the four
    # workers answer the rollout's calls without a worker's start (an import) in them.
    _warm(url, 4)
    # 1.5 s: far above a warm server's ordinary reply, half the slow one's 3 s.
    env = make("remote", url=url, timeout=1.5, retries=1, parallel_friendly=True, max_workers=4)[0]
    rollout = AgentRollout(env, None, tok, ONE)
    try:
        batch = rollout.collect(_answers(tok, ONE, lambda r, c: ["slow"] if r == 1 else ["win"]),
                                np.array([1, 2]), jax.random.key(0))
        errors = [t["env_error"] for t in batch.trajectories]
        assert errors[0] == errors[2] == errors[3] == "" and "no reply within the timeout" in errors[1]
        # The slow call holds its server worker until it returns: four sessions with a patient
        # client, one on each worker, answer once it has; the next episodes then owe nothing
        # to timing.
        _warm(url, 4)
        batch = rollout.collect(_answers(tok, ONE, lambda r, c: ["win"]), np.array([1, 2]),
                                jax.random.key(0))
        assert batch.success.all()
    finally:
        server.kill()
        server.wait()
        rollout.driver.close()


@pytest.fixture(scope="module")
def one_worker_server():
    """One single-worker server for every fault: a fault costs only its session, so each
    fault's test starts from a server that has survived the faults before it (a start of its
    own would be a JAX import per fault)."""
    port = _port()
    server = _serve("slow", port, "--workers", "1", "--param", "step_timeout=1.0")
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("fault", ["sleep", "segv", "abort", "boom"])
def test_a_served_env_that_hangs_or_crashes_costs_only_its_session(one_worker_server, fault):
    """The server's instances live in its worker processes: a session whose step never
    returns (killed past step_timeout), segfaults, aborts or raises gets an env error; the
    server stays up, the other sessions on the same worker go on where they were (rebuilt by
    replay), and a new session plays a full episode."""
    server, url = one_worker_server
    others = [RemoteEnv(url, timeout=10.0) for _ in range(2)]
    for seed, env in enumerate(others):
        env.reset(seed)
        assert env.step("go")[0] == f"seed {seed} move 1 go"
    faulty = RemoteEnv(url, timeout=10.0)
    faulty.reset(7)
    t0 = time.perf_counter()
    with pytest.raises(RemoteEnvError, match={
            "sleep": "timed out: an env call took over 1 s", "boom": "ValueError: boom",
            "segv": "died \\(killed by SIGSEGV\\)", "abort": "died \\(killed by SIGABRT\\)"}[fault]):
        faulty.step(fault)
    assert time.perf_counter() - t0 < 5
    assert server.poll() is None
    with pytest.raises(RemoteEnvError, match="no env instance"):  # its instance is gone
        faulty.step("go")
    for seed, env in enumerate(others):  # same worker, rebuilt by replay: move 2
        assert env.step("go")[0] == f"seed {seed} move 2 go"
    fresh = RemoteEnv(url, timeout=10.0)
    assert fresh.reset(9) == "seed 9" and fresh.step("win")[1:3] == (1.0, True)
    assert faulty.reset(8) == "seed 8"  # the failed session plays again after a reset
    # The server's processes: the fork server, one worker, the resource tracker at most.
    assert len(psutil.Process(server.pid).children(recursive=True)) <= 3
    for env in (*others, faulty, fresh):
        env.close()


def test_a_served_jax_env_follows_its_own_dynamics(port):
    """FrozenLake (slippery, at most 6 steps) served through ``JaxAsHost`` in the server's
    worker: for each seed and the same random actions, the observations, rewards, done and
    truncation flags, the level key and the held-out key are the env's own reset and steps
    with the keys the protocol documents (the seed's key, folded with the move count)."""
    from ragen_jax.envs import levels

    # A generous step_timeout (and a client's above it): a worker's first reset builds the env
    # and runs its first JAX ops, which a loaded machine can stretch past the default 30 s.
    server = _serve("frozenlake", port, "--param", "max_steps=6", "--param", "step_timeout=150")
    env, params = make("frozenlake", max_steps=6)
    remote = RemoteEnv(f"http://127.0.0.1:{port}", timeout=200.0)
    try:
        assert remote.action_names == tuple(env.action_names)
        rng = np.random.default_rng(0)
        finished = 0
        for seed in range(4):
            key = jax.random.key(seed)
            _, state = env.reset_env(key, params)
            assert remote.reset(seed) == env.render_text(state)
            assert remote.level_key() == f"{int(levels.as_uint64(levels.level_hash(env, state))):016x}"
            # In grid text FrozenLake holds out its map without the start.
            assert remote.holdout_key() == f"{int(levels.as_uint64(levels.holdout_hash(env, state))):016x}"
            assert remote.holdout_key() != remote.level_key()
            for move in range(1, 8):
                action = int(rng.integers(4))
                text, reward, done, info = remote.step(env.action_names[action])
                _, state, r, d, i = env.step_env(jax.random.fold_in(key, move), state, action, params)
                truncated = bool(env.is_truncated(state, params)) and not bool(d)
                assert (text, reward, done) == (env.render_text(state), float(r), bool(d) or truncated)
                assert info["success"] == bool(i.get("success", False)) and info["truncated"] == truncated
                if done:
                    finished += 1
                    break
        assert finished == 4  # every episode ended (a hole, the goal or the 6-step limit)
        remote.close()
    finally:
        server.kill()
        server.wait()
