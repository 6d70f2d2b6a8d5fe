"""Generation throughput: our jitted KV-cache sampler vs transformers ``generate`` (torch CPU).

Both run the same random weights (our model, written with ``save_pretrained`` and read back by
``transformers``) on the same prompts: random tokens, left-aligned, ``--prompt`` long, and
exactly ``--new`` new tokens (no stop token), greedy. Tokens/s counts generated tokens over the
whole call (prefill included). Our compile time is the first call minus a warm call.

    python -m experiments.benchmarks.bench_sampler            # tiny + 0.5B, batch 1..128
    python -m experiments.benchmarks.bench_sampler --quick    # tiny only
    python -m experiments.benchmarks.bench_sampler --sizes 0.5b --batches 1,8

Writes ``experiments/results/bench_sampler.md`` and prints the table. The roofline columns
put both frameworks against this CPU's float32 matmul peak (the best of a large square
``jnp.dot`` and ``torch.mm``, measured in the same run): ``work GFLOP`` is the least any
implementation must compute for the call (every prompt and generated token through every
projection, causal attention over the real context, the vocabulary projection only where a
token is sampled), ``GFLOP/s`` is that work over each one's wall time, and ``3x needs`` is the
rate at which a sampler would have to run to reach 3x transformers' tokens/s. Where that
exceeds the measured peak no float32 implementation can reach 3x on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks.roofline import work_gflop
from experiments.common import RESULTS
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, save_pretrained
from ragen_jax.rollout import Sampler, SamplingParams

PRESETS = {"tiny": QwenConfig.tiny, "0.5b": QwenConfig.qwen2_5_0_5b}


def bench_ours(model, prompts, new):
    """(warm seconds, compile seconds, tokens) of one ``new``-token greedy call."""
    sampler = Sampler(model)
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    t0 = time.perf_counter()
    out = sampler(prompts, key=jax.random.key(0), params=sp)
    jax.block_until_ready(out.tokens)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = sampler(prompts, key=jax.random.key(1), params=sp)
    jax.block_until_ready(out.tokens)
    warm = time.perf_counter() - t0
    assert int(out.lengths.min()) == new
    return warm, first - warm, np.asarray(out.tokens)


def bench_hf(hf, prompts, new):
    """(seconds, tokens) of one ``new``-token greedy ``generate`` call (after a warm-up)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              eos_token_id=None, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        hf.generate(ids[:1, :8], **dict(kw, attention_mask=torch.ones_like(ids[:1, :8]),
                                        max_new_tokens=2, min_new_tokens=2))  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        dt = time.perf_counter() - t0
    return dt, out[:, ids.shape[1]:].numpy()


def split_time(total_s: float, first_s: float, new: int) -> tuple[float, float]:
    """(prefill seconds, decode milliseconds per token) from a ``new``-token call and a
    1-token call (prefill and the first sampled token) on the same prompts."""
    return first_s, 1e3 * (total_s - first_s) / max(new - 1, 1)


