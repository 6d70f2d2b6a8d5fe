"""The sampler on float32 master weights: cast on the fly, or a bf16 copy refreshed per update?

With ``model.param_dtype=float32`` and ``model.dtype=bfloat16`` the trainer keeps float32
weights; the sampler can either run on them (every matmul casts its weight to bf16 inside the
jitted decode step) or on ``compute_copy(model)``, a bf16 copy made once per training step.
This times both (greedy, ``--new`` tokens after a ``--prompt``-token prompt, warm calls) and
the cost of making the copy, on the tiny shape and a 4-layer 0.5B-width shape.

    python -m experiments.benchmarks.bench_precision

Writes ``experiments/results/bench_precision.md``. On this CPU bf16 matmuls are emulated, so
the absolute numbers say little about a GPU/TPU; the ratio of bytes read per decode step (4
vs 2 per weight) is the argument there.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.common import RESULTS
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, compute_copy
from ragen_jax.rollout import Sampler, SamplingParams

SHAPES = {"tiny": lambda **kw: QwenConfig.tiny(**kw),
          "0.5b-width, 4 layers": lambda **kw: QwenConfig.qwen2_5_0_5b(num_hidden_layers=4, **kw)}


def decode_seconds(model, prompts, new: int, repeats: int = 3) -> float:
    sampler = Sampler(model)
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    jax.block_until_ready(sampler(prompts, key=jax.random.key(0), params=sp).tokens)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(sampler(prompts, key=jax.random.key(i), params=sp).tokens)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    rows = ["| shape | batch | float32 storage, cast per matmul s | bf16 copy s | copy / cast | "
            "making the copy s |", "|---|---|---|---|---|---|"]
    for name, make in SHAPES.items():
        model = Qwen2ForCausalLM(make(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
        prompts = [list(range(3, 3 + args.prompt))] * args.batch
        cast = decode_seconds(model, prompts, args.new)
        t0 = time.perf_counter()
        copy = compute_copy(model)
        jax.block_until_ready(nnx.state(copy))
        copy_s = time.perf_counter() - t0
        stored = decode_seconds(copy, prompts, args.new)
        rows.append(f"| {name} | {args.batch} | {cast:.3f} | {stored:.3f} | {stored / cast:.2f} | "
                    f"{copy_s:.3f} |")
        print(rows[-1], flush=True)
    lines = [f"# bench_precision (jax {jax.__version__}, {os.cpu_count()} CPU cores, "
             f"{jax.default_backend()})", "",
             f"Greedy decode of {args.new} tokens after {args.prompt} prompt tokens, bf16 compute "
             "(best of 3 warm calls).", ""] + rows
    out = RESULTS / "bench_precision.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
