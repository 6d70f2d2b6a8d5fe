"""``RemoteEnv``: a host env played over HTTP against ``python -m ragen_jax.envs.host.serve``.

``--config.env.name=remote --config.env.params.url=http://127.0.0.1:8000`` plays the served
env like any host env (in the rollout's worker processes by default). Each instance holds one
server session. Failures follow the host-env contract: an error the server reports, a
connection that fails, or a reply slower than ``timeout`` raises, and the rollout ends that
episode as an env error. Idempotent calls (creating a session, ``reset``, ``random_action``,
closing) are retried up to ``retries`` times after a connection error or a 5xx reply other
than an env error, with a short back-off; ``step`` is never retried (the server may have
stepped). A reset whose session the server no longer knows (it restarted, or closed the
session after ``--session-ttl`` idle seconds) opens a new one, so a server that died
mid-episode costs that episode and the next reset plays on. The server runs its envs in worker
processes under its own ``step_timeout``; give ``timeout`` more than that, so that a call
queued behind another session's hang is not taken for a dead server. The server serves the
calls waiting for a worker round robin across client addresses, so a call waits for at most
one call of each other address with calls queued (each up to ``step_timeout``) besides its
own: against a server shared with other clients stepping slow envs, raise ``timeout`` by a
``step_timeout`` per such client.

A server started with a token (``--token``, or ``RAGEN_JAX_ENV_TOKEN`` in its environment) needs
it with every request: the ``token`` param, else ``RAGEN_JAX_ENV_TOKEN`` in the trainer's
environment (which keeps it out of the run's saved config), goes as ``Authorization: Bearer``.
The server's refusals (a missing token, its limits on sessions, bodies and actions) are
``RemoteEnvError``s with the server's reason, never retried.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ragen_jax.envs.host.env import HostEnv

RETRY_BACKOFF = 0.2  # seconds before the first retry, doubled for each next one
TOKEN_ENV = "RAGEN_JAX_ENV_TOKEN"  # the server's bearer token, when the params give none


class RemoteEnvError(RuntimeError):
    """The server or the connection to it failed."""


class RemoteEnv(HostEnv):
    """One session of an env served over HTTP (see the module docstring)."""

    def __init__(self, url: str, timeout: float = 30.0, connect_timeout: float = 5.0,
                 retries: int = 3, token: str | None = None):
        import httpx

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"env.params.url must be an http(s) URL, got {url!r}")
        if retries < 0 or timeout <= 0 or connect_timeout <= 0:
            raise ValueError("env.params.retries must be >= 0 and the timeouts > 0")
        token = token or os.environ.get(TOKEN_ENV) or None
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self.url, self.retries, self.httpx = url.rstrip("/"), int(retries), httpx
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(
            timeout, connect=connect_timeout))
        info = self._call("GET", "/info", idempotent=True)
        self._name, self.instruction = str(info["name"]), str(info["instruction"])
        self.action_names = tuple(info["action_names"])
        self.session: str | None = None
        self._level_key: str | None = None
        self._holdout_key: str | None = None

    @property
    def name(self) -> str:
        return self._name

    def _call(self, method: str, path: str, body: dict | None = None, *,
              idempotent: bool) -> dict[str, Any]:
        """One request; retried (idempotent calls only) after a connection error or a server
        failure that is not the env's own error."""
        httpx = self.httpx
        for attempt in range(self.retries + 1 if idempotent else 1):
            if attempt:
                time.sleep(RETRY_BACKOFF * 2 ** (attempt - 1))
            try:
                reply = self.client.request(method, path, json=body)
            except httpx.TimeoutException as e:
                error = RemoteEnvError(f"{method} {path}: no reply within the timeout ({type(e).__name__})")
                if isinstance(e, httpx.ReadTimeout):  # the server is busy in the env: no retry
                    raise error from None
                continue
            except httpx.TransportError as e:
                error = RemoteEnvError(f"{method} {path}: {type(e).__name__}: {e}")
                continue
            if reply.status_code == 404 and path.startswith("/sessions/"):
                raise SessionGone(f"{method} {path}: the server has no such session")
            data = _json(reply)
            if reply.status_code == 500 and "error" in data:  # the env raised: not retried
                raise RemoteEnvError(f"the served env failed: {data['error']}")
            if reply.status_code >= 500:
                error = RemoteEnvError(f"{method} {path}: HTTP {reply.status_code}")
                continue
            if reply.status_code != 200:
                raise RemoteEnvError(f"{method} {path}: HTTP {reply.status_code} {data.get('error', '')}")
            return data
        raise error

    def _open(self) -> None:
        self.session = self._call("POST", "/sessions", idempotent=True)["session"]

    def reset(self, seed: int) -> str:
        if self.session is None:
            self._open()
        try:
            data = self._call("POST", f"/sessions/{self.session}/reset", {"seed": int(seed)},
                              idempotent=True)
        except SessionGone:  # the server restarted: a fresh session plays the episode
            self._open()
            data = self._call("POST", f"/sessions/{self.session}/reset", {"seed": int(seed)},
                              idempotent=True)
        self.action_names = tuple(data["action_names"])
        self._level_key = str(data["level_key"])
        held = data.get("holdout_key")  # (a server older than the field: the level)
        self._holdout_key = None if held is None else str(held)
        return str(data["observation"])

    def level_key(self) -> str | None:
        return self._level_key

    def holdout_key(self) -> str | None:
        return self._holdout_key

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.session is None:
            raise RemoteEnvError("step before reset")
        data = self._call("POST", f"/sessions/{self.session}/step", {"action": action},
                          idempotent=False)
        self.action_names = tuple(data["action_names"])
        return str(data["observation"]), float(data["reward"]), bool(data["done"]), dict(data["info"])

    def random_action(self, rng: np.random.Generator) -> str:
        """The served instance's ``random_action`` with ``rng`` (its state goes to the server
        and comes back advanced, as if the draw had run here)."""
        data = self._call("POST", f"/sessions/{self.session}/random_action",
                          {"rng_state": rng.bit_generator.state}, idempotent=True)
        rng.bit_generator.state = data["rng_state"]
        return str(data["action"])

    def close(self) -> None:
        """Ends the session (best effort) and the connection."""
        if self.session is not None:
            try:
                self._call("DELETE", f"/sessions/{self.session}", idempotent=False)
            except RemoteEnvError:
                pass
            self.session = None
        self.client.close()

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


class SessionGone(RemoteEnvError):
    """The server does not know the session (it restarted, or the session was closed)."""


def _json(reply: Any) -> dict[str, Any]:
    try:
        data = reply.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
