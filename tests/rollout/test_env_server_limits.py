"""The env server against a client that means harm, on 127.0.0.1: without the token nothing
is served, a body or an action over its limit is a 413, malformed or deep JSON a 400, a crafted
or foreign ``rng_state`` a 400 (never a worker crash), a finished episode refuses steps, an
episode's kept actions are bounded, sessions are capped per client and in all and idle ones
expire, and a non-loopback bind without a token does not start. Small limits set by flags keep
each probe to a few requests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from unittest import mock

import httpx
import numpy as np
import pytest

from ragen_jax.envs.host.remote import TOKEN_ENV, RemoteEnv, RemoteEnvError
from tests.rollout.test_remote_env import _port, _serve

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _start(env: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A server whose token comes from the environment (``--token`` is the caps server's)."""
    port = _port()
    with mock.patch.dict(os.environ, {TOKEN_ENV: TOKEN}):
        server = _serve(env, port, *args)
    return server, f"http://127.0.0.1:{port}"


def _client(url: str, address: str = "127.0.0.1") -> httpx.Client:
    """A client holding the token, its requests from ``address`` (any 127.x is this machine)."""
    return httpx.Client(base_url=url, headers=AUTH, timeout=30.0,
                        transport=httpx.HTTPTransport(local_address=address))


def _stop(server: subprocess.Popen) -> None:
    assert server.poll() is None, "the server died"
    server.kill()
    server.wait()


@pytest.fixture(scope="module")
def countdown():
    """Countdown served with the default limits (a token from the environment)."""
    server, url = _start("countdown")
    yield url
    _stop(server)


def _session(client: httpx.Client, seed: int = 0) -> str:
    sid = client.post("/sessions").json()["session"]
    assert client.post(f"/sessions/{sid}/reset", json={"seed": seed}).status_code == 200
    return sid


def _refused(reply: httpx.Response, status: int, text: str) -> None:
    assert reply.status_code == status, reply.text
    assert text in reply.json()["error"]


