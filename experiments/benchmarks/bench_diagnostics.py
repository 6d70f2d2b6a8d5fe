"""Collapse-diagnostics cost: our prefix-cached cross scoring vs scoring every [x | z] in full.

RAGEN's MI diagnostics score every sampled reasoning ``z_i`` under every input ``x_j``. Done
naively (RAGEN does this) that is ``n_z * n_x`` forward passes over ``|x| + |z|`` tokens;
``ragen_jax.starpo.diagnostics.cross_scores`` encodes each input once and runs only the
``z`` tokens of each pair on a copy of its cache. This script times both on the same random
model and data (the baseline is the straightforward batched teacher forcing of full
sequences, micro-batched the same way) and checks they agree.

    python -m experiments.benchmarks.bench_diagnostics [--quick]

Writes ``experiments/results/bench_diagnostics.md``.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import RESULTS
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.starpo.diagnostics import cross_scores
from ragen_jax.starpo.token_scores import token_logprobs


@nnx.jit
def _full_scores(model, ids, real, positions, scored):
    logp, _ = token_logprobs(model, ids, real, positions)
    return jnp.sum(logp * scored, axis=-1)


def full_sequence_scores(model, inputs, reasonings, micro_batch_size: int) -> np.ndarray:
    """The baseline: every ``[x_j | z_i]`` teacher-forced from scratch ``[n_z, n_x]``."""
    n_z, n_x = len(reasonings), len(inputs)
    n = n_z * n_x
    rows = -(-n // micro_batch_size) * micro_batch_size
    length = -(-(max(map(len, inputs)) + max(map(len, reasonings))) // 64) * 64
    ids = np.zeros((rows, length), np.int32)
    real = np.zeros((rows, length), bool)
    real[n:, 0] = True
    scored = np.zeros((rows, length), np.float32)
    for i, z in enumerate(reasonings):
        for j, x in enumerate(inputs):
            r, seq = i * n_x + j, list(x) + list(z)
            ids[r, :len(seq)], real[r, :len(seq)] = seq, True
            scored[r, len(x):len(seq)] = 1.0
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
    out = [_full_scores(model, *(jnp.asarray(a[s:s + micro_batch_size]) for a in (ids, real, pos, scored)))
           for s in range(0, rows, micro_batch_size)]
    return np.asarray(jnp.concatenate(out))[:n].reshape(n_z, n_x)


def timed(fn, repeats: int, *args) -> tuple[float, float, object]:
    """(first call s, median later call s, result) of ``fn(*args)``."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times)), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    # The tiny preset's model; contexts like its FrozenLake trajectories (~650 tokens before
    # the last turn) and first turns (~150); answers ~8 tokens.
    cfg = QwenConfig.tiny(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    cases = [("first-turn pairs", 32, 8, 150), ("trajectory pairs", 32, 32, 650)]
    if args.quick:
        cases = [("trajectory pairs", 8, 8, 300)]
    rows = ["| pairs | n_z x n_x | input tokens | full x+z s | prefix-cached s | speed-up | "
            "max abs diff | compile s (full / cached) |", "|---|---|---|---|---|---|---|---|"]
    for name, n_z, n_x, x_len in cases:
        inputs = [rng.integers(10, cfg.vocab_size, int(rng.integers(x_len // 2, x_len))).tolist()
                  for _ in range(n_x)]
        reasonings = [rng.integers(10, cfg.vocab_size, int(rng.integers(4, 12))).tolist()
                      for _ in range(n_z)]
        f_first, f_t, full = timed(full_sequence_scores, 1, model, inputs, reasonings, 128)
        c_first, c_t, ours = timed(cross_scores, 2, model, inputs, reasonings, 128)
        ours = ours[1]
        diff = float(np.max(np.abs(np.asarray(ours) - full)))
        rows.append(f"| {name} | {n_z} x {n_x} | {x_len // 2}-{x_len} | {f_t:.2f} | {c_t:.3f} | "
                    f"{f_t / c_t:.1f}x | {diff:.1e} | {f_first - f_t:.1f} / {c_first - c_t:.1f} |")
        print(rows[-1], flush=True)
    text = "\n".join([f"# bench_diagnostics (jax {jax.__version__}, {os.cpu_count()} CPU cores)", "",
                      "Cross scoring of the MI diagnostics on the tiny preset's model (float32), "
                      "one timed run after the compiling one (median of 2 for the cached path); micro-batches of 128 pairs.", "", *rows])
    out = RESULTS / "bench_diagnostics.md"
    out.write_text(text + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
