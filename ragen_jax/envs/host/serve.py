"""Serve any registered env over HTTP: ``python -m ragen_jax.envs.host.serve ENV [--port 8000]``.

The protocol (JSON bodies, one env instance per session; ``ragen_jax.envs.host.remote.RemoteEnv``
is its client, the ``remote`` env of a run):

* ``GET /info`` -> ``{"name", "instruction", "action_names"}``;
* ``POST /sessions`` -> ``{"session"}``: a new session (its instance is built at its first
  reset);
* ``POST /sessions/{id}/reset`` ``{"seed": int}`` -> ``{"observation", "action_names",
  "level_key", "holdout_key"}``: the same seed, the same episode; ``level_key`` is the level's
  identity (``envs.levels``: a host env's ``level_key()`` or its first observation, a JAX
  env's level hash in hex) and ``holdout_key`` what held-out validation compares (a host
  env's ``holdout_key()``, else its level key; a JAX env's ``levels.holdout_hash`` in hex:
  Sokoban's room);
* ``POST /sessions/{id}/step`` ``{"action": str}`` -> ``{"observation", "reward", "done",
  "info": {"success", "truncated", "action_is_effective"}, "action_names"}``;
* ``POST /sessions/{id}/random_action`` ``{"rng_state": dict}`` -> ``{"action",
  "rng_state"}``: the format warm-start's random answer, drawn with a numpy ``Generator`` in
  the state the client sent (``bit_generator.state``), whose state after the draw comes
  back, so a served env draws the same answers as the same env in-process;
* ``DELETE /sessions/{id}``.

An env error (the env raised, hung past ``step_timeout`` or crashed) is ``500 {"error": "Type:
message"}``; an unknown session is ``404``. ``reset``, ``random_action`` and ``DELETE`` are
idempotent (a client may retry them); ``step`` is not. A session idle for longer than
``--session-ttl`` seconds is closed (a client that dropped a session without closing it, for
instance after an env error, does not hold it forever; ``RemoteEnv`` opens a new session when a
reset finds its own gone).

Any client that reaches the port can call it, so the server bounds what one can take
(``Limits``: each a flag, its default in parentheses) and refuses the rest with a one-line
``{"error"}``:

* a body over ``--max-body-bytes`` (1 MiB) is ``413``; a body that is not a JSON object
  (malformed, or nested deeper than the JSON parser recurses) is ``400``, as is a field of the
  wrong type (``seed`` an int in [-2**63, 2**64));
* a client holding ``--max-sessions-per-client`` sessions (1024) gets ``429`` for the next,
  and the server holding ``--max-sessions`` (4096) ``503``; sessions idle for
  ``--session-ttl`` seconds (600) are closed first, so abandoned ones free their places. A
  client is what one party cannot multiply: with a token, the token (all its holders count as
  one); without, an address range (``client_range``: an IPv4 /24, an IPv6 /64, and every
  loopback address as one, since any local process can send from any 127.x); behind a proxy,
  every client is the proxy's;
* a connection must send a request's headers within ``--header-timeout`` seconds (10) of
  opening or of its last response, and a request's body must arrive within
  ``--body-timeout`` seconds (30), else ``408`` (the connection is closed); at most
  ``--max-connections`` (512) are open, a new one past it closing the connection waiting
  longest between requests, those that never carried the token first, never one inside a
  request (``envs.host.connections``); so idle or half-sent requests hold neither file
  descriptors nor memory for long, and a client that sends its request at once gets in;
* a session keeps the actions played since its reset, to rebuild its instance by replay if
  its worker dies; so an action over ``--max-action-chars`` characters (65536) is ``413``, an
  episode whose kept actions would pass ``--max-history-bytes`` (256 KiB, as Python sizes the
  strings: an ASCII action costs its length plus 57) is ``413``, and a step on a finished
  episode is ``409`` (reset it to play another);
* ``rng_state`` must be a ``PCG64`` state (numpy's ``default_rng``, what the rollout uses),
  every field an int in its range; anything else is ``400``: other bit generators' states are
  never built, as numpy's setters trust them (a crafted MT19937 position crashes the worker);
* with a token (``--token`` or the ``RAGEN_JAX_ENV_TOKEN`` environment variable), every
  request needs ``Authorization: Bearer TOKEN`` (``401`` without it; compared in constant
  time). The default bind is loopback; any other ``--host`` refuses to start without a token.
  ``RemoteEnv`` sends its ``token`` param or the same environment variable (which keeps it
  out of the run's saved config).

The instances live in worker processes (``envs.host.processes``), not in the server: a session is a
row of a ``ProcessPool`` of ``--workers`` processes (default: the env's ``max_workers`` if it is
``parallel_friendly``, else 1), driven by one thread (``PoolService``) while the event loop
serves requests. A call past ``step_timeout`` has its worker killed and a crash of a worker
costs the call it was running; either way that session's call is an env error, the server
stays up, and the other sessions homed on that worker are rebuilt by replaying their seed and
actions on the fresh worker (their calls wait meanwhile, so a client's timeout should exceed
the server's ``step_timeout``). Each session's calls run one at a time, in order.

The calls waiting for a worker go to it round robin across client addresses (``PoolService``),
each address's in order: a client with many sessions in slow calls delays another address's
call by one of those calls at most, not by all of them. So a call waits for its worker at most
a ``step_timeout`` for the call running there and one per other address with calls queued
there, then runs its own: a client's timeout should cover that (``RemoteEnv``'s ``timeout``,
30 s by default, the default ``step_timeout``: raise it for a server shared with other
clients stepping slow envs).

A JAX env is played one session at a time through ``JaxAsHost`` (its action names as the
actions; each step's key folds the seed with the step count, so a served JAX episode is
reproducible but not the in-process rollout's, whose keys come from the rollout's key); its
workers run JAX on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import hmac
import ipaddress
import itertools
import json
import math
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ragen_jax.envs import levels
from ragen_jax.envs.host.env import HostEnv
from ragen_jax.envs.host.family import HostEnvFamily
from ragen_jax.envs.host.pool_service import PoolService
from ragen_jax.envs.host.processes import Histories, Job, ProcessPool, TurnProgress
from ragen_jax.envs.host.remote import TOKEN_ENV


class JaxAsHost(HostEnv):
    """A JAX ``TextEnv`` behind the host-env contract, one unbatched episode at a time."""

    def __init__(self, env: Any, params: Any):
        import jax

        self.env, self.params, self.jax = env, params, jax
        self.action_names = tuple(env.action_names)
        self.state, self.seed, self.moves = None, 0, 0

    @property
    def name(self) -> str:
        return type(self.env).__name__

    def reset(self, seed: int) -> str:
        jax = self.jax
        self.seed, self.moves = int(seed), 0
        _, self.state = self.env.reset_env(jax.random.key(self.seed), self.params)
        self.action_names = tuple(self.env.action_names_for(self.state))
        return self.env.render_text(self.state)

    def level_key(self) -> str:
        return f"{int(levels.as_uint64(levels.level_hash(self.env, self.state))):016x}"

    def holdout_key(self) -> str:
        return f"{int(levels.as_uint64(levels.holdout_hash(self.env, self.state))):016x}"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        jax = self.jax
        lookup = {n.strip().lower(): i for i, n in enumerate(self.action_names)}
        if action.strip().lower() not in lookup:
            raise ValueError(f"unknown action {action[:50]!r}; actions: {', '.join(self.action_names)}")
        self.moves += 1
        key = jax.random.fold_in(jax.random.key(self.seed), self.moves)
        _, self.state, reward, done, info = self.env.step_env(
            key, self.state, lookup[action.strip().lower()], self.params)
        truncated = bool(self.env.is_truncated(self.state, self.params)) and not bool(done)
        out = {"success": bool(info.get("success", False)), "truncated": truncated,
               "action_is_effective": bool(info.get("action_is_effective", True))}
        return self.env.render_text(self.state), float(reward), bool(done) or truncated, out


def served_jax_env(name: str, params: dict[str, Any]) -> JaxAsHost:
    """One instance of the registered JAX env ``name``, built in a worker process (module
    level so it pickles), with JAX on the CPU: a worker plays one unbatched episode at a time,
    and an accelerator's memory is the trainer's."""
    if "jax" not in sys.modules:  # the worker's first instance: JAX is imported by make below
        os.environ["JAX_PLATFORMS"] = "cpu"
    from ragen_jax.envs.registry import make

    env, env_params = make(name, **params)
    return JaxAsHost(env, env_params)


def env_family(name: str, params: dict[str, Any]) -> HostEnvFamily:
    """The served env ``name`` with ``params`` as a host-env family whose instances run in
    worker processes (a JAX env through ``JaxAsHost``); ``HOST_OPTIONS`` in ``params``
    (``step_timeout``, ``memory_limit_mb``, ...) are the family's."""
    from ragen_jax.envs.base import TextEnv
    from ragen_jax.envs.registry import HOST_OPTIONS, REGISTRY, make

    if params.get("isolation", "process") != "process":
        raise ValueError("the server always runs its envs in worker processes; drop isolation")
    cls = REGISTRY.get(name)
    if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
        return make(name, **params)[0]
    options = {k: v for k, v in params.items() if k in HOST_OPTIONS}
    rest = {k: v for k, v in params.items() if k not in HOST_OPTIONS}
    make(name, **rest)  # an unknown parameter is an error here, not in every worker
    return HostEnvFamily(functools.partial(served_jax_env, name, rest), **options)


