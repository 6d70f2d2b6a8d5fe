"""One device's memory for the Qwen2.5 presets' update at their longest rows (compile only).

A Qwen2.5 preset trains mini-batches of ``actor.ppo_mini_batch_size`` (32) rows; with five
turns of up to ``rollout.response_length`` (400) tokens after the prompts, a whole-transcript
row reaches ~2.6k tokens. The update's memory grows with the rows of one pass (a mini-batch /
``actor.micro_batches``): under ``remat='dots'`` every layer keeps its weight matmuls' outputs
for the backward pass, ~1 MB a token for the 0.5B shape. This compiles the actor's train step
(AdamW on float32 master weights, bf16 compute, the presets' settings) for each shape and
micro-batch count and reads XLA's memory analysis; nothing is allocated, so it runs on a CPU.
The numbers are XLA:CPU's: a GPU compiler schedules its own buffers, so read them as the
scale, not to the GiB.

    python -m experiments.benchmarks.bench_preset_memory [--length 2624] [--rows 32]

Writes ``experiments/results/bench_preset_memory.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.benchmarks.shapes import GiB
from experiments.common import RESULTS

CASES = {  # shape: micro-batch counts to compile (the preset's own count among them)
    "0.5b": (1, 4, 8, 16),
    "1.5b": (4, 8, 16),
    "3b": (8, 16, 32),
    "7b": (32,),
}


def step_memory(shape: str, rows: int, length: int, micro_batches: int, remat: str) -> dict:
    """XLA's memory analysis of the compiled actor step, in GiB."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments.benchmarks.shapes import model_config
    from ragen_jax.config.resolve import update_settings
    from ragen_jax.models import Qwen2ForCausalLM
    from ragen_jax.starpo.optimizer_step import (
        TrainBatch,
        jit_optimizer_step,
        make_optimizer,
    )

    cfg = model_config(shape, dtype=jnp.bfloat16, remat=remat)
    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    ucfg = update_settings(micro_batches=micro_batches)
    opt = make_optimizer(ucfg)
    spec = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype)  # noqa: E731
    data = TrainBatch(spec(jnp.int32), spec(jnp.bool_), spec(jnp.int32), spec(jnp.float32),
                      spec(jnp.float32), spec(jnp.float32))
    compiled = jit_optimizer_step(graphdef, ucfg, opt).lower(
        params, rest, jax.eval_shape(opt.init, params), data).compile()
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes / GiB, "temporaries": m.temp_size_in_bytes / GiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="rows of a mini-batch (the presets': 32)")
    ap.add_argument("--length", type=int, default=2624, help="tokens a row (5 turns of 400 + prompts)")
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--out", default=str(RESULTS / "bench_preset_memory.md"))
    args = ap.parse_args()
    import jax

    from configs import base

    lines = [f"# One device's memory for the Qwen2.5 presets' update ({args.rows} x {args.length} tokens)", "",
             f"`python -m experiments.benchmarks.bench_preset_memory --rows {args.rows} --length {args.length} "
             f"--remat {args.remat}` (jax {jax.__version__}, XLA:CPU's memory analysis of the "
             f"compiled actor step; compile only). Arguments: float32 master weights, AdamW "
             f"moments and the batch (the step donates them: its outputs reuse them). "
             f"Temporaries: everything else the step holds at its peak.", "",
             "| shape | micro-batches | rows a pass | arguments GiB | temporaries GiB | total GiB | preset's count |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for shape, counts in CASES.items():
        preset = base.MICRO_BATCHES[f"qwen2.5-{shape}"]
        for n in counts:
            m = step_memory(shape, args.rows, args.length, n, args.remat)
            row = (f"| {shape} | {n} | {args.rows // n} | {m['arguments']:.1f} | {m['temporaries']:.1f} "
                   f"| {m['arguments'] + m['temporaries']:.1f} | {'yes' if n == preset else ''} |")
            print(row, flush=True)
            lines.append(row)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
