"""Serve any registered env over HTTP: ``python -m ragen_jax.envs.serve ENV [--port 8000]``.

The protocol (JSON bodies, one env instance per session; ``ragen_jax.envs.remote.RemoteEnv``
is its client, the ``remote`` env of a run):

* ``GET /info`` -> ``{"name", "instruction", "action_names"}``;
* ``POST /sessions`` -> ``{"session"}``: a new session (its instance is built here);
* ``POST /sessions/{id}/reset`` ``{"seed": int}`` -> ``{"observation", "action_names",
  "level_key"}``: the same seed, the same episode; ``level_key`` is the level identity that
  held-out validation compares (``envs.levels``: a host env's ``level_key()`` or its first
  observation, a JAX env's level hash in hex);
* ``POST /sessions/{id}/step`` ``{"action": str}`` -> ``{"observation", "reward", "done",
  "info": {"success", "truncated", "action_is_effective"}, "action_names"}``;
* ``POST /sessions/{id}/random_action`` ``{"seed": int}`` -> ``{"action"}`` (the format
  warm-start's random answers);
* ``DELETE /sessions/{id}``.

An env error (the env raised) is ``500 {"error": "Type: message"}``; an unknown session is
``404``. ``reset``, ``random_action`` and ``DELETE`` are idempotent (a client may retry them);
``step`` is not. Each session's calls run one at a time, on Starlette's thread pool; a host
env served here runs in this server's process, so a server that must survive its env's hangs
and crashes is run under a supervisor that restarts it (the client's timeouts and the
rollout's error accounting make a dead server cost its episodes, never the run).

A JAX env is played one session at a time through ``JaxAsHost`` (its action names as the
actions; each step's key folds the seed with the step count, so a served JAX episode is
reproducible but not the in-process rollout's, whose keys come from the rollout's key).
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ragen_jax.envs import levels
from ragen_jax.envs.host import HostEnv, HostEnvFamily
from ragen_jax.envs.processes import checked_step, describe, names_of


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


def env_factory(name: str, params: dict[str, Any]) -> Callable[[], HostEnv]:
    """What builds one served instance of the registered env ``name`` with ``params``."""
    from ragen_jax.envs.registry import make

    env, env_params = make(name, **params, **({"isolation": "thread"} if _is_host(name) else {}))
    if isinstance(env, HostEnvFamily):
        return env.factory
    return lambda: JaxAsHost(env, env_params)


def _is_host(name: str) -> bool:
    from ragen_jax.envs.base import TextEnv
    from ragen_jax.envs.registry import REGISTRY

    cls = REGISTRY.get(name)
    return cls is not None and not (isinstance(cls, type) and issubclass(cls, TextEnv))


class _Session:
    def __init__(self, env: HostEnv):
        self.env, self.lock = env, threading.Lock()


def make_app(factory: Callable[[], HostEnv], *, max_sessions: int = 4096) -> Any:
    """The Starlette app serving instances of ``factory()`` (see the module docstring)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    proto = factory()
    info = {"name": proto.name, "instruction": proto.instruction, "action_names": list(names_of(proto))}
    sessions: dict[str, _Session] = {}
    guard = threading.Lock()

    def error(status: int, text: str) -> JSONResponse:
        return JSONResponse({"error": text}, status_code=status)

    async def get_info(request: Request) -> JSONResponse:
        return JSONResponse(info)

    async def create(request: Request) -> JSONResponse:
        if len(sessions) >= max_sessions:
            return error(503, f"at most {max_sessions} sessions")
        try:
            env = await run_in_threadpool(factory)
        except Exception as e:  # noqa: BLE001 - the env's constructor may raise anything
            return error(500, describe(e))
        sid = uuid.uuid4().hex
        with guard:
            sessions[sid] = _Session(env)
        return JSONResponse({"session": sid})

    async def close(request: Request) -> JSONResponse:
        with guard:
            sessions.pop(request.path_params["sid"], None)
        return JSONResponse({})

    def call(fn: Callable[[HostEnv, dict[str, Any]], dict[str, Any]]) -> Callable:
        async def endpoint(request: Request) -> JSONResponse:
            session = sessions.get(request.path_params["sid"])
            if session is None:
                return error(404, "unknown session")
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the body must be JSON")
            if not isinstance(body, dict):
                return error(400, "the body must be a JSON object")

            def run() -> dict[str, Any]:
                with session.lock:
                    return fn(session.env, body)
            try:
                return JSONResponse(await run_in_threadpool(run))
            except (KeyError, TypeError) as e:
                if isinstance(e, KeyError) and e.args and e.args[0] in ("seed", "action"):
                    return error(400, f"the body needs {e.args[0]!r}")
                return error(500, describe(e))
            except Exception as e:  # noqa: BLE001 - an env may raise anything
                return error(500, describe(e))
        return endpoint

    def reset(env: HostEnv, body: dict[str, Any]) -> dict[str, Any]:
        text = env.reset(int(body["seed"]))
        if not isinstance(text, str):
            raise TypeError(f"reset returned a {type(text).__name__}, not a str")
        key = env.level_key()
        return {"observation": text, "action_names": list(names_of(env)),
                "level_key": text if key is None else str(key)}

    def step(env: HostEnv, body: dict[str, Any]) -> dict[str, Any]:
        action = body["action"]
        if not isinstance(action, str):
            raise TypeError("'action' must be a string")
        text, reward, done, info = checked_step(env.step(action))
        return {"observation": text, "reward": reward, "done": done,
                "info": {"success": bool(info.get("success", False)),
                         "truncated": bool(info.get("truncated", False)),
                         "action_is_effective": bool(info.get("action_is_effective", True))},
                "action_names": list(names_of(env))}

    def random_action(env: HostEnv, body: dict[str, Any]) -> dict[str, Any]:
        return {"action": str(env.random_action(np.random.default_rng(int(body["seed"]))))}

    routes = [
        Route("/info", get_info, methods=["GET"]),
        Route("/sessions", create, methods=["POST"]),
        Route("/sessions/{sid}", close, methods=["DELETE"]),
        Route("/sessions/{sid}/reset", call(reset), methods=["POST"]),
        Route("/sessions/{sid}/step", call(step), methods=["POST"]),
        Route("/sessions/{sid}/random_action", call(random_action), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> None:
    """``python -m ragen_jax.envs.serve ENV [--host H] [--port P] [--param NAME=JSON ...]``."""
    parser = argparse.ArgumentParser(description="Serve a registered env over HTTP.")
    parser.add_argument("env", help="a registered env name (countdown, sudoku, sokoban, ...)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=JSON",
                        help="an env parameter, its value as JSON (a bare word is a string)")
    parser.add_argument("--max-sessions", type=int, default=4096)
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
    try:
        factory = env_factory(args.env, params)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    import uvicorn

    uvicorn.run(make_app(factory, max_sessions=args.max_sessions), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