NO_INSTANCE = "no env instance for this session (reset it: a failed call drops its instance)"
SEED_RANGE = (-2**63, 2**64)  # any int64 or uint64 seed; a longer int is refused, not parsed by the env
SLOT_BYTES = 8  # the list slot each kept action takes besides its string
CLIENT_PREFIX = {4: 24, 6: 64}  # the prefix length of a client's address range, by IP version
FD_RESERVE = 64  # file descriptors besides the connections: listening socket, event loop, stdio
# Connections the kernel queues for accepting. asyncio accepts up to this many in one go before
# the connection guard sees any, so the open files must hold them besides max_connections.
ACCEPT_BACKLOG = 128
FD_PER_WORKER = 3  # each worker process's pipe, its sentinel and a spare, in the server


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may take from the server (the module docstring says why each exists).

    The defaults fit a trainer: it holds one session per rollout row (training, validation and
    the warm-start's, a few hundred), its actions are a model's answers (a few thousand
    characters at most), and it is idle between turns for a generation's time (seconds to a
    minute), which ``session_ttl`` must exceed or a slow turn loses its episode. Its requests
    arrive whole at once (``header_timeout`` and ``body_timeout`` are for a slow network), one
    in flight per rollout worker and each on a connection uvicorn closes after 5 idle seconds,
    so it holds far fewer than ``max_connections``.
    """

    max_sessions: int = 4096
    max_sessions_per_client: int = 1024
    session_ttl: float = 600.0  # seconds
    max_body_bytes: int = 2**20
    max_action_chars: int = 65536
    max_history_bytes: int = 2**18
    header_timeout: float = 10.0  # seconds for a request's headers
    body_timeout: float = 30.0  # seconds for a request's body
    max_connections: int = 512  # under the usual 1024 file descriptors, with room for the pool's

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{field.name} must be > 0 and finite, got {value}")


class _Session:
    def __init__(self, row: int, owner: str, address: str):
        self.row, self.lock = row, asyncio.Lock()
        self.owner = owner  # the client its place counts for (the token, or an address range)
        self.address = address  # its creator's address, whose share of the workers it takes
        self.used = time.monotonic()
        self.done = False  # the episode ended: steps are refused until a reset
        self.kept = 0  # bytes of the actions kept since the reset (for replay)
        self.closed = False  # deleted or expired: whatever still finishes is not recorded


class _EnvServer:
    """The server's state and endpoints: sessions (each a row of the pool), their histories
    (for rebuilding a crashed worker's rows) and the pool's driver thread."""

    def __init__(self, family: HostEnvFamily, workers: int, limits: Limits, has_token: bool):
        self.service = PoolService(ProcessPool(family.factory, workers, family.step_timeout,
                                               memory_limit_mb=family.memory_limit_mb))
        self.info = {k: family.info[k] for k in ("name", "instruction")}
        self.info["action_names"] = list(family.info.get("action_names", ()))
        self.limits, self.has_token = limits, has_token
        self.sessions: dict[str, _Session] = {}
        self.per_client: collections.Counter[str] = collections.Counter()
        self.histories = Histories()  # touched on the event loop's thread only
        self.rows = itertools.count()

    async def run(self, session: _Session, job: Job, record: Callable[[Job], None]) -> Job:
        """Runs ``job`` for ``session`` in the pool; ``record`` keeps its outcome in
        ``histories`` on the event loop, even when the request that asked for it is gone, but
        not once the session is closed (its row would keep a history nobody owns)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def finish(job: Job) -> None:
            if not session.closed:
                record(job)
            if not future.done():
                future.set_result(job)

        self.service.submit(job, lambda job: loop.call_soon_threadsafe(finish, job),
                            session.address)
        return await future

    def expire(self) -> None:
        now = time.monotonic()
        for sid, session in list(self.sessions.items()):
            if now - session.used > self.limits.session_ttl and not session.lock.locked():
                self.close_session(sid)

    def close_session(self, sid: str) -> None:
        """Closes the session: its place is freed and its instance dropped, after any call of
        its already queued (the drop is queued behind them)."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.closed = True
            self.per_client[session.owner] -= 1
            if self.per_client[session.owner] <= 0:
                del self.per_client[session.owner]
            self.histories.rows.pop(session.row, None)
            self.service.submit(Job("drop", session.row, ()), lambda job: None, session.address)

    # Endpoints without a session body.

    async def get_info(self, request: Any) -> Any:
        return _json(self.info)

    async def create(self, request: Any) -> Any:
        self.expire()
        limits = self.limits
        address = request.client.host if request.client else ""
        # Every request here carries the token when there is one (_Authorize).
        client = "token" if self.has_token else client_range(address)
        if self.per_client[client] >= limits.max_sessions_per_client:
            return _error(429, f"this client holds {limits.max_sessions_per_client} sessions, the "
                               "server's limit per client (--max-sessions-per-client): close one "
                               "(DELETE /sessions/ID) or wait for idle ones to expire")
        if len(self.sessions) >= limits.max_sessions:
            return _error(503, f"at most {limits.max_sessions} sessions")
        sid = uuid.uuid4().hex
        self.sessions[sid] = _Session(next(self.rows), client, address)
        self.per_client[client] += 1
        return _json({"session": sid})

    async def close(self, request: Any) -> Any:
        self.close_session(request.path_params["sid"])
        return _json({})

    def call(self, fn: Callable[[_Session, dict[str, Any]], Any]) -> Callable:
        """The endpoint that runs ``fn(session, body)`` for the request's session, one call at a
        time per session; a ``str`` reply is the env's error (500), a ``_Refused`` the
        client's."""
        async def endpoint(request: Any) -> Any:
            session = self.sessions.get(request.path_params["sid"])
            if session is None:
                return _error(404, "unknown session")
            try:
                body = await _body(request, self.limits)
            except _Refused as e:
                return _refusal(e)
            async with session.lock:
                if session.closed:  # while this request waited: no job may follow its drop
                    return _error(404, "unknown session")
                session.used = time.monotonic()
                try:
                    reply = await fn(session, body)
                except _Refused as e:
                    return _refusal(e)
                session.used = time.monotonic()
            if isinstance(reply, str):
                return _error(500, reply)
            return _json(reply)
        return endpoint

    # A session's calls: (session, body) -> the reply's JSON, or the env's error as a str.

    async def reset(self, session: _Session, body: dict[str, Any]) -> dict[str, Any] | str:
        seed = _field(body, "seed", int)
        if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise _Refused("'seed' must be in [-2**63, 2**64)")
        job = await self.run(session, Job("reset", session.row, (seed,)), self.histories.reset_done)
        session.done, session.kept = False, 0
        if job.error:
            return job.error
        text, names, (level, held) = job.value
        return {"observation": text, "action_names": list(names), "level_key": level, "holdout_key": held}

    async def step(self, session: _Session, body: dict[str, Any]) -> dict[str, Any] | str:
        action = _field(body, "action", str)
        limits, row = self.limits, session.row
        if session.done:
            raise _Refused("the episode is over: reset the session to play another", 409)
        if len(action) > limits.max_action_chars:
            raise _Refused(f"the action has {len(action)} characters, over the server's limit of "
                           f"{limits.max_action_chars} (--max-action-chars)", 413)
        if row not in self.histories.rows:
            return NO_INSTANCE
        cost = sys.getsizeof(action) + SLOT_BYTES
        if session.kept + cost > limits.max_history_bytes:
            raise _Refused(f"the episode's actions would take {session.kept + cost} bytes on the "
                           f"server, over its limit of {limits.max_history_bytes} "
                           "(--max-history-bytes): reset the session", 413)
        job = await self.run(session, self.histories.job("step", row, ([action],)),
                             self.histories.step_done)
        if job.error:
            return job.error
        p: TurnProgress = job.progress
        session.kept += cost
        session.done = p.done
        return {"observation": p.text, "reward": p.reward, "done": p.done,
                "info": {"success": p.success, "truncated": p.truncated,
                         "action_is_effective": bool(p.effective)},
                "action_names": list(job.value)}

    async def random_action(self, session: _Session, body: dict[str, Any]) -> dict[str, Any] | str:
        rng = _generator(_field(body, "rng_state", dict))
        row = session.row
        if row not in self.histories.rows:
            return NO_INSTANCE
        job = await self.run(session, self.histories.job("random_action", row, (rng,)),
                             self.histories.call_done)
        if job.error:
            return job.error
        action, state = job.value
        return {"action": action, "rng_state": state}


class _Authorize:
    """ASGI middleware: a request without ``Authorization: Bearer TOKEN`` is ``401``, before
    any route (an unknown path included) sees it."""

    def __init__(self, app: Any, token: str):
        self.app, self.expected = app, b"Bearer " + token.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            # compare_digest: the time taken does not tell how much of a guess was right.
            if not hmac.compare_digest(given, self.expected):
                reply = _error(401, "this server needs 'Authorization: Bearer TOKEN' with its "
                                    f"token (RemoteEnv: the token param or {TOKEN_ENV})")
                reply.headers["WWW-Authenticate"] = "Bearer"
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_app(family: HostEnvFamily, *, workers: int | None = None, limits: Limits = Limits(),
             token: str | None = None) -> Any:
    """The Starlette app serving instances of ``family`` from a pool of ``workers`` processes
    within ``limits``, every request needing ``token`` if one is given (see the module
    docstring); the pool ends when the app shuts down. The limits on connections
    (``header_timeout``, ``max_connections``) are the HTTP server's: ``main`` gives uvicorn
    ``ConnectionGuard(...).protocol()`` as its ``http`` protocol, as any other runner must."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    if token is not None:
        _check_token(token)
    size = family.workers if workers is None else int(workers)
    server = _EnvServer(family, size, limits, token is not None)
    routes = [
        Route("/info", server.get_info, methods=["GET"]),
        Route("/sessions", server.create, methods=["POST"]),
        Route("/sessions/{sid}", server.close, methods=["DELETE"]),
        Route("/sessions/{sid}/reset", server.call(server.reset), methods=["POST"]),
        Route("/sessions/{sid}/step", server.call(server.step), methods=["POST"]),
        Route("/sessions/{sid}/random_action", server.call(server.random_action), methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        server.service.close()

    middleware = [] if token is None else [Middleware(_Authorize, token=token)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.pool = server.service.pool  # for tests and monitoring: its workers and restarts
    app.state.server = server  # for tests and monitoring: its sessions, histories and queue
    return app


def _json(body: Any, status: int = 200) -> Any:
    # Imported here, when serving: the workers that only play JaxAsHost never load starlette.
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def _error(status: int, text: str) -> Any:
    return _json({"error": text}, status)


def _refusal(e: _Refused) -> Any:
    reply = _error(e.status, str(e))
    if e.status == 408:  # the rest of the body may never come: the connection is not reused
        reply.headers["Connection"] = "close"
    return reply


class _Refused(ValueError):
    """A request the server refuses: its HTTP status (400 unless said) and the reason."""

    def __init__(self, text: str, status: int = 400):
        super().__init__(text)
        self.status = status


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    if name not in body:
        raise _Refused(f"the body needs {name!r}")
    value = body[name]
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is not int and isinstance(value, kind):
        return value
    raise _Refused(f"{name!r} must be a {kind.__name__}")


async def _body(request: Any, limits: Limits) -> dict[str, Any]:
    """The request's JSON object, read up to ``max_body_bytes`` within ``body_timeout``
    seconds: a longer body is refused while it arrives (its declared length first), so it is
    never held whole, and a slower one is a ``408``, so it is not held for long."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _Refused(f"the body has {declared} bytes, over the server's limit of {limit} "
                       "(--max-body-bytes)", 413)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _Refused(f"the body passes the server's limit of {limit} bytes "
                                   "(--max-body-bytes)", 413)
                chunks.append(chunk)
    except TimeoutError:
        raise _Refused(f"the body did not arrive within {limits.body_timeout:g} s "
                       "(--body-timeout)", 408) from None
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:  # the parser recurses once per level: a deep body exhausts it
        raise _Refused("the body is nested too deeply to parse") from None
    except ValueError:
        raise _Refused("the body must be JSON") from None
    if not isinstance(body, dict):
        raise _Refused("the body must be a JSON object")
    return body


