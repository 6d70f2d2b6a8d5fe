"""Serve any registered env over HTTP: ``python -m ragen_jax.envs.serve ENV [--port 8000]``.

The protocol (JSON bodies, one env instance per session; ``ragen_jax.envs.remote.RemoteEnv``
is its client, the ``remote`` env of a run):

* ``GET /info`` -> ``{"name", "instruction", "action_names"}``;
* ``POST /sessions`` -> ``{"session"}``: a new session (its instance is built at its first
  reset);
* ``POST /sessions/{id}/reset`` ``{"seed": int}`` -> ``{"observation", "action_names",
  "level_key"}``: the same seed, the same episode; ``level_key`` is the level identity that
  held-out validation compares (``envs.levels``: a host env's ``level_key()`` or its first
  observation, a JAX env's level hash in hex);
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

The instances live in worker processes (``envs.processes``), not in the server: a session is a
row of a ``ProcessPool`` of ``--workers`` processes (default: the env's ``max_workers`` if it is
``parallel_friendly``, else 1), driven by one thread (``PoolService``) while the event loop
serves requests. A call past ``step_timeout`` has its worker killed and a crash of a worker
costs the call it was running; either way that session's call is an env error, the server
stays up, and the other sessions homed on that worker are rebuilt by replaying their seed and
actions on the fresh worker (their calls wait meanwhile, so a client's timeout should exceed
the server's ``step_timeout``). Each session's calls run one at a time, in order.

A JAX env is played one session at a time through ``JaxAsHost`` (its action names as the
actions; each step's key folds the seed with the step count, so a served JAX episode is
reproducible but not the in-process rollout's, whose keys come from the rollout's key); its
workers run JAX on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ragen_jax.envs import levels
from ragen_jax.envs.host import HostEnv, HostEnvFamily
from ragen_jax.envs.processes import Histories, Job, PoolService, ProcessPool, TurnProgress


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


class _Session:
    def __init__(self, row: int):
        self.row, self.lock, self.used = row, asyncio.Lock(), time.monotonic()


class _EnvServer:
    """The server's state and endpoints: sessions (each a row of the pool), their histories
    (for rebuilding a crashed worker's rows) and the pool's driver thread."""

    def __init__(self, family: HostEnvFamily, workers: int, max_sessions: int,
                 session_ttl: float):
        self.service = PoolService(ProcessPool(family.factory, workers, family.step_timeout,
                                               memory_limit_mb=family.memory_limit_mb))
        self.info = {k: family.info[k] for k in ("name", "instruction")}
        self.info["action_names"] = list(family.info.get("action_names", ()))
        self.max_sessions, self.session_ttl = max_sessions, session_ttl
        self.sessions: dict[str, _Session] = {}
        self.histories = Histories()  # touched on the event loop's thread only
        self.rows = itertools.count()

    async def run(self, job: Job, record: Callable[[Job], None]) -> Job:
        """Runs ``job`` in the pool; ``record`` keeps its outcome in ``histories`` on the event
        loop, even when the request that asked for it is gone."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def finish(job: Job) -> None:
            record(job)
            if not future.done():
                future.set_result(job)

        self.service.submit(job, lambda job: loop.call_soon_threadsafe(finish, job))
        return await future

    def expire(self) -> None:
        now = time.monotonic()
        for sid, session in list(self.sessions.items()):
            if now - session.used > self.session_ttl and not session.lock.locked():
                self.close_session(sid)

    def close_session(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.histories.rows.pop(session.row, None)
            self.service.submit(Job("drop", session.row, ()), lambda job: None)

    # Endpoints without a session body.

    async def get_info(self, request: Any) -> Any:
        return _json(self.info)

    async def create(self, request: Any) -> Any:
        self.expire()
        if len(self.sessions) >= self.max_sessions:
            return _error(503, f"at most {self.max_sessions} sessions")
        sid = uuid.uuid4().hex
        self.sessions[sid] = _Session(next(self.rows))
        return _json({"session": sid})

    async def close(self, request: Any) -> Any:
        self.close_session(request.path_params["sid"])
        return _json({})

    def call(self, fn: Callable[[int, dict[str, Any]], Any]) -> Callable:
        """The endpoint that runs ``fn(row, body)`` for the request's session, one call at a
        time per session; a ``str`` reply is the env's error (500)."""
        async def endpoint(request: Any) -> Any:
            session = self.sessions.get(request.path_params["sid"])
            if session is None:
                return _error(404, "unknown session")
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "the body must be JSON")
            if not isinstance(body, dict):
                return _error(400, "the body must be a JSON object")
            async with session.lock:
                session.used = time.monotonic()
                try:
                    reply = await fn(session.row, body)
                except _BadRequest as e:
                    return _error(400, str(e))
                session.used = time.monotonic()
            if isinstance(reply, str):
                return _error(500, reply)
            return _json(reply)
        return endpoint

    # A session's calls: (row, body) -> the reply's JSON, or the env's error as a str.

    async def reset(self, row: int, body: dict[str, Any]) -> dict[str, Any] | str:
        seed = _field(body, "seed", int)
        job = await self.run(Job("reset", row, (seed,)), self.histories.reset_done)
        if job.error:
            return job.error
        text, names, key = job.value
        return {"observation": text, "action_names": list(names), "level_key": key}

    async def step(self, row: int, body: dict[str, Any]) -> dict[str, Any] | str:
        action = _field(body, "action", str)
        if row not in self.histories.rows:
            return NO_INSTANCE
        job = await self.run(self.histories.job("step", row, ([action],)),
                             self.histories.step_done)
        if job.error:
            return job.error
        p: TurnProgress = job.progress
        return {"observation": p.text, "reward": p.reward, "done": p.done,
                "info": {"success": p.success, "truncated": p.truncated,
                         "action_is_effective": bool(p.effective)},
                "action_names": list(job.value)}

    async def random_action(self, row: int, body: dict[str, Any]) -> dict[str, Any] | str:
        rng = _generator(_field(body, "rng_state", dict))
        if row not in self.histories.rows:
            return NO_INSTANCE
        job = await self.run(self.histories.job("random_action", row, (rng,)),
                             self.histories.call_done)
        if job.error:
            return job.error
        action, state = job.value
        return {"action": action, "rng_state": state}


def make_app(family: HostEnvFamily, *, workers: int | None = None, max_sessions: int = 4096,
             session_ttl: float = 3600.0) -> Any:
    """The Starlette app serving instances of ``family`` from a pool of ``workers`` processes
    (see the module docstring); the pool ends when the app shuts down."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    size = family.workers if workers is None else int(workers)
    server = _EnvServer(family, size, max_sessions, session_ttl)
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

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.pool = server.service.pool  # for tests and monitoring: its workers and restarts
    return app


def _json(body: Any, status: int = 200) -> Any:
    # Imported here, when serving: the workers that only play JaxAsHost never load starlette.
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def _error(status: int, text: str) -> Any:
    return _json({"error": text}, status)


class _BadRequest(ValueError):
    pass


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    if name not in body:
        raise _BadRequest(f"the body needs {name!r}")
    value = body[name]
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is not int and isinstance(value, kind):
        return value
    raise _BadRequest(f"{name!r} must be a {kind.__name__}")


def _generator(state: dict[str, Any]) -> np.random.Generator:
    """A numpy ``Generator`` in the bit-generator ``state`` a client sent."""
    kind = getattr(np.random, str(state.get("bit_generator", "")), None)
    if not (isinstance(kind, type) and issubclass(kind, np.random.BitGenerator)):
        raise _BadRequest("'rng_state' must be a numpy bit_generator.state")
    bits = kind()
    try:
        bits.state = state
    except (TypeError, ValueError, KeyError) as e:
        raise _BadRequest(f"'rng_state' is not a {kind.__name__} state: {e}") from None
    return np.random.Generator(bits)


def main(argv: list[str] | None = None) -> None:
    """``python -m ragen_jax.envs.serve ENV [--host H] [--port P] [--workers N]
    [--param NAME=JSON ...]``."""
    parser = argparse.ArgumentParser(description="Serve a registered env over HTTP.")
    parser.add_argument("env", help="a registered env name (countdown, sudoku, sokoban, ...)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=JSON",
                        help="an env parameter, its value as JSON (a bare word is a string)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes holding the instances (default: the env's)")
    parser.add_argument("--max-sessions", type=int, default=4096)
    parser.add_argument("--session-ttl", type=float, default=3600.0,
                        help="seconds after which an idle session is closed")
    args = parser.parse_args(argv)
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
    import uvicorn

    uvicorn.run(make_app(family, workers=args.workers, max_sessions=args.max_sessions,
                         session_ttl=args.session_ttl),
                host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
