"""Host-env throughput: Countdown and Sudoku episodes per second in-process (threads), in the
worker-process pool, and over HTTP (one ``ragen_jax.envs.host.serve`` server with ``--workers``
worker processes holding the instances, many concurrent sessions), with the cost per env call.

``python -m experiments.benchmarks.bench_host_envs [--episodes 512]``. Each episode is a reset and one
scripted step (Countdown: one answer; Sudoku: one move), played by ``HostEnvDriver`` in batches
of ``--batch`` rows as the rollout plays them, so the numbers are the env side of a rollout
without the model.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

from ragen_jax.envs import make
from ragen_jax.rollout.env_driver import TurnActions
from ragen_jax.rollout.host_driver import HostEnvDriver

ACTIONS = {"countdown": "1 + 2 + 3", "sudoku": "(1,1,1)"}


def play(family, episodes: int, batch: int) -> float:
    """Episodes per second of reset + one step, ``batch`` rows at a time."""
    driver = HostEnvDriver(family)
    driver.reset(np.arange(batch))  # warm: workers started, instances built
    start, done = time.perf_counter(), 0
    while done < episodes:
        reset = driver.reset(np.arange(done, done + batch))
        action = ACTIONS.get(family.name.lower(), "1")
        driver.step(reset.states, {b: TurnActions([0], [action]) for b in range(batch)}, None)
        done += batch
    rate = done / (time.perf_counter() - start)
    driver.close()
    return rate


def serve(env: str, workers: int) -> tuple[subprocess.Popen, str]:
    """A server of ``env`` whose instances live in ``workers`` worker processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "ragen_jax.envs.host.serve", env, "--port", str(port),
                               "--workers", str(workers)])
    import httpx

    for _ in range(300):
        try:
            httpx.get(f"http://127.0.0.1:{port}/info", timeout=1.0)
            return server, f"http://127.0.0.1:{port}"
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the env server did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print("| env | mode | episodes/s | ms per episode |\n|---|---|---:|---:|")
    for env in ("countdown", "sudoku"):
        server, url = serve(env, args.workers)
        modes = {
            "in-process (thread, 1 worker)": dict(name=env, isolation="thread"),
            "process pool (1 worker)": dict(name=env),
            f"process pool ({args.workers} workers)": dict(name=env, parallel_friendly=True,
                                                           max_workers=args.workers),
            f"HTTP, client in {args.workers} worker processes ({args.batch} sessions)": dict(
                name="remote", url=url, parallel_friendly=True, max_workers=args.workers),
            "HTTP, 16 client threads": dict(name="remote", url=url, isolation="thread",
                                            parallel_friendly=True, max_workers=16),
        }
        try:
            for mode, params in modes.items():
                name = params.pop("name")
                rate = play(make(name, **params)[0], args.episodes, args.batch)
                print(f"| {env} | {mode} | {rate:.0f} | {1000 / rate:.2f} |", flush=True)
        finally:
            server.kill()
            server.wait()
    print(f"\n{os.cpu_count()} CPUs; {args.episodes} episodes of reset + one step per mode, "
          f"batches of {args.batch} rows")


if __name__ == "__main__":
    main()