def _uint(state: dict[str, Any], name: str, bits: int) -> int:
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
        raise _Refused(f"'rng_state': {name!r} must be an int in [0, 2**{bits})")
    return value


def _generator(state: dict[str, Any]) -> np.random.Generator:
    """A numpy ``Generator`` in the ``PCG64`` state a client sent, each field checked: numpy's
    state setters trust what they get (an MT19937 position past its key reads out of bounds),
    so only the generator the rollout uses is built, from checked values alone."""
    if state.get("bit_generator") != "PCG64":
        raise _Refused("'rng_state' must be a PCG64 bit_generator.state (numpy's default_rng), "
                       f"got bit_generator {str(state.get('bit_generator'))[:40]!r}")
    inner = state.get("state")
    if not isinstance(inner, dict):
        raise _Refused("'rng_state': 'state' must be an object {\"state\", \"inc\"}")
    bits = np.random.PCG64()
    bits.state = {"bit_generator": "PCG64",
                  "state": {"state": _uint(inner, "state", 128), "inc": _uint(inner, "inc", 128)},
                  "has_uint32": _uint(state, "has_uint32", 1),
                  "uinteger": _uint(state, "uinteger", 32)}
    return np.random.Generator(bits)


def _check_token(token: str) -> None:
    """A token must go into an HTTP header as it is: visible ASCII, no spaces."""
    if not token or not all("!" <= c <= "~" for c in token):
        raise ValueError("the token must be non-empty visible ASCII without spaces")


