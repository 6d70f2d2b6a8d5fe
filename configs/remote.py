"""An env served over HTTP (``python -m ragen_jax.envs.host.serve ENV``), trained with another env
config's settings: ``--config configs/remote.py:countdown`` takes ``configs/countdown.py``'s
tiny preset, ``:countdown/qwen2.5-0.5b`` another of its presets, and plays the env at
``--config.env.params.url`` (default ``http://127.0.0.1:8000``; ``timeout``, ``connect_timeout``,
``retries`` and ``token`` are the other params, ``ragen_jax.envs.host.remote``; a server's token is
better given as ``RAGEN_JAX_ENV_TOKEN`` in the environment, out of the saved config). The served
env's own parameters are the server's (``--param``), not this config's.

``python launch.py --config configs/remote.py:countdown --config.env.params.url=http://host:port``.
"""

import importlib

DEFAULT_URL = "http://127.0.0.1:8000"


def get_config(arg: str = "countdown"):
    name, _, preset = arg.partition("/")
    try:
        base_config = importlib.import_module(f"configs.{name}")
    except ModuleNotFoundError:
        raise ValueError(f"configs/remote.py:{arg}: no env config configs/{name}.py") from None
    c = base_config.get_config(preset or "tiny")
    c.env.name = "remote"
    c.env.params = dict(url=DEFAULT_URL)
    return c
