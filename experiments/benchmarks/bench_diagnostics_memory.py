"""Peak device memory of the collapse diagnostics' cross scoring at the 0.5B preset's longest
contexts (an accelerator check: on a CPU the 0.5B scoring takes many minutes).

The trajectory-sample pairs of a Qwen2.5 preset score reasonings under 64 contexts of up to
~2.5k tokens (five 400-token turns). This builds a random Qwen2.5-0.5B-shaped model (bf16
compute), 64 contexts of 1.5k-2.5k tokens and ``--reasonings`` reasonings of 400 tokens, runs
``cross_scores`` with the diagnostics' default micro-batching twice (the first call compiles),
and prints the seconds and the process's peak device memory (the trainer's ``perf/*``
figures, ``ragen_jax.metrics.device_memory``; absent on a CPU).

    python -m experiments.benchmarks.bench_diagnostics_memory [--reasonings 8]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reasonings", type=int, default=8)
    ap.add_argument("--contexts", type=int, default=64)
    args = ap.parse_args()
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ragen_jax.config.schema import DiagnosticsConfig
    from ragen_jax.metrics import device_memory
    from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
    from ragen_jax.starpo.diagnostics import cross_scores

    model = Qwen2ForCausalLM(QwenConfig.qwen2_5_0_5b(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    inputs = [rng.integers(10, 150_000, rng.integers(1500, 2500)).tolist()
              for _ in range(args.contexts)]
    reasonings = [rng.integers(10, 150_000, 400).tolist() for _ in range(args.reasonings)]
    d = DiagnosticsConfig()
    before = device_memory()
    for call in ("first (compiles)", "second"):
        start = time.perf_counter()
        _, per_seq = cross_scores(model, inputs, reasonings, d.micro_batch_size, d.micro_batch_tokens)
        finite = bool(jnp.isfinite(per_seq).all())
        peak = device_memory().get("perf/max_memory_allocated_gib")
        print(f"{call}: {args.contexts} contexts x {args.reasonings} reasonings of 400 tokens, "
              f"{time.perf_counter() - start:.1f} s, scores finite {finite}, peak "
              + (f"{peak:.1f} GiB (before scoring {before['perf/memory_in_use_gib']:.1f})"
                 if peak is not None else "not reported by this device"), flush=True)


if __name__ == "__main__":
    main()