def client_range(host: str) -> str:
    """The address range a client address counts in for its sessions: its IPv4 /24 or IPv6
    /64 (what one party commonly holds), ``"loopback"`` for any loopback address (any local
    process can send from any of them); a host that is not an address stands for itself."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    prefix = CLIENT_PREFIX[address.version]
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost`` or a loopback
    address); a name that might resolve elsewhere is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
    """``python -m ragen_jax.envs.host.serve ENV [--host H] [--port P] [--workers N] [--token T]
    [--param NAME=JSON ...] [limits: --max-sessions ...]``."""
    defaults = Limits()
    parser = argparse.ArgumentParser(description="Serve a registered env over HTTP.")
    parser.add_argument("env", help="a registered env name (countdown, sudoku, sokoban, ...)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to bind; any but loopback needs a token")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=JSON",
                        help="an env parameter, its value as JSON (a bare word is a string)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes holding the instances (default: the env's)")
    parser.add_argument("--token", default=None,
                        help=f"the bearer token every request needs (default: ${TOKEN_ENV}, "
                             "which keeps it out of the process list)")
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    parser.add_argument("--max-sessions-per-client", type=int,
                        default=defaults.max_sessions_per_client,
                        help="sessions one client (the token, else an address range) may hold")
    parser.add_argument("--session-ttl", type=float, default=defaults.session_ttl,
                        help="seconds after which an idle session is closed")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--max-action-chars", type=int, default=defaults.max_action_chars)
    parser.add_argument("--max-history-bytes", type=int, default=defaults.max_history_bytes,
                        help="memory an episode's actions (kept for replay) may take")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                        help="seconds a connection has to send a request's headers")
    parser.add_argument("--body-timeout", type=float, default=defaults.body_timeout,
                        help="seconds a request's body may take to arrive (then 408)")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections; past it the longest idle one is closed")
    args = parser.parse_args(argv)

    def fail(text: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {text}\n")

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(args.host):
        fail(f"--host {args.host} is not loopback: any client there could drive the envs, "
             f"so set a token (--token or {TOKEN_ENV})")
    try:
        if token is not None:
            _check_token(token)
        limits = Limits(**{field.name: getattr(args, field.name)
                           for field in dataclasses.fields(Limits)})
    except ValueError as e:
        fail(str(e))
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--param {item!r}: expected NAME=VALUE")
        try:
            params[name] = json.loads(value)
        except ValueError:
            params[name] = value
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be >= 1")
    try:
        family = env_family(args.env, params)
    except (ValueError, TypeError, RuntimeError) as e:
        parser.error(str(e))
    workers = family.workers if args.workers is None else args.workers
    try:
        _make_room_for(limits.max_connections, workers)
    except ValueError as e:
        fail(str(e))
    import uvicorn

    from ragen_jax.envs.host.connections import ConnectionGuard

    guard = ConnectionGuard(limits.header_timeout, limits.max_connections, token)
    uvicorn.run(make_app(family, workers=workers, limits=limits, token=token),
                host=args.host, port=args.port, log_level="warning", http=guard.protocol(),
                backlog=ACCEPT_BACKLOG)


def _make_room_for(connections: int, workers: int) -> None:
    """Raises this process's open-file limit to what ``connections`` and ``workers`` need, up
    to the hard limit: past the limit, accepting a connection fails for every client."""
    need = connections + ACCEPT_BACKLOG + FD_RESERVE + FD_PER_WORKER * workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        try:
            if hard != resource.RLIM_INFINITY and hard < need:
                raise ValueError(f"over this process's hard limit of {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        except (ValueError, OSError) as e:  # the kernel's ceiling (nr_open) refuses as well
            raise ValueError(f"--max-connections {connections} with {workers} workers needs "
                             f"{need} open files: {e}") from None


if __name__ == "__main__":
    main()