def matmul_peak(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """float32 GFLOP/s of an ``n x n`` by ``n x n`` matmul in JAX and in torch (best of
    ``repeats``): the roofline both samplers are measured against."""
    import torch

    a = jnp.asarray(np.random.RandomState(0).randn(n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = {"jax": float("inf"), "torch": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        dot(a, a).block_until_ready()
        best["jax"] = min(best["jax"], time.perf_counter() - t0)
    ta = torch.from_numpy(np.asarray(a))
    with torch.inference_mode():
        torch.mm(ta, ta)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(ta, ta)
            best["torch"] = min(best["torch"], time.perf_counter() - t0)
    return {name: 2 * n**3 / t / 1e9 for name, t in best.items()}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,0.5b", help="comma list of: " + ",".join(PRESETS))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--big-batches", default=None,
                    help="batches for the 0.5b model (default: --batches); its prefill is slow")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny preset only")
    ap.add_argument("--skip-hf", action="store_true", help="only time our sampler")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads (0: torch's default); OpenMP threads slow down "
                         "badly when another process takes a core")
    ap.add_argument("--out", default=str(RESULTS / "bench_sampler.md"))
    return ap.parse_args(argv)


def size_rows(size: str, batches: list[int], args) -> list[tuple]:
    """One shape's measurements, a tuple per batch: tokens/s of both, speed-up, compile s,
    identical rows, work and GFLOP/s, and the prefill / decode split of both."""
    import torch
    import transformers

    cfg = PRESETS[size]()
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        hf = None if args.skip_hf else (
            transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
    rng = np.random.RandomState(0)
    rows = []
    for b in batches:
        prompts = rng.randint(10, cfg.vocab_size, (b, args.prompt)).tolist()
        ours, compile_s, our_tokens = bench_ours(model, prompts, args.new)
        ours_split = split_time(ours, bench_ours(model, prompts, 1)[0], args.new)
        if hf is not None:
            theirs, hf_tokens = bench_hf(hf, prompts, args.new)
            theirs_split = split_time(theirs, bench_hf(hf, prompts, 1)[0], args.new)
            agree = float((hf_tokens == our_tokens).all(axis=1).mean())
        else:
            theirs, agree, theirs_split = float("nan"), float("nan"), (float("nan"),) * 2
        n = b * args.new
        work = work_gflop(cfg, b, args.prompt, args.new)
        row = (size, b, n / ours, n / theirs, theirs / ours, compile_s, agree, work,
               work / ours, work / theirs, 3 * work / theirs, *ours_split, *theirs_split)
        rows.append(row)
        print("{:>5} B={:<4} ours {:9.1f} tok/s  transformers {:9.1f} tok/s  x{:5.2f}  "
              "compile {:5.1f}s  greedy rows equal {:.2f}  work {:.1f} GFLOP: ours {:.0f} "
              "GFLOP/s, transformers {:.0f}, 3x needs {:.0f}; prefill s / decode ms per "
              "token: ours {:.3f} / {:.2f}, transformers {:.3f} / {:.2f}".format(*row),
              flush=True)
    return rows


def report(rows: list[tuple], peak: dict[str, float], args) -> str:
    """The markdown tables: throughput and roofline, then prefill and decode apart."""
    import torch
    import transformers

    lines = [
        "# Sampler throughput: ours (JAX, jitted) vs transformers `generate` (torch CPU)",
        "",
        f"Prompt {args.prompt} tokens, {args.new} new tokens (greedy, no early stop), float32, "
        f"same random weights. Tokens/s = generated tokens / wall time of one call, prefill "
        f"included. Host: {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"CPUs (other load on the machine makes timings vary); jax {jax.__version__}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}.",
        "",
        "float32 matmul peak of this machine (2048 x 2048 x 2048, best of 10): "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()) + ".",
        "",
        "| model | batch | ours tok/s | transformers tok/s | speed-up | our compile s | "
        "greedy rows identical | work GFLOP | ours GFLOP/s | transformers GFLOP/s | 3x needs GFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, b, o, t, x, c, a, w, og, tg, need, *_ in rows:
        lines.append(f"| {size} | {b} | {o:.1f} | {t:.1f} | {x:.2f}x | {c:.1f} | {a:.2f} | "
                     f"{w:.1f} | {og:.0f} | {tg:.0f} | {need:.0f} |")
    lines += [
        "",
        "Where the time goes: prefill = a 1-token call (the prompt and the first sampled token); "
        "decode = the rest of the call per generated token.",
        "",
        "| model | batch | ours prefill s | transformers prefill s | ours decode ms/token-step "
        "| transformers decode ms/token-step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for size, b, *_, op, od, tp, td in rows:
        lines.append(f"| {size} | {b} | {op:.3f} | {tp:.3f} | {od:.2f} | {td:.2f} |")
    return "\n".join(lines) + "\n"




def main() -> None:
    args = parse()
    sizes = ["tiny"] if args.quick else args.sizes.split(",")
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    peak = matmul_peak()
    print("float32 matmul peak (2048^3): " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()),
          flush=True)
    rows = []
    for size in sizes:
        size_batches = batches
        if size != "tiny" and args.big_batches:
            size_batches = [int(b) for b in args.big_batches.split(",")]
        rows += size_rows(size, size_batches, args)
    table = report(rows, peak, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    print(table)


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing
    main()