def test_without_the_token_nothing_is_served(countdown, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        _refused(httpx.get(f"{countdown}/info", headers=headers), 401, "Authorization: Bearer")
        _refused(httpx.post(f"{countdown}/sessions", headers=headers), 401, "Authorization")
    with pytest.raises(RemoteEnvError, match="HTTP 401"):
        RemoteEnv(countdown)
    for env in (RemoteEnv(countdown, token=TOKEN), None):
        if env is None:  # the token from the trainer's environment
            monkeypatch.setenv(TOKEN_ENV, TOKEN)
            env = RemoteEnv(countdown)
        assert env.reset(3).startswith("Target:") and env.step("1 + 2")[2] is True
        env.close()


def test_a_finished_episode_refuses_steps(countdown):
    with _client(countdown) as client:
        sid = _session(client)
        assert client.post(f"/sessions/{sid}/step", json={"action": "1 + 2"}).json()["done"]
        for _ in range(2):
            _refused(client.post(f"/sessions/{sid}/step", json={"action": "1 + 2"}), 409,
                     "the episode is over")
        assert client.post(f"/sessions/{sid}/reset", json={"seed": 1}).status_code == 200
        assert client.post(f"/sessions/{sid}/step", json={"action": "1 + 2"}).status_code == 200
        client.delete(f"/sessions/{sid}")


def test_a_body_or_an_action_over_its_limit_is_a_413(countdown):
    """1 MiB bodies and 65536-character actions (the defaults): over them, refused whether
    the body says its length or arrives in chunks; at them, played."""
    with _client(countdown) as client:
        sid = _session(client)
        step = f"/sessions/{sid}/step"
        big = b'{"action": "' + b"1" * 2**21 + b'"}'
        _refused(client.post(step, content=big), 413, "--max-body-bytes")
        _refused(client.post(step, content=(big[i:i + 2**16] for i in range(0, len(big), 2**16))),
                 413, "--max-body-bytes")
        _refused(client.post(step, json={"action": "1" * 65537}), 413, "--max-action-chars")
        assert client.post(step, json={"action": "1" * 65536}).json()["done"]
        client.delete(f"/sessions/{sid}")


def test_malformed_or_deep_json_is_a_400(countdown):
    deep = b"[" * 100_000 + b"]" * 100_000  # 200 KB, under the body limit
    with _client(countdown) as client:
        sid = _session(client)
        for path, body, text in [
                ("reset", deep, "nested too deeply"), ("step", b'{"action": ' + deep + b"}", "nested"),
                ("step", b'{"action": "1 +', "JSON"), ("step", b"\xff\xfe\x00", "JSON"),
                ("step", b'["1 + 2"]', "JSON object"), ("step", b'{"action": 3}', "must be a str"),
                ("reset", b'{"seed": ' + b"9" * 5000 + b"}", "JSON"),
                ("reset", b'{"seed": 18446744073709551616}', "'seed' must be in"),
                ("reset", b'{"seed": true}', "must be a int")]:
            _refused(client.post(f"/sessions/{sid}/{path}", content=body), 400, text)
        assert client.post(f"/sessions/{sid}/step", json={"action": "1 + 2"}).json()["done"]
        client.delete(f"/sessions/{sid}")


def _plain(state):
    """A bit generator's state as JSON would carry it (arrays as lists)."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    return state.tolist() if isinstance(state, np.ndarray) else state


def test_rng_state_is_a_checked_pcg64_state(countdown):
    """Only the state of the generator the rollout uses (PCG64) is built, from checked
    fields: a crafted MT19937 position (which numpy's setter would trust and read past its key
    with), valid states of the other generators, and PCG64 states with fields out of range or
    of the wrong type are 400s; the session's worker is unhurt (a real state still draws)."""
    pcg = np.random.default_rng(5).bit_generator.state
    bad = [{"bit_generator": "MT19937", "state": {"key": [1] * 624, "pos": 1_000_000_000}},
           *(_plain(kind(0).state) for kind in (np.random.MT19937, np.random.SFC64, np.random.Philox)),
           {**pcg, "state": {"state": 2**128, "inc": 1}}, {**pcg, "state": {"state": -1, "inc": 1}},
           {**pcg, "state": {"state": 1}}, {**pcg, "state": [1, 2]}, {**pcg, "has_uint32": True},
           {**pcg, "uinteger": 2**32}, {**pcg, "bit_generator": "RandomState"}]
    with _client(countdown) as client:
        sid = _session(client)
        for state in bad:
            _refused(client.post(f"/sessions/{sid}/random_action", json={"rng_state": state}), 400,
                     "'rng_state'")
        reply = client.post(f"/sessions/{sid}/random_action", json={"rng_state": pcg})
        assert reply.status_code == 200 and reply.json()["rng_state"] != pcg
        assert client.post(f"/sessions/{sid}/step", json={"action": "1 + 2"}).status_code == 200
        client.delete(f"/sessions/{sid}")


@pytest.fixture(scope="module")
def capped():
    """Faulty (``go`` plays on, ``win`` ends) served with small limits and ``--token``."""
    port = _port()
    server = _serve("slow", port, "--token", TOKEN, "--max-sessions", "5",
                    "--max-sessions-per-client", "2", "--max-action-chars", "100",
                    "--max-history-bytes", "400")
    yield f"http://127.0.0.1:{port}"
    _stop(server)


def test_sessions_are_capped_per_client_and_in_all(capped):
    """Two sessions per client address, five in all: a third from one address is a 429 while
    other addresses still get theirs, the sixth anywhere a 503; a closed one frees its place."""
    clients = [_client(capped, f"127.0.0.{i}") for i in (1, 2, 3)]
    try:
        held = [[client.post("/sessions").json()["session"] for _ in range(2)]
                for client in clients[:2]]
        _refused(clients[0].post("/sessions"), 429, "--max-sessions-per-client")
        held.append([clients[2].post("/sessions").json()["session"]])
        _refused(clients[2].post("/sessions"), 503, "at most 5 sessions")
        clients[0].delete(f"/sessions/{held[0].pop()}")
        held[0].append(clients[0].post("/sessions").json()["session"])
        for client, sids in zip(clients, held, strict=True):
            for sid in sids:
                assert client.delete(f"/sessions/{sid}").status_code == 200
    finally:
        for client in clients:
            client.close()


def test_an_episodes_kept_actions_are_bounded(capped):
    """Each kept action costs its Python size plus a list slot (59 bytes for ``go``): under
    400 bytes, six ``go`` steps are played and the seventh is a 413 until a reset; an action
    over 100 characters is a 413 at once."""
    with _client(capped) as client:
        sid = _session(client)
        step = f"/sessions/{sid}/step"
        _refused(client.post(step, json={"action": "g" * 101}), 413, "--max-action-chars")
        for move in range(1, 7):
            assert client.post(step, json={"action": "go"}).json()["observation"] == f"seed 0 move {move} go"
        _refused(client.post(step, json={"action": "go"}), 413, "--max-history-bytes")
        assert client.post(f"/sessions/{sid}/reset", json={"seed": 1}).status_code == 200
        assert client.post(step, json={"action": "win"}).json()["done"]
        client.delete(f"/sessions/{sid}")


def test_an_idle_session_expires_and_frees_its_place():
    server, url = _start("slow", "--max-sessions-per-client", "1", "--session-ttl", "1")
    try:
        with _client(url) as client:
            sid = _session(client)
            _refused(client.post("/sessions"), 429, "--max-sessions-per-client")
            time.sleep(1.5)
            assert client.post("/sessions").status_code == 200  # the idle one was closed
            _refused(client.post(f"/sessions/{sid}/step", json={"action": "go"}), 404, "unknown")
    finally:
        _stop(server)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return subprocess.run([sys.executable, "-m", "ragen_jax.envs.host.serve", "countdown", *args],
                          env=dict(environ, PYTHONPATH=os.pathsep.join(sys.path), **env),
                          capture_output=True, text=True, timeout=20)


def test_a_non_loopback_bind_needs_a_token_and_limits_must_be_sane():
    """Refused before anything is bound or built, in one line."""
    for args, text in [(("--host", "0.0.0.0"), "--host 0.0.0.0 is not loopback"),
                       (("--host", "::"), "not loopback"),
                       (("--max-body-bytes", "0"), "max_body_bytes must be > 0"),
                       (("--session-ttl", "nan"), "session_ttl must be > 0"),
                       (("--token", "two words"), "visible ASCII")]:
        done = _cli(*args, "--port", str(_port()))
        assert done.returncode == 2 and text in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    from ragen_jax.envs.host.serve import is_loopback

    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost")] == [True] * 4
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))
