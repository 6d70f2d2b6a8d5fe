"""The env server against a client that means harm, on 127.0.0.1: without the token nothing
is served, a body or an action over its limit is a 413, malformed or deep JSON a 400, a crafted
or foreign ``rng_state`` a 400 (never a worker crash), a finished episode refuses steps, an
episode's kept actions are bounded, sessions are capped per client (the token, else an
address range) and in all and idle ones expire, a non-loopback bind without a token does not
start; idle and half-sent requests are closed in bounded time and a flood of them shuts no
client out, the workers are shared round robin between client addresses, and a DELETE racing
a call leaves nothing behind. Small limits set by flags keep each probe to a few requests; the
probes that need client addresses off loopback or the server's insides run the app in this
process (``_in_process``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import time
from unittest import mock

import httpx
import numpy as np
import pytest

from ragen_jax.envs.host.family import HostEnvFamily
from ragen_jax.envs.host.remote import TOKEN_ENV, RemoteEnv, RemoteEnvError
from ragen_jax.envs.host.serve import Limits, client_range, make_app
from tests.rollout.faulty_envs import Faulty
from tests.rollout.test_remote_env import SERVER, _port, _serve

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


def test_with_a_token_the_token_is_the_client(capped):
    """Two sessions per client, and with a token every holder is one client: from three
    addresses, the third session is a 429; a closed one frees its place."""
    clients = [_client(capped, f"127.0.0.{i}") for i in (1, 2, 3)]
    try:
        held = [client.post("/sessions").json()["session"] for client in clients[:2]]
        _refused(clients[2].post("/sessions"), 429, "--max-sessions-per-client")
        assert clients[0].delete(f"/sessions/{held.pop()}").status_code == 200
        held.append(clients[2].post("/sessions").json()["session"])
        for sid in held:
            assert clients[0].delete(f"/sessions/{sid}").status_code == 200
    finally:
        for client in clients:
            client.close()


def test_four_loopback_addresses_are_one_client():
    """Without a token a client is an address range, all of loopback one: four loopback
    addresses together get the per-client cap (3 of the server's 8 sessions), each further
    session a 429, never the 503 of a full server."""
    port = _port()
    server = _serve("slow", port, "--max-sessions", "8", "--max-sessions-per-client", "3")
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0,
                            transport=httpx.HTTPTransport(local_address=f"127.0.0.{i}"))
               for i in (1, 2, 3, 4)]
    try:
        codes = [client.post("/sessions").status_code for _ in range(3) for client in clients]
        assert sorted(codes) == [200] * 3 + [429] * 9, codes
    finally:
        for client in clients:
            client.close()
        _stop(server)


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
                          capture_output=True, text=True, timeout=180)


def test_a_non_loopback_bind_needs_a_token_and_limits_must_be_sane(capsys, monkeypatch):
    """Refused before anything is bound or built, in one line: the command itself once (its
    exit status and stderr), each refusal through ``main`` in this process (a start of the
    command imports JAX: seven took over a minute on a busy machine)."""
    from ragen_jax.envs.host import serve

    done = _cli("--host", "0.0.0.0", "--port", str(_port()))
    assert done.returncode == 2 and "--host 0.0.0.0 is not loopback" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for args, text in [(("--host", "0.0.0.0"), "--host 0.0.0.0 is not loopback"),
                       (("--host", "::"), "not loopback"),
                       (("--max-body-bytes", "0"), "max_body_bytes must be > 0"),
                       (("--session-ttl", "nan"), "session_ttl must be > 0"),
                       (("--header-timeout", "0"), "header_timeout must be > 0"),
                       (("--max-connections", "99999999"), "open files"),
                       (("--token", "two words"), "visible ASCII")]:
        with pytest.raises(SystemExit) as stop:
            serve.main(["countdown", *args, "--port", str(_port())])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and text in err and len(err.splitlines()) == 1, (args, err)
    from ragen_jax.envs.host.serve import is_loopback

    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost")] == [True] * 4
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))


# -- connections: header and body timeouts, the connection cap --------------------------------

OPEN_FILES = 256  # the guarded server's open-file limit (what 40 connections need), under FLOOD
FLOOD = 400
HALF_SENT = b"POST /sessions HTTP/1.1\r\nHost: x\r\n"  # a request whose headers never end


@pytest.fixture(scope="module")
def guarded():
    """Faulty served with a token, 1 s header and body timeouts, at most 40 connections, in a
    process allowed 256 open files."""
    port = _port()

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (OPEN_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, "slow", "--port", str(port), "--token", TOKEN,
         "--header-timeout", "1", "--body-timeout", "1", "--max-connections", "40"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), preexec_fn=few_files)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.TransportError):
            httpx.get(f"{url}/info", timeout=1.0)
            break
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the guarded env server did not start")
        time.sleep(0.1)
    yield url, port
    _stop(server)


def _closed_by_server(sockets: list[socket.socket], within: float) -> bool:
    """Whether every socket reads its end (the server closed it) within ``within`` seconds."""
    deadline, left = time.monotonic() + within, set(sockets)
    while left and time.monotonic() < deadline:
        ready, _, _ = select.select(list(left), [], [], 0.5)
        for s in ready:
            with contextlib.suppress(OSError):  # a reset is a close as well
                if s.recv(4096):
                    continue
            left.discard(s)
    return not left


def test_a_flood_of_half_sent_requests_shuts_no_client_out_and_is_closed(guarded):
    """400 connections each holding half a request line (past the server's 256 open files):
    a token holder's request still gets in while they are held, and the server closes every
    one of them, the 40 it keeps once their 1 s header timeout passes."""
    url, port = guarded
    flood = []
    try:
        for _ in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(HALF_SENT)
            flood.append(s)
        with _client(url) as client:
            assert client.post("/sessions", timeout=10.0).status_code == 200
        assert _closed_by_server(flood, within=20.0)
    finally:
        for s in flood:
            s.close()


def _read_reply(s: socket.socket, within: float) -> bytes:
    """What the server sends on ``s`` until it closes it (or ``within`` seconds pass)."""
    deadline, got = time.monotonic() + within, b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s], [], [], 0.5)
        if ready:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


def test_a_body_slower_than_its_timeout_is_a_408_and_closed(guarded):
    """A step whose body stops after 12 of its declared 2**20 - 1 bytes is answered 408 after
    the 1 s body timeout and its connection closed, so it holds no memory for long."""
    url, port = guarded
    with _client(url) as client:
        sid = _session(client)
    head = (f"POST /sessions/{sid}/step HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {2**20 - 1}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b'{"action": "')
        reply = _read_reply(s, within=20.0)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--body-timeout" in reply


class _Conn:
    """A stand-in connection for ``ConnectionGuard``: a holder or not, open until closed."""

    def __init__(self, holder: bool):
        self.holder, self.closed, self.header_timer = holder, False, None
        self.loop = self.transport = self  # its own event loop and transport

    def call_later(self, delay, fn, *args):  # as the loop: a timer that never fires
        return mock.Mock()

    def close(self) -> None:  # as the transport
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_the_connection_cap_closes_anonymous_idle_connections_first():
    """At the cap, a new connection closes the longest-waiting anonymous one, not a token
    holder's idle one, nor one inside a request; when only holders' are left idle, the new
    one is refused."""
    from ragen_jax.envs.host.connections import ConnectionGuard

    guard = ConnectionGuard(10.0, 3, TOKEN)
    holder, busy, anon = _Conn(True), _Conn(False), _Conn(False)
    for conn in (holder, busy, anon):
        guard.opened(conn)
    guard.waiting.pop(busy)  # its headers are in (as update() does)
    newcomer = _Conn(False)
    guard.opened(newcomer)
    assert anon.closed and not (holder.closed or busy.closed or newcomer.closed)
    guard.waiting.pop(newcomer)
    last = _Conn(False)
    guard.opened(last)
    assert last.closed and not holder.closed and guard.open == {holder, busy, newcomer}


# -- the app in this process: client addresses off loopback, the server's state ---------------


@contextlib.asynccontextmanager
async def _in_process(**limits):
    """Faulty served by the app in this process on one worker, without a token."""
    app = make_app(HostEnvFamily(Faulty), workers=1, limits=Limits(**limits))
    async with app.router.lifespan_context(app):
        yield app


def _from(app, address: str) -> httpx.AsyncClient:
    """A client of ``app`` whose requests come from ``address``."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, client=(address, 40000)),
                             base_url="http://server", timeout=30.0)


async def _until(condition, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def test_client_ranges():
    assert client_range("10.1.2.3") == client_range("10.1.2.250") == "10.1.2.0/24"
    assert client_range("10.1.3.3") != client_range("10.1.2.3")
    assert client_range("2001:db8::1") == client_range("2001:db8::ffff:1") == "2001:db8::/64"
    assert client_range("2001:db8:0:1::1") != client_range("2001:db8::1")
    assert client_range("::ffff:10.1.2.3") == "10.1.2.0/24"
    assert {client_range(h) for h in ("127.0.0.1", "127.9.8.7", "::1", "::ffff:127.0.0.2")} == {"loopback"}


def test_sessions_are_capped_per_address_range_and_in_all():
    """Two sessions per range, six in all: a third from a /24 (another address in it) is a
    429 while other ranges still get theirs, IPv6 by /64; the seventh anywhere is a 503."""
    order = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "2001:db8::1", "2001:db8::2", "2001:db8::2",
             "10.0.1.1", "10.0.2.1", "10.0.3.1"]

    async def probe():
        async with _in_process(max_sessions=6, max_sessions_per_client=2) as app:
            got = {}
            for address in order:
                async with _from(app, address) as client:
                    got.setdefault(address, []).append((await client.post("/sessions")).status_code)
            return got

    assert asyncio.run(probe()) == {"10.0.0.1": [200, 200], "10.0.0.2": [429], "2001:db8::1": [200],
                                    "2001:db8::2": [200, 429], "10.0.1.1": [200], "10.0.2.1": [200],
                                    "10.0.3.1": [503]}


def test_the_fair_queue_takes_clients_in_turn_each_in_order():
    from ragen_jax.envs.host.pool_service import FairQueue

    queue = FairQueue()
    for item in ("a1", "a2", "a3", "b1", "b2"):
        queue.put(item[0], item)
    taken = [queue.take() for _ in range(3)]
    queue.put("c", "c1")  # a newcomer joins behind the clients waiting
    taken += [queue.take() for _ in range(3)]
    assert taken == ["a1", "b1", "a2", "b2", "a3", "c1"] and not queue


def test_a_client_with_many_slow_calls_delays_another_by_one():
    """Eight sessions of one address each step ``pause`` (0.3 s) on the only worker; a reset of
    another address sent once those are queued is served after at most two more of them (the
    one running and the next, round robin), not after all eight."""
    async def probe():
        async with _in_process() as app:
            service = app.state.server.service
            greedy, other = _from(app, "127.0.0.2"), _from(app, "127.0.0.1")
            sids = [(await greedy.post("/sessions")).json()["session"] for _ in range(8)]
            for sid in sids:
                assert (await greedy.post(f"/sessions/{sid}/reset", json={"seed": 0})).status_code == 200
            mine = (await other.post("/sessions")).json()["session"]
            finished = []

            async def call(client, path, body, label):
                reply = await client.post(path, json=body)
                assert reply.status_code == 200, reply.text
                finished.append(label)

            steps = [asyncio.create_task(call(greedy, f"/sessions/{sid}/step", {"action": "pause"}, "step"))
                     for sid in sids]
            # All eight queued: one running, the rest waiting (or, on a slow machine, done).
            await _until(lambda: service.backlog() + len(finished) >= 7)
            before = len(finished)
            await call(other, f"/sessions/{mine}/reset", {"seed": 1}, "reset")
            await asyncio.gather(*steps)
            await greedy.aclose()
            await other.aclose()
            return before, finished

    before, finished = asyncio.run(probe())
    assert before <= 5 and finished.index("reset") <= before + 2, (before, finished)


def test_a_delete_racing_a_call_leaves_no_history():
    """200 rounds of a session's reset (or step) and its DELETE sent together, in both
    orders: afterwards the server holds no session and no history."""
    async def probe():
        async with _in_process() as app:
            server = app.state.server
            async with _from(app, "127.0.0.1") as client:
                for n in range(200):
                    sid = (await client.post("/sessions")).json()["session"]
                    if n % 4 == 3:  # a step racing the DELETE: the session needs an episode
                        await client.post(f"/sessions/{sid}/reset", json={"seed": n})
                        call = client.post(f"/sessions/{sid}/step", json={"action": "go"})
                    else:
                        call = client.post(f"/sessions/{sid}/reset", json={"seed": n})
                    delete = client.delete(f"/sessions/{sid}")
                    replies = await asyncio.gather(*((call, delete) if n % 2 else (delete, call)))
                    assert all(r.status_code in (200, 404) for r in replies), [r.text for r in replies]
                await _until(lambda: server.service.backlog() == 0)
                return len(server.sessions), len(server.histories.rows)

    assert asyncio.run(probe()) == (0, 0)
