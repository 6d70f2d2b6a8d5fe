"""Zero-shot table: real instruct models on the validation episodes of every env, untrained.

For each model (``NAME=PRESET=PATH``: a Hugging Face folder or a ``.gguf`` file, the preset
whose settings the run would train with) and each env config (``--envs``), runs
``ragen_jax.eval.evaluate`` on the first ``--episodes`` validation episodes of every tag
(RAGEN's prompts, ``rollout.val.temperature``) and tabulates, per tag: success, the
format-error rate (turns whose answer did not parse), the mean answer length in tokens per
turn, and the wall time of the evaluation (compilation included: a user's first run pays it).
RAGEN publishes no step-0 figures for Qwen2.5-0.5B-Instruct; beside each tag stands what
its V1 paper reports after StarPO-S training of that model (Table 4; Bandit-Rev is its
held-out-names Bandit, our BanditTest), the distance a trained run has to go.

    python -m experiments.studies.zero_shot \\
        --model smollm2=smollm2-135m=/path/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --model qwen0.5b=qwen2.5-0.5b-cpu=/path/qwen-folder --episodes 16 \\
        --out experiments/results/zero_shot.md

Each (model, env) evaluation runs in a process of its own (one process holding every
model's compiled programs in turn grew past 15 GB) and writes its files to
``--work/<model>-<env>/`` (metrics.json, trajectories.jsonl, viewer.html), so the answers
behind each number can be read.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import child_env

ENVS = ("bandit", "frozenlake", "sokoban", "countdown", "sudoku")

# RAGEN V1 (Qwen2.5-0.5B-Instruct after StarPO-S training, Table 4; % of 256 prompts;
# trained on Bandit for the Bandit tags, on Sokoban for the others); None: not reported.
RAGEN_TRAINED = {"Bandit": 100.00, "BanditTest": 67.58, "FrozenLake": 19.92, "Sokoban": 21.48,
                 "Countdown": None, "Sudoku": None}


def run_one(name: str, preset: str, path: str, env: str, episodes: int, work: Path,
            overrides: list[str]) -> list[dict]:
    """Evaluates one model on one env config; one row per validation tag."""
    from ragen_jax.config.loading import load_config
    from ragen_jax.eval import evaluate

    args = [f"--config=configs/{env}.py:{preset}", f"--config.model.path={path}",
            f"--config.rollout.val.env_groups={episodes}", *overrides]
    config = load_config(args, prog="zero_shot")
    t0 = time.perf_counter()
    _, summary = evaluate(config, work / f"{name}-{env}")
    wall = time.perf_counter() - t0
    m = summary["metrics"]
    tags = sorted({k.split("/")[0] for k in m if k.endswith("/success")})
    return [{"model": name, "env": env, "tag": tag, "episodes": episodes,
             "success": m[f"{tag}/success"], "format_error_rate": m[f"{tag}/format_error_rate"],
             "answer_tokens": m[f"{tag}/response_length_per_turn"],
             "turns": m[f"{tag}/num_turns"], "wall_s": wall,
             "dtype": summary["dtype"]["compute"]} for tag in tags]


def table(rows: list[dict]) -> str:
    lines = ["| model | env tag | episodes | success | format errors (of turns) | "
             "answer tokens / turn | turns / episode | wall s (env config) | compute | "
             "RAGEN V1 0.5B after training, % |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['env']} | failed: {r['error']} | | | | | | | |")
            continue
        ragen = RAGEN_TRAINED.get(r["tag"])
        lines.append(f"| {r['model']} | {r['tag']} | {r['episodes']} | {r['success']:.3f} | "
                     f"{r['format_error_rate']:.3f} | {r['answer_tokens']:.1f} | {r['turns']:.2f} | "
                     f"{r['wall_s']:.0f} | {r['dtype']} | {'n/a' if ragen is None else ragen} |")
    return "\n".join(lines)


def run_child(spec: str, env: str, args: argparse.Namespace) -> list[dict]:
    """``run_one`` in a fresh process (``--child``); its rows come back as JSON."""
    out = Path(args.work) / f"rows-{spec.split('=', 1)[0]}-{env}.json"
    cmd = [sys.executable, "-m", "experiments.studies.zero_shot", "--child", spec, "--envs", env, "--episodes",
           str(args.episodes), "--work", args.work, "--child-out", str(out),
           *[f"--override={o}" for o in args.override]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RuntimeError(tail[0][:200])
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PRESET=PATH")
    ap.add_argument("--envs", default=",".join(ENVS))
    ap.add_argument("--episodes", type=int, default=16, help="validation episodes per tag")
    ap.add_argument("--work", default="/tmp/zero_shot", help="per-evaluation output folders")
    ap.add_argument("--out", default=None, help="markdown table (also printed)")
    ap.add_argument("--override", action="append", default=[],
                    help="more --config.a.b=value flags for every evaluation")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.child:  # one (model, env) evaluation, rows to --child-out
        name, preset, path = args.child.split("=", 2)
        rows = run_one(name, preset, path, args.envs, args.episodes, work, args.override)
        Path(args.child_out).write_text(json.dumps(rows))
        return
    if not args.model:
        ap.error("give at least one --model NAME=PRESET=PATH")
    rows: list[dict] = []
    for spec in args.model:
        name = spec.split("=", 1)[0]
        for env in args.envs.split(","):
            try:
                rows += run_child(spec, env, args)
            except Exception as e:  # one failed cell is a row saying so; the rest still run
                rows.append({"model": name, "env": env, "error": f"{type(e).__name__}: {e}"[:200]})
            print(table(rows), flush=True)
            (work / "rows.json").write_text(json.dumps(rows, indent=2))
    text = table(rows)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
