"""The HTTP env protocol on 127.0.0.1: a served Countdown plays exactly as the in-process one,
a server killed mid-episode costs that episode and the next rollout plays on against its
restart, and a reply slower than the client's timeout costs its episode only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout, RolloutConfig
from ragen_jax.rollout.scripted import answer_text

pytestmark = pytest.mark.timeout(90)

ONE = RolloutConfig(env_groups=2, group_size=2, max_turn=1, max_actions_per_traj=1,
                    max_actions_per_turn=1, response_length=32, enable_think=False)
SERVER = ("import sys; from ragen_jax.envs import register; from ragen_jax.envs.serve import main; "
          "from tests.rollout.faulty_envs import Slow; register('slow', Slow); main(sys.argv[1:])")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(env: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-c", SERVER, env, "--port", str(port)],
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/info", timeout=1.0)
            return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("the env server did not start")


@pytest.fixture
def port():
    return _port()


def _answers(tok, cfg, texts):
    return ScriptedPolicy.from_texts(tok, lambda row, call: answer_text(texts(row, call), cfg.context))


def test_a_served_countdown_plays_as_the_in_process_one(tok, port):
    server = _serve("countdown", port)
    try:
        batches = []
        for env in (make("countdown")[0], make("remote", url=f"http://127.0.0.1:{port}")[0]):
            rollout = AgentRollout(env, None, tok, ONE, tag="Countdown")
            batches.append(rollout.collect(_answers(tok, ONE, lambda r, c: ["1 + 2 + 3"]),
                                           np.array([5, 6]), jax.random.key(0)))
            rollout.driver.close()
        local, remote = batches
        assert (local.input_ids == remote.input_ids).all() and (local.scores == remote.scores).all()
        strip = lambda t: {k: v for k, v in t.items() if k != "tag"}  # noqa: E731
        assert [strip(t) for t in local.trajectories] == [strip(t) for t in remote.trajectories]
        assert [e.level for e in local.episodes] == [e.level for e in remote.episodes]
    finally:
        server.kill()
        server.wait()


def test_a_server_killed_mid_episode_costs_that_episode(tok, port):
    cfg = RolloutConfig(env_groups=1, group_size=2, max_turn=2, max_actions_per_traj=4,
                        max_actions_per_turn=1, response_length=32, enable_think=False)
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
    server = _serve("slow", port)
    env = make("remote", url=f"http://127.0.0.1:{port}", timeout=0.5, retries=1,
               parallel_friendly=True, max_workers=4)[0]
    rollout = AgentRollout(env, None, tok, ONE)
    try:
        t0 = time.perf_counter()
        batch = rollout.collect(_answers(tok, ONE, lambda r, c: ["slow"] if r == 1 else ["win"]),
                                np.array([1, 2]), jax.random.key(0))
        assert time.perf_counter() - t0 < 10
        errors = [t["env_error"] for t in batch.trajectories]
        assert errors[0] == errors[2] == errors[3] == "" and "no reply within the timeout" in errors[1]
        batch = rollout.collect(_answers(tok, ONE, lambda r, c: ["win"]), np.array([1, 2]),
                                jax.random.key(0))
        assert batch.success.all()
    finally:
        server.kill()
        server.wait()
        rollout.driver.close()
