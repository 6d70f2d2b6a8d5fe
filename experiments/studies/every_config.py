"""Every env config trains: ``python -m experiments.studies.every_config [--override=...]``.

Each ``configs/*.py`` (its tiny preset; ``remote.py`` against a Countdown server this script
starts on loopback) runs ``launch.py`` for ``--steps`` RL steps on a micro model (2 layers,
width 64, 2-4 groups of 4 episodes, a warm start of 2 + 3 steps on 8 + 8 episodes,
uncached), with the
overrides given: ``--override=--config.algorithm.adv_estimator=gigpo`` checks that an
estimator runs on JAX envs, host envs and the mixed runs alike. A row per config: exit, wall
seconds, the last step's reward and, from every run, the share of turns that found an anchor
group (``rollout/anchored_turns``). Configs whose optional package is missing (TextWorld's
``textworld``) are reported as such, not run.

A smoke check, not a measurement: children compile with the test suite's fast-compile XLA
flags (``tests/conftest.py``), which slow the steps themselves.

    python -m experiments.studies.every_config --override=--config.algorithm.adv_estimator=gigpo \
        --out experiments/results/every_config_gigpo.md
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import ROOT, child_env, report
from ragen_jax.metrics import read_jsonl

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")
NEEDS = {"textworld": "textworld", "gem": "gem"}  # config -> the optional module it imports
MICRO = ["--config.model.hidden_size=64", "--config.model.intermediate_size=128",
         "--config.model.num_hidden_layers=2", "--config.rollout.group_size=4",
         "--config.actor.ppo_mini_batch_size=4", "--config.warmstart.steps=3",
         "--config.warmstart.episodes=8", "--config.warmstart.batch_size=4",
         "--config.warmstart.turns.steps=2", "--config.warmstart.turns.batch_size=4",
         "--config.warmstart.turns.episodes=8", "--config.warmstart.cache=False",
         "--config.trainer.progress=False", "--config.trainer.test_freq=1000",
         "--config.diagnostics.compute_freq=1", "--config.diagnostics.num_samples=8"]
MIXED = {"mixed", "mixed_countdown"}  # their groups are the mixture's (4 + 4)


def configs() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem not in ("__init__", "base"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(name: str, steps: int, extra: list[str], out: Path, env: dict[str, str],
            timeout: float = 900) -> list[str]:
    """One config's run; returns its table row's cells."""
    module = NEEDS.get(name)
    if module and importlib.util.find_spec(module) is None:
        return [name, f"skipped: `{module}` not installed", "-", "-", "-"]
    groups = [] if name in MIXED else ["--config.rollout.env_groups=2", "--config.rollout.val.env_groups=2"]
    server, args = None, []
    if name == "remote":
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "ragen_jax.envs.host.serve", "countdown",
                                   "--port", str(port)], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        args = [f"--config.env.params.url=http://127.0.0.1:{port}"]
        time.sleep(3)  # the server's import and bind
    cmd = [sys.executable, "launch.py", "--config", f"configs/{name}.py", f"--config.trainer.output_dir={out}",
           f"--config.trainer.total_steps={steps}", *MICRO, *groups, *args, *extra]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [name, f"**timed out** after {timeout:.0f} s", f"{time.perf_counter() - t0:.0f}", "-", "-"]
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:160].replace("|", "/")
        return [name, f"**failed** ({proc.returncode}): `{tail}`", f"{wall:.0f}", "-", "-"]
    metrics = read_jsonl(out / "metrics.jsonl")
    reward = metrics[max(metrics)].get("rollout/in_group_reward_mean")
    anchored = [m["rollout/anchored_turns"] for m in metrics.values() if "rollout/anchored_turns" in m]
    return [name, f"ok, {max(metrics)} steps", f"{wall:.0f}",
            "-" if reward is None else f"{reward:.3f}",
            f"{sum(anchored) / len(anchored):.2f}" if anchored else "-"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", nargs="+", choices=configs())
    p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every run")
    p.add_argument("--out", help="also write the Markdown table here")
    args = p.parse_args()
    env = child_env(XLA_FLAGS=FAST_COMPILE)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or configs():
            cells = run_one(name, args.steps, args.override, Path(tmp) / name, env)
            print(" | ".join(cells), flush=True)
            rows.append("| " + " | ".join(cells) + " |")
    report([f"`python -m experiments.studies.every_config {' '.join('--override=' + o for o in args.override)}` "
            f"({args.steps} steps each, {time.strftime('%Y-%m-%d')}):", "",
            "| config | outcome | wall s | last step's mean reward | anchored turns (mean over steps) |",
            "|---|---|---:|---:|---:|", *rows], args.out)


if __name__ == "__main__":
    main()
