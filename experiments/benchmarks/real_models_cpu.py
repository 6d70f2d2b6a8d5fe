"""Summarises evaluations of a real model on this CPU (``python -m ragen_jax.eval`` output
folders) as the table of ``experiments/results/real_models_cpu.md``.

    python -m experiments.benchmarks.real_models_cpu results/eval-after results/eval-nostop ...
    python -m experiments.benchmarks.real_models_cpu --overhead /path/to/model-folder

Per folder and env tag: episodes, success, format-error rate, answer length in tokens (mean,
and the longest, which sets how many decode steps the batch ran), turns that ended on a stop
id or stop string, and the evaluation's wall time (model loading excluded: ``timing.wall_s``
is the rollout's) with its generation share. The eval runs themselves are in the results file
with their exact commands (minutes each on 2 cores).

``--overhead FOLDER``: what the stop-string automaton costs the decode loop: the folder's
model (float32 compute copy) decodes the same greedy batch with and without a stop string that
never occurs (so both run every step), alternated, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path


def summarise(folder: Path) -> list[dict]:
    """One row per env tag of an eval folder (``metrics.json`` + ``trajectories.jsonl``)."""
    summary = json.loads((folder / "metrics.json").read_text())
    trajs = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    rows = []
    for tag in dict.fromkeys(t["tag"] for t in trajs):
        turns = [turn for t in trajs if t["tag"] == tag for turn in t["turns"]]
        lengths = [turn["num_tokens"] for turn in turns]
        m = summary["metrics"]
        rows.append({
            "run": folder.name, "tag": tag, "episodes": sum(t["tag"] == tag for t in trajs),
            "success": m[f"{tag}/success"], "format_errors": m[f"{tag}/format_error_rate"],
            "answer_mean": sum(lengths) / max(len(lengths), 1), "answer_max": max(lengths, default=0),
            "stopped": sum(bool(turn.get("stopped")) for turn in turns), "turns": len(turns),
            "compute": summary["dtype"]["compute"], "wall_s": summary["timing"]["wall_s"],
            "generate_s": summary["timing"].get("generate_s", float("nan")),
        })
    return rows


def table(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table."""
    head = ("| run | compute | tag | episodes | success | format errors | answer tokens mean / max "
            "| turns stopped | rollout wall s (generation s) |\n|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['run']} | {r['compute']} | {r['tag']} | {r['episodes']} | {r['success']:.3f} | "
            f"{r['format_errors']:.3f} | {r['answer_mean']:.1f} / {r['answer_max']} | "
            f"{r['stopped']} of {r['turns']} | {r['wall_s']:.0f} ({r['generate_s']:.0f}) |"
            for r in rows]
    return "\n".join([head, *body])


def overhead(folder: str, *, batch: int, steps: int, repeats: int) -> str:
    """Decode seconds of ``batch`` rows x ``steps`` greedy tokens, without and with a stop
    string that never occurs (every row runs every step either way); one line."""
    import jax

    from ragen_jax.config.schema import ModelConfig
    from ragen_jax.models import compute_copy
    from ragen_jax.policy import build_actor, load_tokenizer
    from ragen_jax.rollout import Sampler, SamplingParams
    from ragen_jax.rollout.stop_strings import stop_automaton

    model_config = ModelConfig(path=folder, dtype="auto")
    tok = load_tokenizer(model_config)
    sampler = Sampler(compute_copy(build_actor(model_config, 0)), pad_id=tok.pad_token_id or 0)
    auto = stop_automaton(tok, ("@@never-written@@",))
    prompts = [tok(f"Count from {i} to 500, one number a line:", add_special_tokens=False)
               ["input_ids"] for i in range(batch)]
    params = SamplingParams(max_new_tokens=steps, temperature=0.0)
    best = {"without": float("inf"), "with": float("inf")}
    for _ in range(repeats + 1):  # the first round compiles both programs
        for name, table in (("without", None), ("with", auto)):
            t0 = time.perf_counter()
            out = sampler(prompts, key=jax.random.key(0), params=params, stop_strings=table)
            jax.block_until_ready(out.tokens)
            best[name] = min(best[name], time.perf_counter() - t0)
            assert int(out.steps) == steps
    return (f"batch {batch} x {steps} greedy tokens: without stop strings {best['without']:.2f} s, "
            f"with {best['with']:.2f} s ({best['with'] / best['without'] - 1:+.1%}), best of {repeats}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="*", type=Path, help="eval output folders (--out)")
    p.add_argument("--overhead", default=None, help="model folder: time the stop-string automaton")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.overhead:
        print(overhead(args.overhead, batch=args.batch, steps=args.steps, repeats=args.repeats))
    if args.folders:
        print(table([row for folder in args.folders for row in summarise(folder)]))


if __name__ == "__main__":
    main()
